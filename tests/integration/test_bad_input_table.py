"""One table of bad inputs, every config section and every command, run through the real CLI in this process
(``cli.main``: they all stop before training, so a process of their own would only add its start-up).

Each case asserts exit code 2, no traceback on stderr, and the texts its message must hold: the key or
argument named, and what to do. Commands given a config read ``{config}``, a tiny GPT run whose
output directory holds an earlier run's files; a refused ``train`` must leave them untouched.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.chat_fixtures import write_chat_jsonl, write_chat_tokenizer
from tests.harness import as_new_user, run_cli_in_process, tiny_config, write_config

SENTINEL = "earlier results\n"
MLP = [
    "model.factory=paratrain.models.mlp:build_mlp",
    "model.args={}",
    "data.factory=paratrain.data.regression:build_regression_dataset",
    "data.args={in_features: 20}",
    "loss.factory=paratrain.losses:mse",
]
TWO = ["--nproc-per-node", "2"]


def REPLICA_GROUP(group: int) -> list[str]:  # noqa: N802 - reads as the constants beside it
    return ["--replica-group", str(group), "--replica-groups", "2"]


TINY_LLAMA = [
    "model.factory=paratrain.models.hf:causal_lm",
    "model.args={model_type: llama, vocab_size: 128, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, "
    "num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 16}",
]
PREFERENCE = [
    *[
        "model.factory=paratrain.models.hf:causal_lm",
        "model.args={model_type: llama, vocab_size: 32, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, "
        "num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 32}",
    ],
    "data.factory=paratrain.data.preference:preference_data",
    "loss.factory=paratrain.losses:dpo",
    "eval.factory=null",
]
CHAT = [
    "data.factory=paratrain.data.chat:chat_data",
    "data.args={files: {tmp}/chat.jsonl, tokenizer: {chat_tokenizer}, seq_len: 16}",
]


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]  # formatted with the files of ``files`` ({config}, {tmp}, ...)
    expected: tuple[str, ...]  # each must appear in stderr
    sys_path: str = ""  # a folder put first on sys.path: what a case finds installed ({old_transformers})
    missing: tuple[str, ...] = ()  # packages the case finds not installed (None in sys.modules: import fails)


def case(*argv: str, expect: str | tuple[str, ...], sys_path: str = "", missing: tuple[str, ...] = ()) -> Case:
    return Case(argv, (expect,) if isinstance(expect, str) else expect, sys_path, missing)


def train(*extra: str, expect: str | tuple[str, ...], sys_path: str = "", missing: tuple[str, ...] = ()) -> Case:
    return case("train", "{config}", *extra, expect=expect, sys_path=sys_path, missing=missing)


CASES: dict[str, Case] = {
    # --- the config file and overrides -------------------------------------------------------------
    "config file missing": case("train", "{tmp}/nope.yaml", expect="nope.yaml does not exist"),
    "config file is a directory": case("train", "{tmp}", expect="is a directory"),
    "config file not UTF-8": case("config", "show", "{latin1}", expect="is not UTF-8 text (byte 16 is 0xe9)"),
    "duplicate keys": case("config", "show", "{twice}", expect="duplicate key 'max_steps' on lines 2 and 4"),
    "duplicate sections": case("config", "show", "{sections}", expect="duplicate key 'optim' on lines 1 and 5"),
    "config not YAML": case("train", "{not_yaml}", expect=("not_yaml.yaml is not valid YAML",)),
    "config a list": case("train", "{a_list}", expect="must hold a mapping of sections, not list"),
    "config with NaN in the file": case("train", "{nan_file}", expect=("train.grad_clip", "finite")),
    "override without =": train("train.max_steps", expect="must look like section.key=value"),
    "override into a value": train("train.max_steps.x=1", expect="train.max_steps is a value, not a section"),
    "override of an empty key part": train("train..max_steps=1", expect="must look like section.key=value"),
    "unknown section": train("trainer.max_steps=5", expect=("trainer", "unknown key")),
    # --- run ------------------------------------------------------------------------------------
    "run.output_dir empty": case("config", "show", "{config}", "run.output_dir=", expect="run.output_dir: is empty"),
    "run.output_dir blank": case("config", "show", "{config}", "run.output_dir=' '", expect="run.output_dir: is empty"),
    "run.output_dir under a file": train("run.output_dir={blocker}/run", expect=("run.output_dir", "is a file")),
    "run.name a list": train("run.name=[1,2]", expect="run.name"),
    "run unknown key": train("run.nmae=x", expect=("run.nmae", "unknown key")),
    "run.output_dir locked by a run on another host": train(
        "run.output_dir={locked}", expect=("in use by a run on host node-7", "delete {locked}/paratrain.lock")
    ),
    # --- train ----------------------------------------------------------------------------------
    "train unknown key": train("train.max_stepz=5", expect=("train.max_stepz", "unknown key")),
    "train.max_steps wrong type": train("train.max_steps=many", expect=("train.max_steps", "valid integer", "'many'")),
    "train.max_steps zero": train("train.max_steps=0", expect=("train.max_steps", "greater than 0")),
    "train.global_batch_size zero": train("train.global_batch_size=0", expect="train.global_batch_size"),
    "train.micro_batch_size negative": train("train.micro_batch_size=-1", expect="train.micro_batch_size"),
    "global batch not divisible by micro batch": train(
        "train.global_batch_size=10", "train.micro_batch_size=4", expect=("train.global_batch_size=10", "not divisible")
    ),
    "batch not divisible by micro batch x data-parallel size": train(
        "parallel.strategy=ddp",
        "train.global_batch_size=6",
        *TWO,
        expect=("train.global_batch_size=6", "micro_batch_size=2 x data-parallel size 2", "multiple of 4"),
    ),
    "train.grad_clip zero": train("train.grad_clip=0", expect="train.grad_clip"),
    "train.grad_clip infinite": train("train.grad_clip=.inf", expect="train.grad_clip:"),
    "train.seed not a number": train("train.seed=abc", expect="train.seed"),
    "train.device unknown": train("train.device=tpu", expect=("train.device", "'auto', 'cpu' or 'cuda'")),
    "train.device cuda without a GPU": train("train.device=cuda", expect=("train.device=cuda", "train.device=cpu")),
    "train.deterministic not a bool": train("train.deterministic=maybe", expect="train.deterministic"),
    "train.nonfinite unknown": train("train.nonfinite=ignore", expect="train.nonfinite:"),
    "train.nonfinite_max_skips zero": train("train.nonfinite_max_skips=0", expect="train.nonfinite_max_skips:"),
    "train.check_memory not a bool": train("train.check_memory=perhaps", expect="train.check_memory"),
    "train.host_memory not a size": train(
        "train.host_memory=lots", expect="train.host_memory='lots' is not a memory size; write a positive number"
    ),
    "host memory too small for the node's processes": train(
        "train.host_memory=1MB",
        expect=("of host memory per node, but only 977 KiB is available (train.host_memory)", "--skip-memory-check"),
    ),
    # --- optim ----------------------------------------------------------------------------------
    "optim.name unknown": train("optim.name=adam", expect=("optim.name", "'adamw' or 'sgd'")),
    "optim.lr negative": train("optim.lr=-1", expect="optim.lr"),
    "optim.lr infinite": train("optim.lr=.inf", expect="optim.lr:"),
    "optim.lr NaN": train("optim.lr=.nan", expect="optim.lr:"),
    "optim.betas with 1": train("optim.betas=[0.9,1.0]", expect="optim.betas:"),
    "optim.betas negative": train("optim.betas=[-0.1,0.9]", expect="optim.betas:"),
    "optim.betas one value": train("optim.betas=[0.9]", expect=("optim.betas: got [0.9]; give two numbers",)),
    "optim.betas three values": train("optim.betas=[0.9,0.95,0.99]", expect="optim.betas: got [0.9, 0.95, 0.99]"),
    "optim.momentum 1": train("optim.name=sgd", "optim.momentum=1.0", expect="optim.momentum:"),
    "optim.eps zero": train("optim.eps=0", expect="optim.eps:"),
    "optim.weight_decay negative": train("optim.weight_decay=-0.1", expect="optim.weight_decay:"),
    "optim.warmup_steps negative": train("optim.warmup_steps=-1", expect="optim.warmup_steps"),
    "optim.schedule unknown": train("optim.schedule=linear", expect=("optim.schedule", "'cosine' or 'constant'")),
    "optim.min_lr_ratio above 1": train("optim.min_lr_ratio=2", expect="optim.min_lr_ratio"),
    "optim.lr_scaling unknown": train("optim.lr_scaling=cubic", expect="optim.lr_scaling"),
    "optim.fused unknown": train("optim.fused=always", expect=("optim.fused", "'auto', 'on' or 'off'")),
    "fused optimizer with tensor parallel alone": train(
        "parallel.strategy=tp", "optim.fused=on", *TWO, expect=("optim.fused=on", "set optim.fused=auto")
    ),
    # --- parallel -------------------------------------------------------------------------------
    "parallel.strategy unknown": train("parallel.strategy=zero3", expect="parallel.strategy"),
    "one-process strategy on two processes": train(
        "parallel.strategy=single", *TWO, expect=("parallel.strategy=single", "remove parallel.strategy")
    ),
    "degrees whose product is not the world size": train(
        "parallel.strategy=fsdp",
        "parallel.dp_shard=3",
        *TWO,
        expect=("parallel.dp_shard=3", "does not fit the world size 2", "product is 3"),
    ),
    "two degrees left to fill": train(
        "parallel.dp_shard=-1", "parallel.tp=-1", *TWO, expect=("only one degree may be -1", "parallel.dp_shard")
    ),
    "a degree of zero": train("parallel.tp=0", expect=("parallel.tp=0", "a degree is a positive number")),
    # --- parallel.fault_tolerance: replica groups (torchft) -------------------------------------------
    "replica group id out of range": train(
        *REPLICA_GROUP(2), expect=("parallel.fault_tolerance.replica_group=2", "between 0 and 1")
    ),
    "replica groups: only one": train(
        "--replica-group", "0", "--replica-groups", "1", expect=("replica_groups=1", "at least 2 replica groups")
    ),
    "replica group without the count": train(
        "--replica-group", "0", expect=("--replica-group needs --replica-groups",)
    ),
    "replica groups: lighthouse unreachable": train(
        *REPLICA_GROUP(0),
        "parallel.fault_tolerance.lighthouse=http://127.0.0.1:1",
        "parallel.fault_tolerance.connect_timeout_s=0.3",
        expect=("lighthouse=http://127.0.0.1:1 did not answer", "connect_timeout_s=0.3", "paratrain lighthouse"),
    ),
    "replica groups: lighthouse not an address": train(
        *REPLICA_GROUP(0), "parallel.fault_tolerance.lighthouse=nowhere", expect="write it as http://HOST:PORT"
    ),
    "replica groups around a pipeline": train(
        *REPLICA_GROUP(0), "parallel.pp=2", *TWO, expect=("parallel.pp=2 with", "outermost", "parallel.pp=1")
    ),
    "replica groups: quorum larger than the groups": train(
        *REPLICA_GROUP(0),
        "parallel.fault_tolerance.min_replica_groups=3",
        expect=("min_replica_groups=3 is more than", "at most 2"),
    ),
    "replica groups: an unknown batch mode": train(
        *REPLICA_GROUP(0),
        "parallel.fault_tolerance.batch=same",
        expect=("fault_tolerance.batch", "'fixed' or 'shrink'"),
    ),
    "replica groups: no wait for a lighthouse": train(
        *REPLICA_GROUP(0),
        "parallel.fault_tolerance.lighthouse_wait_s=0",
        expect=("fault_tolerance.lighthouse_wait_s", "greater than 0"),
    ),
    "lighthouse --bind not an address": case("lighthouse", "--bind", "nowhere", expect=("--bind='nowhere'",)),
    "tp degree that does not divide the attention heads": train(
        "parallel.strategy=tp",
        "model.args.n_head=3",
        "model.args.n_embd=33",
        *TWO,
        expect="parallel.tp=2 does not divide model.args.n_head=3",
    ),
    "tp on a model that declares no plan": train(
        "parallel.strategy=tp",
        *MLP,
        *TWO,
        expect=("parallel.tp=2: the model declares no tensor-parallel plan", "block_tp_plan"),
    ),
    "a strategy contradicting its own degree": train(
        "parallel.strategy=tp",
        "parallel.tp=1",
        *TWO,
        expect=("parallel.strategy=tp contradicts parallel.tp=1", "Remove parallel.strategy"),
    ),
    "cp not dividing the sequence in two chunks per rank": train(
        "parallel.cp=2",
        "data.args.block_size=14",
        *TWO,
        expect=("data.args.block_size=14 is not divisible by 2 x parallel.cp = 4", "multiple of 4"),
    ),
    "cp not dividing the attention heads": train(
        "parallel.cp=2",
        "model.args.n_head=1",
        *TWO,
        expect=("parallel.cp=2 x parallel.tp=1 = 2 does not divide model.args.n_head=1",),
    ),
    "cp on a model whose attention paratrain cannot reach": train(
        "parallel.cp=2", *MLP, *TWO, expect=("parallel.cp=2", "does not define use_sequence_functions")
    ),
    "ring attention exchange": train(
        "parallel.cp=2",
        "parallel.cp_attention=ring",
        *TWO,
        expect=("parallel.cp_attention=ring", "set parallel.cp_attention=all_to_all"),
    ),
    "document masking beside a pipeline": train(
        "data.args.document_mask=true",
        "parallel.pp=2",
        *TWO,
        expect=(
            "data.args.document_mask=true with parallel.pp=2",
            "set data.args.document_mask=false or remove parallel.pp",
        ),
    ),
    "fp16 with tensor parallel alone": train(
        "parallel.strategy=tp", "precision=fp16", *TWO, expect=("precision=fp16 with tensor parallel alone",)
    ),
    "fp16 with fsdp cpu offload": train(
        "parallel.strategy=fsdp",
        "precision=fp16",
        "parallel.fsdp.cpu_offload=true",
        *TWO,
        expect="precision=fp16 with parallel.fsdp.cpu_offload=true",
    ),
    "fsdp cpu offload on a CPU run": train(
        "parallel.strategy=fsdp",
        "parallel.fsdp.cpu_offload=true",
        "train.device=cpu",
        *TWO,
        expect=("parallel.fsdp.cpu_offload=true", "this run trains on the CPU"),
    ),
    "compile with DataParallel": train("parallel.strategy=dp", "parallel.compile=true", expect="parallel.compile=true"),
    "auto beside a degree": train(
        "parallel.strategy=auto", "parallel.tp=2", *TWO, expect=("parallel.strategy=auto", "parallel.tp=2")
    ),
    "parallel.collective_timeout_s zero": train(
        "parallel.collective_timeout_s=0", expect="parallel.collective_timeout_s"
    ),
    "parallel.ddp.bucket_cap_mb negative": train("parallel.ddp.bucket_cap_mb=-1", expect="parallel.ddp.bucket_cap_mb"),
    "parallel.ddp unknown key": train("parallel.ddp.buckets=2", expect=("parallel.ddp.buckets", "unknown key")),
    "parallel.fsdp.param_dtype unknown": train("parallel.fsdp.param_dtype=fp8", expect="parallel.fsdp.param_dtype"),
    "parallel.fsdp.grad_sync unknown": train("parallel.fsdp.grad_sync=never", expect="parallel.fsdp.grad_sync"),
    "parallel.fsdp.prefetch_blocks negative": train(
        "parallel.fsdp.prefetch_blocks=-1", expect="parallel.fsdp.prefetch_blocks"
    ),
    "parallel.activation_checkpointing unknown": train(
        "parallel.activation_checkpointing=partial",
        expect=("parallel.activation_checkpointing", "'none', 'full' or 'selective'"),
    ),
    "parallel.activation_checkpointing_every zero": train(
        "parallel.activation_checkpointing=selective",
        "parallel.activation_checkpointing_every=0",
        expect=("parallel.activation_checkpointing_every", "greater than 0"),
    ),
    # float8 (parallel/float8.py, checks/float8_settings.py)
    "float8 on the CPU": train(
        "parallel.float8.enabled=true",
        expect=(
            "parallel.float8.enabled=true needs a CUDA GPU of compute capability 8.9 or newer",
            "this run trains on the CPU",
            "parallel.float8.emulate=true",
        ),
    ),
    # Two processes: refused before torchrun starts them, not by each worker's conversion.
    "float8 without torchao": train(
        "parallel.float8.enabled=true",
        "parallel.float8.emulate=true",
        "parallel.strategy=fsdp",
        *TWO,
        missing=("torchao",),
        expect=("trains through torchao, which is not installed", "pip install 'paratrain[float8]'"),
    ),
    "float8 with a torchao release out of range": train(
        "parallel.float8.enabled=true",
        "parallel.float8.emulate=true",
        "parallel.strategy=fsdp",
        *TWO,
        sys_path="{old_torchao}",
        expect=("torchao 0.9.0 is installed, but paratrain supports torchao>=", "pip install 'paratrain[float8]'"),
    ),
    "float8 rowwise without bf16 compute": train(
        "parallel.float8.enabled=true",
        "parallel.float8.scaling=rowwise",
        expect=("parallel.float8.scaling=rowwise needs bf16 compute", "computes in fp32", "set precision=bf16"),
    ),
    "float8 with LoRA adapters": train(
        *TINY_LLAMA,
        "model.lora={r: 4}",
        "parallel.float8.enabled=true",
        "parallel.float8.emulate=true",
        expect=("parallel.float8.enabled=true with model.lora is not supported", "parallel.float8.enabled=false"),
    ),
    "parallel.float8.scaling unknown": train(
        "parallel.float8.scaling=blockwise", expect=("parallel.float8.scaling", "'tensorwise' or 'rowwise'")
    ),
    "parallel.float8 unknown key": train(
        "parallel.float8.recipe=rowwise", expect=("parallel.float8.recipe", "unknown key")
    ),
    # --- pipeline -------------------------------------------------------------------------------
    "pipeline.schedule unknown": train("pipeline.schedule=Zigzag", expect="pipeline.schedule"),
    "pipeline.balance unknown": train("pipeline.balance=flops", expect="pipeline.balance"),
    "pipeline.balance=time on a model too large to time whole": train(
        "parallel.pp=2",
        "pipeline.balance=time",
        "model.args={block_size: 16, n_layer: 4, n_head: 16, n_embd: 8192}",
        *TWO,
        expect=("pipeline.balance=time times each piece on a whole copy", "pipeline.balance=parameters"),
    ),
    "debug.dump_initial_weights on a large model": train(
        "debug.dump_initial_weights=true",
        "model.args={block_size: 16, n_layer: 4, n_head: 16, n_embd: 4096}",
        expect=("debug.dump_initial_weights=true gathers every weight to rank 0", "turn it off"),
    ),
    "pipeline.microbatches zero": train("pipeline.microbatches=0", expect="pipeline.microbatches"),
    "pipeline.stages_per_rank zero": train("pipeline.stages_per_rank=0", expect="pipeline.stages_per_rank"),
    "pipeline split point that is not a piece": train(
        "parallel.strategy=pp", "pipeline.split_points=[nope]", *TWO, expect="pipeline.split_points"
    ),
    "fewer micro-batches than pipeline stages": train(
        "--dry-run",  # a dry run: eight processes are not started even if the check ever let this through
        "parallel.strategy=pp",
        "--nproc-per-node",
        "8",
        expect=("pipeline.microbatches=4 over parallel.pp=8", "must be greater than or equal"),
    ),
    "evaluation under a pipeline": train(
        "parallel.strategy=pp",
        "eval.factory=paratrain.data.text:build_char_dataset",
        *TWO,
        expect=("eval.factory='paratrain.data.text:build_char_dataset'", "not supported with pipeline parallel"),
    ),
    "eval.batch_size zero": train("eval.batch_size=0", expect="eval.batch_size"),
    # --- precision ------------------------------------------------------------------------------
    "precision unknown": train("precision=fp8", expect=("precision", "'fp32', 'bf16' or 'fp16'")),
    # --- checkpoint -----------------------------------------------------------------------------
    "resume path that does not exist": train(
        "checkpoint.resume=/nonexistent/step-5", expect=("checkpoint.resume=/nonexistent/step-5", "no such checkpoint")
    ),
    "resume never beside checkpoints": train(
        "run.output_dir={with_checkpoints}",
        "checkpoint.resume=never",
        expect=("checkpoint.resume=never", "use checkpoint.resume=auto"),
    ),
    "resume path that is not a checkpoint": train("checkpoint.resume={tmp}", expect="checkpoint.resume="),
    "checkpoint.every_steps negative": train("checkpoint.every_steps=-1", expect="checkpoint.every_steps"),
    "checkpoint.keep_last zero": train("checkpoint.keep_last=0", expect="checkpoint.keep_last"),
    "checkpoint.async_save not a bool": train("checkpoint.async_save=sometimes", expect="checkpoint.async_save"),
    # --- log ------------------------------------------------------------------------------------
    "log.every_steps zero": train("log.every_steps=0", expect="log.every_steps"),
    "log.trackers unknown": train("log.trackers=[csv]", expect="log.trackers"),
    "log.progress_bar unknown": train("log.progress_bar=maybe", expect="log.progress_bar"),
    "log.trackers wandb without a login": train(
        "log.trackers=[jsonl,wandb]",
        expect=("log.trackers names 'wandb' but no W&B login", "`wandb login`", "WANDB_API_KEY", "WANDB_MODE=offline"),
    ),
    # --- model ----------------------------------------------------------------------------------
    "model factory that does not import": train(
        "model.factory=no_such_package.models:build", expect=("model.factory", "no_such_package", "does not import")
    ),
    "model factory without a colon": train(
        "model.factory=paratrain.models.gpt", expect=("model.factory=", "must look like 'package.module:callable'")
    ),
    "model factory name missing from its module": train(
        "model.factory=paratrain.models.gpt:nope", expect="model.factory"
    ),
    "model factory argument it does not take": train(
        "model.args.n_layers=3", expect=("model.args", "n_layers", "it accepts: vocab_size")
    ),
    "model factory refusing its arguments": train(
        "model.args.n_embd=30", "model.args.n_head=4", expect=("model.args.n_embd=30", "model.args.n_head=4")
    ),
    "moe router top-k larger than the experts": train(
        "model.args.moe_experts=4", "model.args.moe_top_k=5", expect=("model.args.moe_top_k=5", "moe_experts=4")
    ),
    "expert parallel not dividing the experts": train(
        "model.args.moe_experts=3",
        "model.args.moe_top_k=1",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        *TWO,
        expect=("parallel.ep=2 does not divide model.args.moe_experts=3", "divisor of 3"),
    ),
    "expert parallel on a model with no experts": train(
        "parallel.dp_shard=2", "parallel.ep=2", *TWO, expect=("parallel.ep=2", "declares no experts", "moe_experts")
    ),
    "expert parallel not dividing the data-parallel ranks": train(
        "model.args.moe_experts=4",
        "parallel.dp_replicate=2",
        "parallel.ep=2",
        *TWO,
        expect=("parallel.ep=2 does not divide parallel.dp_shard=1 x parallel.cp=1 = 1", "raise parallel.dp_shard"),
    ),
    "expert parallel not dividing a transformers family's experts": train(
        "model.factory=paratrain.models.hf:causal_lm",
        "model.args={model_type: qwen3_moe, vocab_size: 128, hidden_size: 16, intermediate_size: 32, "
        "moe_intermediate_size: 16, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, "
        "num_experts: 3, num_experts_per_tok: 2, max_position_embeddings: 16}",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        *TWO,
        expect=("parallel.ep=2 does not divide model.args.num_experts=3", "divisor of 3"),
    ),
    "expert parallel on a transformers family the dispatch does not support": train(
        "model.factory=paratrain.models.hf:causal_lm",
        "model.args={model_type: gpt_oss, vocab_size: 128, hidden_size: 16, intermediate_size: 32, head_dim: 8, "
        "num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, num_local_experts: 4, "
        "num_experts_per_tok: 2, max_position_embeddings: 16}",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        *TWO,
        expect=(
            "parallel.ep=2: transformers' GptOssForCausalLM computes its experts in GptOssExperts",
            "remove parallel.ep",
        ),
    ),
    "moe load-balancing loss under a pipeline": train(
        "model.args.moe_experts=4",
        "parallel.strategy=pp",
        *TWO,
        expect=("model.args.moe_aux_loss_coef=0.01", "model.args.moe_aux_loss_coef=0 to train under pp"),
    ),
    "model.pretrained that does not exist": train("model.pretrained=/nonexistent/model", expect="model.pretrained"),
    "model.pretrained with weights cut short": train(
        "model.pretrained={cut_model}", expect=("cut_model/model.safetensors", "damaged or incomplete")
    ),
    "model.args a list": train("model.args=[1]", expect="model.args"),
    # LoRA (paratrain.models.lora)
    "model.lora on a model peft cannot wrap": train(
        "model.lora={r: 4}", expect=("model.lora: GPT is not a transformers model", "remove model.lora")
    ),
    "model.lora.r zero": train("model.lora={r: 0}", expect=("model.lora.r", "greater than 0")),
    # --- fine-tuning objectives: packed samples, preference data and DPO ------------------------------------
    "packing with a model that cannot keep samples apart": train(
        *CHAT,
        "model.factory=paratrain.models.hf:causal_lm",
        "model.args={model_type: gpt2, vocab_size: 32, n_embd: 16, n_layer: 1, n_head: 2, n_positions: 32}",
        expect=("data.args.pack=true (packing samples)", "set data.args.pack=false", "Llama, Mistral, Qwen2, Qwen3"),
    ),
    "preference row without rejected": train(
        *PREFERENCE,
        "data.args={files: {pref_missing}, tokenizer: {chat_tokenizer}, seq_len: 16}",
        expect=("pref_missing.jsonl row 1 has no 'rejected' column", "prompt, chosen and rejected"),
    ),
    "preference row whose chosen is its rejected": train(
        *PREFERENCE,
        "data.args={files: {pref_same}, tokenizer: {chat_tokenizer}, seq_len: 16}",
        expect="'chosen' and 'rejected' are the same completion",
    ),
    "preference prompt longer than seq_len": train(
        *PREFERENCE,
        "data.args={files: {pref_long}, tokenizer: {chat_tokenizer}, seq_len: 16}",
        expect=("leaving no completion within data.args.seq_len=16", "raise seq_len"),
    ),
    "dpo loss without preference data": train(
        "loss.factory=paratrain.losses:dpo", expect=("needs preference pairs", "paratrain.data.preference")
    ),
    "preference data without the dpo loss": train(
        *PREFERENCE,
        "loss.factory=paratrain.losses:cross_entropy",
        "data.args={files: {pref_same}, tokenizer: {chat_tokenizer}, seq_len: 16}",
        expect="set loss.factory=paratrain.losses:dpo",
    ),
    "model.lora without peft installed": train(
        *TINY_LLAMA,
        "model.lora={r: 4}",
        missing=("peft",),
        expect="model.lora needs peft, which is not installed: pip install 'paratrain[lora]'",
    ),
    "model.lora target matching no module": train(
        *TINY_LLAMA,
        "model.lora={r: 4, target_modules: [qproj]}",
        expect=("matches no Linear module", "q_proj, up_proj"),
    ),
    "model.lora on experts under expert parallel": train(
        "model.factory=paratrain.models.hf:causal_lm",
        "model.args={model_type: qwen3_moe, vocab_size: 128, hidden_size: 16, intermediate_size: 32, "
        "moe_intermediate_size: 16, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, "
        "num_experts: 4, num_experts_per_tok: 2, max_position_embeddings: 16}",
        "model.lora={r: 4, target_modules: [], target_parameters: [mlp.experts.down_proj]}",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        *TWO,
        expect=("model.lora.target_parameters=['mlp.experts.down_proj'] with parallel.ep=2", "drop parallel.ep"),
    ),
    "model.lora target parameter naming none": train(
        "model.factory=paratrain.models.hf:causal_lm",
        "model.args={model_type: qwen3_moe, vocab_size: 128, hidden_size: 16, intermediate_size: 32, "
        "moe_intermediate_size: 16, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, "
        "num_experts: 4, num_experts_per_tok: 2, max_position_embeddings: 16}",
        "model.lora={r: 4, target_parameters: [mlp.experts.gate_proj]}",
        expect=("'mlp.experts.gate_proj' names no parameter", "mlp.experts.down_proj, mlp.experts.gate_up_proj"),
    ),
    "model.lora under tensor parallel": train(
        *TINY_LLAMA, "model.lora={r: 4}", "parallel.strategy=tp", *TWO, expect=("model.lora with parallel.tp=2", "fsdp")
    ),
    "model.lora under a pipeline": train(
        *TINY_LLAMA, "model.lora={r: 4}", "parallel.strategy=pp", *TWO, expect=("model.lora with", "parallel.pp=2")
    ),
    "transformers release outside the supported range": train(
        "model.factory=paratrain.models.hf:causal_lm",
        "model.args={model_type: llama, vocab_size: 64}",
        sys_path="{old_transformers}",
        expect=("transformers 4.40.0 is installed", "pip install 'transformers>=4.56"),
    ),
    # --- data, and data against the model (shape checks) -----------------------------------------
    # chat data (paratrain.data.chat), refused as the dataset is built
    "chat rows without messages or prompt/completion": train(
        *CHAT, "data.args.files={chat_columns}", expect=("neither a 'messages' column", "it has: question, text")
    ),
    "chat turns out of order": train(
        *CHAT, "data.args.files={chat_order}", expect=("turn 1 ('assistant' after 'system') is out of order",)
    ),
    "chat empty assistant reply": train(
        *CHAT, "data.args.files={chat_empty}", expect="turn 1 is an empty assistant reply"
    ),
    "chat tokenizer without a template": train(
        *CHAT, "data.args.tokenizer={bare_tokenizer}", expect=("has no chat template", "data.args.chat_template")
    ),
    "data factory that does not import": train("data.factory=nope.data:build", expect=("data.factory", "nope.data")),
    "data factory argument it does not take": train("data.args.nope=1", expect=("data.args", "nope")),
    "data.num_workers negative": train("data.num_workers=-1", expect="data.num_workers"),
    "data.prefetch_factor zero": train("data.prefetch_factor=0", expect="data.prefetch_factor"),
    "data.prefetch_factor without workers": train(
        "data.prefetch_factor=4", expect=("data.prefetch_factor=4 need worker processes", "set data.num_workers")
    ),
    "data.persistent_workers without workers": train(
        "data.persistent_workers=true", expect=("data.persistent_workers=true need worker", "data.num_workers")
    ),
    "data block longer than the model's positions": train(
        "data.args.block_size=32", expect="data.args.block_size=32 is longer than the model's 16 positions"
    ),
    "token ids beyond the model's embedding": train(
        "model.args.vocab_size=64", expect=("has token ids up to 127 (128 tokens)", "model.args.vocab_size")
    ),
    "targets the loss cannot compare with the output": train(
        "loss.factory=paratrain.losses:mse", expect=("do not fit loss.factory='paratrain.losses:mse'", "[1, 16, 128]")
    ),
    "samples the model cannot take": train(
        *MLP, "data.args={in_features: 3}", expect=("does not go through the model", "inputs of shape [3]", "data.args")
    ),
    "regression targets of another width": train(
        *MLP, "data.args={out_features: 3}", expect=("do not fit loss.factory", "shape [1, 3]")
    ),
    "data samples that are empty": train(
        "data.args.block_size=0", expect=("gives an empty sample (inputs of shape [0])", "data.args")
    ),
    # --- loss -----------------------------------------------------------------------------------
    "loss factory missing": train("loss.factory=paratrain.losses:nope", expect="loss.factory"),
    "loss factory argument it does not take": train("loss.args.reduction=sum", expect=("loss.args", "reduction")),
    # --- eval -----------------------------------------------------------------------------------
    "eval every N steps without a dataset": train(
        "eval.every_steps=5", expect=("eval.every_steps=5", "eval.factory is null")
    ),
    "eval factory that does not import": train("eval.factory=nope:x", "eval.every_steps=5", expect="eval.factory"),
    "eval block longer than the model's positions": train(
        "eval.factory=paratrain.data.text:build_char_dataset",
        "eval.args={block_size: 32}",
        "eval.every_steps=5",
        expect="eval.args.block_size=32",
    ),
    "eval.max_batches zero": train("eval.max_batches=0", expect="eval.max_batches"),
    # --- callbacks ------------------------------------------------------------------------------
    "callback that does not import": train("callbacks=[{factory: 'nope:x'}]", expect=("callbacks", "nope")),
    "callback argument it does not take": train(
        "callbacks=[{factory: 'paratrain.callbacks.memory:MemoryMonitor', args: {bad: 1}}]", expect=("callbacks", "bad")
    ),
    "callback without hooks": train(
        "callbacks=[{factory: 'paratrain.losses:mse'}]", expect=("callbacks[0].factory=", "is not a callback")
    ),
    "callbacks a mapping": train("callbacks={factory: x}", expect="callbacks"),
    # --- profile and debug ----------------------------------------------------------------------
    "profiler window longer than the run": train(
        "profile.enabled=true", "profile.active=50", expect=("profile.active=50", "train.max_steps=20")
    ),
    "profile.wait negative": train("profile.wait=-1", expect="profile.wait"),
    "debug.step_timeout_s zero": train("debug.step_timeout_s=0", expect="debug.step_timeout_s"),
    "debug.dump_gradients_at_steps not steps": train(
        "debug.dump_gradients_at_steps=[a]", expect="debug.dump_gradients_at_steps"
    ),
    # --- train's command-line options ------------------------------------------------------------
    "--nproc-per-node 0": train("--nproc-per-node", "0", expect="--nproc-per-node and --nnodes must be >= 1"),
    "--nnodes 2 without an endpoint": train("--nnodes", "2", expect=("--nnodes 2 needs --rdzv-endpoint",)),
    "--node-rank outside the nodes": train(
        "--nnodes", "2", "--node-rank", "3", "--rdzv-endpoint", "127.0.0.1:1", expect="--node-rank 3"
    ),
    "--max-restarts negative": train("--max-restarts", "-1", expect="--max-restarts >= 0"),
    "an option train does not have": train("--bogus", expect="unrecognized arguments: --bogus"),
    "--nproc-per-node not a number": train("--nproc-per-node", "two", expect="--nproc-per-node: invalid int value"),
    "dry run of a layout that cannot run": train(
        "--dry-run",
        "parallel.strategy=tp",
        "model.args.n_head=3",
        "model.args.n_embd=33",
        *TWO,
        expect="parallel.tp=2 does not divide model.args.n_head=3",
    ),
    "dry run with an unknown key": train("--dry-run", "train.max_stepz=5", expect="train.max_stepz"),
    # --- config show ----------------------------------------------------------------------------
    "config show of an unknown key": case("config", "show", "{config}", "optim.lrr=1", expect="optim.lrr"),
    "config show of a missing file": case("config", "show", "{tmp}/nope.yaml", expect="does not exist"),
    # --- plan -----------------------------------------------------------------------------------
    "plan with an unparsable GPU memory": case(
        "plan", "{config}", "--gpus", "8", "--gpu-memory", "lots", expect="--gpu-memory='lots' is not a memory size"
    ),
    "plan with a GPU memory without unit": case(
        "plan", "{config}", "--gpus", "8", "--gpu-memory", "80", expect="e.g. --gpu-memory 80GB"
    ),
    "plan with uneven nodes": case(
        "plan",
        "{config}",
        "--gpus",
        "6",
        "--nodes",
        "4",
        "--gpu-memory",
        "80GB",
        expect="--gpus=6 does not split evenly over --nodes=4",
    ),
    "plan with no GPUs": case("plan", "{config}", "--gpus", "0", "--gpu-memory", "80GB", expect="--gpus=0"),
    "plan without --gpus": case("plan", "{config}", "--gpu-memory", "80GB", expect="--gpus"),
    "plan with an unparsable host memory": case(
        "plan",
        "{config}",
        "--gpus",
        "2",
        "--gpu-memory",
        "80GB",
        "--host-memory",
        "lots",
        expect="--host-memory='lots'",
    ),
    "plan of a lazy model": case(
        "plan",
        "{config}",
        "model.factory=tests.tools.planner_models:build_lazy_mlp",
        "model.args={}",
        "--gpus",
        "2",
        "--gpu-memory",
        "80GB",
        expect=("lazy parameters whose size is unknown", "model.factory='tests.tools.planner_models:build_lazy_mlp'"),
    ),
    "plan of a model without parameters": case(
        "plan",
        "{config}",
        "model.factory=tests.tools.planner_models:build_parameterless",
        "model.args={}",
        "--gpus",
        "2",
        "--gpu-memory",
        "80GB",
        expect=("no size information", "model.factory='tests.tools.planner_models:build_parameterless'"),
    ),
    "plan with an unknown key": case(
        "plan", "{config}", "train.max_stepz=1", "--gpus", "2", "--gpu-memory", "80GB", expect="train.max_stepz"
    ),
    # --- export ---------------------------------------------------------------------------------
    "export of a missing checkpoint": case(
        "export", "{tmp}/none/step-1", "--out", "{tmp}/w.safetensors", expect="step-1"
    ),
    "export of a directory that is no checkpoint": case(
        "export",
        "{with_checkpoints}/checkpoints/step-10",
        "--out",
        "{tmp}/w.safetensors",
        expect="paratrain-manifest.json is missing",
    ),
    "export without a target": case("export", "{tmp}", expect="one of the arguments --out --hf is required"),
    "export --out into a directory": case(
        "export", "{with_checkpoints}/checkpoints/step-10", "--out", "{tmp}", expect=("--out {tmp} is a directory",)
    ),
    "export --hf onto a file": case(
        "export", "{with_checkpoints}/checkpoints/step-10", "--hf", "{blocker}", expect="--hf {blocker} is a file"
    ),
    # --- checkpoint check -----------------------------------------------------------------------
    "checkpoint check of a missing checkpoint": case("checkpoint", "check", "{tmp}/none/step-1", expect="step-1"),
    "checkpoint check of a directory that is no checkpoint": case(
        "checkpoint", "check", "{with_checkpoints}/checkpoints/step-10", expect="paratrain-manifest.json is missing"
    ),
    "checkpoint check on no processes": case(
        "checkpoint", "check", "{with_checkpoints}/checkpoints/step-10", "--nproc-per-node", "0", expect="nproc"
    ),
    # --- report ---------------------------------------------------------------------------------
    "report of a missing run": case("report", "{tmp}/no-run", expect="no-run"),
    "report of a run without metrics": case("report", "{with_checkpoints}", expect="metrics.jsonl"),
    # --- pipeline show --------------------------------------------------------------------------
    "pipeline show without a pipeline": case(
        "pipeline", "show", "{config}", expect=("no pipeline at world size 1 to show", "parallel.pp")
    ),
    "pipeline show with auto": case(
        "pipeline", "show", "{config}", "parallel.strategy=auto", expect=("parallel.strategy=auto", "paratrain plan")
    ),
    "pipeline show with an unknown key": case(
        "pipeline", "show", "{config}", "pipeline.schedul=GPipe", expect="pipeline.schedul"
    ),
    # --- verify ---------------------------------------------------------------------------------
    "verify with an unknown key": case("verify", "{config}", "optim.lrr=1", expect="optim.lrr"),
    "verify of a layout preflight refuses": case(
        "verify",
        "{config}",
        "parallel.strategy=fsdp",
        "parallel.dp_shard=3",
        "--nproc-per-node",
        "2",
        expect="parallel.dp_shard=3",
    ),
    "verify with cuda on a machine without": case(
        "verify", "{config}", "train.device=cuda", expect="train.device=cuda"
    ),
    # --- slurm ----------------------------------------------------------------------------------
    "slurm with no nodes": case(
        "slurm",
        "{config}",
        "--nodes",
        "0",
        "--gpus-per-node",
        "8",
        "--out",
        "{tmp}/job.sbatch",
        expect="--nodes 0 --gpus-per-node 8: both must be >= 1",
    ),
    "slurm with no GPUs per node": case(
        "slurm",
        "{config}",
        "--nodes",
        "2",
        "--gpus-per-node",
        "0",
        "--out",
        "{tmp}/job.sbatch",
        expect="--nodes 2 --gpus-per-node 0: both must be >= 1",
    ),
    "slurm submit without sbatch": case(
        "slurm",
        "{config}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--submit",
        "--out",
        "{tmp}/job.sbatch",
        expect="--submit needs Slurm's sbatch on PATH",
    ),
    "slurm with an unknown tracker": case(
        "slurm",
        "{config}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "log.trackers=[comet]",
        "--out",
        "{tmp}/job.sbatch",
        expect="log.trackers",
    ),
    "slurm without --nodes": case("slurm", "{config}", "--gpus-per-node", "1", expect="--nodes"),
    "slurm replica groups that cannot share the nodes out": case(
        "slurm",
        "{config}",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--replica-groups",
        "3",
        "--out",
        "{tmp}/job.sbatch",
        expect=("--replica-groups 3 cannot share --nodes 2 x --gpus-per-node 2", "whole nodes"),
    ),  # fmt: skip
    "slurm with a single replica group": case(
        "slurm",
        "{config}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--replica-groups",
        "0",
        "--out",
        "{tmp}/job.sbatch",
        expect=("--replica-groups 0", "at least 2 groups"),
    ),  # fmt: skip
    "slurm with negative restarts": case(
        "slurm",
        "{config}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--max-restarts",
        "-1",
        "--out",
        "{tmp}/job.sbatch",
        expect=("--max-restarts -1 must be >= 0",),
    ),  # fmt: skip
    "slurm with a time limit sbatch rejects": case(
        "slurm",
        "{config}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--time",
        "forever",
        "--out",
        "{tmp}/job.sbatch",
        expect=("--time 'forever' is not a time limit sbatch accepts", "24:00:00"),
    ),
    "slurm --out a directory": case(
        "slurm",
        "{config}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--out",
        "{tmp}",
        expect="--out {tmp} is a directory",
    ),
    # --- bench comm -----------------------------------------------------------------------------
    "bench comm with a size it cannot read": case(
        "bench", "comm", "--out", "{tmp}/bench", "--sizes", "12XB", expect="--sizes '12XB': not a size"
    ),
    "bench comm on one process": case(
        "bench", "comm", "--out", "{tmp}/bench", "--nproc-per-node", "1", expect="collectives need at least 2 processes"
    ),
    "bench comm without timed iterations": case(
        "bench", "comm", "--out", "{tmp}/bench", "--iters", "0", expect="need at least 1 timed iteration"
    ),
    "bench comm on a device it does not know": case("bench", "comm", "--device", "tpu", expect="--device"),
    # --- commands -------------------------------------------------------------------------------
    "a command paratrain does not have": case("trian", "{config}", expect="invalid choice: 'trian'"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The files the cases name, written once: a good config and bad ones, and an earlier run's files."""
    tmp = tmp_path_factory.mktemp("bad-input")
    run = tmp / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(SENTINEL)
    with_checkpoints = tmp / "with-checkpoints"
    (with_checkpoints / "checkpoints/step-10").mkdir(parents=True)
    (tmp / "latin1.yaml").write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    (tmp / "twice.yaml").write_text("train:\n  max_steps: 10\n  seed: 1\n  max_steps: 20\n")
    (tmp / "sections.yaml").write_text("optim:\n  lr: 0.1\ntrain:\n  seed: 1\noptim:\n  lr: 0.2\n")
    (tmp / "not_yaml.yaml").write_text("train: [unclosed\n")
    (tmp / "a_list.yaml").write_text("- train\n- optim\n")
    (tmp / "blocker").write_text("a file, not a directory")
    (tmp / "locked").mkdir()
    (tmp / "locked/paratrain.lock").write_text('{"host": "node-7", "pid": 1, "since": "2025-01-01T08:00:00"}')
    nan = tiny_config(run, train={"grad_clip": float("nan")})
    cut_model = tmp / "cut_model"  # a pretrained directory whose weights file a copy left short
    cut_model.mkdir()
    (cut_model / "config.json").write_text("{}")
    save_file({"weight": torch.ones(64, 64)}, cut_model / "model.safetensors")
    whole = (cut_model / "model.safetensors").read_bytes()
    (cut_model / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    # What pip leaves for an installed release, found before the real one: paratrain reads the version from it.
    old_transformers = tmp / "old-transformers/transformers-4.40.0.dist-info"
    old_transformers.mkdir(parents=True)
    (old_transformers / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.40.0\n")
    old_torchao = tmp / "old-torchao/torchao-0.9.0.dist-info"
    old_torchao.mkdir(parents=True)
    (old_torchao / "METADATA").write_text("Metadata-Version: 2.1\nName: torchao\nVersion: 0.9.0\n")
    write_chat_tokenizer(tmp / "chat_tokenizer")
    write_chat_tokenizer(tmp / "bare_tokenizer", template=None)
    write_chat_jsonl(tmp / "chat.jsonl", 2)
    chat_rows = {
        "chat_columns": {"question": "hi", "text": "hello"},
        "chat_order": {"messages": [{"role": "system", "content": "hi"}, {"role": "assistant", "content": "hi"}]},
        "chat_empty": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
        "pref_missing": {"prompt": "hi", "chosen": "one"},
        "pref_same": {"prompt": "hi", "chosen": "one", "rejected": "one"},
        "pref_long": {"prompt": " ".join(["one"] * 40), "chosen": " two", "rejected": " three"},
    }
    for name, row in chat_rows.items():
        (tmp / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    return {
        "tmp": str(tmp),
        "chat_tokenizer": str(tmp / "chat_tokenizer"),
        "bare_tokenizer": str(tmp / "bare_tokenizer"),
        **{name: str(tmp / f"{name}.jsonl") for name in chat_rows},
        "run": str(run),
        "config": str(write_config(tmp / "config.yaml", tiny_config(run))),
        "nan_file": str(write_config(tmp / "nan.yaml", nan)),
        "with_checkpoints": str(with_checkpoints),
        "blocker": str(tmp / "blocker"),
        "cut_model": str(cut_model),
        "locked": str(tmp / "locked"),
        "old_transformers": str(old_transformers.parent),
        "old_torchao": str(old_torchao.parent),
        **{name: str(tmp / f"{name}.yaml") for name in ("latin1", "twice", "sections", "not_yaml", "a_list")},
    }


@pytest.mark.parametrize("name", CASES)
def test_bad_input_exits_2_without_a_traceback_naming_the_key(files, monkeypatch, name):
    monkeypatch.setenv("PATH", files["tmp"])  # no sbatch, whether or not this machine has Slurm
    as_new_user(monkeypatch, Path(files["tmp"]) / "home")  # no tracker variables, no ~/.netrc
    if CASES[name].sys_path:
        monkeypatch.syspath_prepend(fill(CASES[name].sys_path, files))
    for package in CASES[name].missing:
        monkeypatch.setitem(sys.modules, package, None)
    argv = [fill(part, files) for part in CASES[name].argv]
    code, stderr = run_cli_in_process(argv)
    assert code == 2, f"exit {code}; stderr:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    for text in CASES[name].expected:
        assert fill(text, files) in stderr, f"{text!r} not in:\n{stderr}"
    run = Path(files["run"])  # nothing of the earlier run lost, nothing of a new one started
    assert (run / "metrics.jsonl").read_text() == SENTINEL and not (run / "config.yaml").exists()


def fill(text: str, files: dict[str, str]) -> str:
    """The {name} placeholders replaced (not str.format: YAML flow mappings in overrides hold braces too)."""
    for name, path in files.items():
        text = text.replace(f"{{{name}}}", path)
    return text


def test_the_table_covers_every_command_and_config_section():
    from paratrain.cli import build_parser
    from paratrain.config.schema import Config

    used = {CASES[name].argv[0] for name in CASES}
    commands = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse keeps them here
    assert commands <= used, f"no case for: {commands - used}"
    keys = " ".join(" ".join(case.argv) for case in CASES.values())
    sections = set(Config.model_fields)
    assert {section for section in sections if f"{section}." in keys or f"{section}=" in keys} == sections
    assert len(CASES) >= 100
