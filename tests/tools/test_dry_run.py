"""paratrain train --dry-run: a 64-rank layout laid out in this one process, and its bad input."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from paratrain.cli import main
from tests.harness import tiny_config, write_config

# 4 heads and 4 layers: tp=4 divides the heads, and 6 pipeline pieces can make 4 stages.
MODEL = "model.args={block_size: 16, n_layer: 4, n_head: 4, n_embd: 64}"


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("dry_run")
    return write_config(
        root / "c.yaml", tiny_config(root / "run", train={"global_batch_size": 64, "micro_batch_size": 2})
    )


def dry_run(capsys, config_path, *overrides, nproc=8, nnodes=8) -> tuple[int, str, str]:
    code = main(
        [
            "train",
            str(config_path),
            "--dry-run",
            "--nproc-per-node",
            str(nproc),
            "--nnodes",
            str(nnodes),
            MODEL,
            *overrides,
        ]
    )
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_64_rank_pipeline_fsdp_tensor_parallel_layout_is_laid_out_in_one_process(capsys, config_path):
    code, out, err = dry_run(capsys, config_path, "parallel.strategy=fsdp", "parallel.pp=4", "parallel.tp=4")
    assert code == 0, err
    assert "64 ranks (8 node(s) x 8), layout fsdp: pp=4 x dp_replicate=1 x dp_shard=4 x cp=1 x tp=4" in out
    assert "nothing trained (no data read, nothing written)" in out
    # Rank 0 holds pipeline stage 0 only (embedding and first block), sharded over dp_shard and tp.
    parameters = out.split("rank 0 built on meta")[0]
    assert re.search(r"embed\.tok\.weight: \[128, 64\] -> \[32, 64\]: S\(0\) on dp_shard\n", parameters)
    assert "blocks.*.attn.out_proj.weight: [64, 64] -> [16, 16]: S(0) on dp_shard, S(1) on tp" in parameters
    assert not re.search(r"(lm_head|final_norm)\.\w+: \[", parameters)  # the plan line names them; no tensor does
    # One line per rank, coordinates from the mesh: tp innermost, pp outermost.
    rank_lines = [line for line in out.splitlines() if line.startswith("  rank ")]
    assert len(rank_lines) == 64
    assert rank_lines[0].startswith("  rank    0 node 0/0: (0, 0, 0, 0, 0)  embed, blocks.0  ")
    assert rank_lines[5].startswith("  rank    5 node 0/5: (0, 0, 1, 0, 1)")
    assert rank_lines[63].startswith("  rank   63 node 7/7: (3, 0, 3, 0, 3)  blocks.3, final_norm, lm_head  ")
    assert "tp: 16 group(s) of 4: [0, 1, ..., 3]; [4, 5, ..., 7]" in out
    assert "pp: 16 group(s) of 4: [0, 16, ..., 48]" in out
    assert "dp_shard: 16 group(s) of 4: [0, 4, ..., 12]" in out
    # The sharding built on meta holds what the planner expects rank 0 to hold.
    built, planned = re.search(r"rank 0 built on meta: (.+) of fp32 parameters; planner: (.+)", out).groups()
    assert built == planned
    assert len(re.findall(r"  pp rank \d: params", out)) == 4
    assert not dist.is_initialized()  # the fake group is gone
    assert not (config_path.parent / "run").exists()


def test_fsdp_8_by_tensor_parallel_8_shards_every_block_linear_64_ways(capsys, config_path):
    code, out, err = dry_run(capsys, config_path, "parallel.strategy=fsdp", "parallel.tp=8", "model.args.n_head=8")
    assert code == 0, err
    assert re.search(r"blocks\.\*\.mlp\.up_proj\.weight: \[256, 64\] -> \[4, 64\]: .* on dp_shard, S\(0\) on tp", out)
    assert re.search(
        r"blocks\.\*\.attn\.out_proj\.weight: \[64, 64\] -> \[8, 8\]: S\(0\) on dp_shard, S\(1\) on tp", out
    )
    assert "every rank: params" in out and len([line for line in out.splitlines() if line.startswith("  rank ")]) == 64


@pytest.mark.parametrize(
    "overrides, nproc, message",
    [
        (
            ["parallel.strategy=fsdp", "parallel.tp=3"],
            8,
            "does not fit the world size 64: the other degrees (3) do not divide it",
        ),
        (
            ["parallel.strategy=tp", "parallel.tp=16"],
            1,
            "parallel.tp=16 does not fit the world size 8: their product is 16",
        ),
        (["parallel.strategy=fsdp", "parallel.tp=8"], 8, "parallel.tp=8 does not divide model.args.n_head=4"),
        (["parallel.strategy=pp", "parallel.pp=-1"], 1, "the pipeline needs 8 stages"),
        (["parallel.strategy=tp", "parallel.tp=1"], 8, "parallel.strategy=tp contradicts parallel.tp=1"),
    ],
)
def test_a_layout_that_cannot_run_is_refused_before_anything_is_built(capsys, config_path, overrides, nproc, message):
    code, out, err = dry_run(capsys, config_path, *overrides, nproc=nproc)
    assert code == 2 and message in err and out == ""


def test_the_dry_run_prints_the_parallel_plan_and_where_it_came_from(capsys, config_path):
    code, out, err = dry_run(capsys, config_path, "parallel.strategy=fsdp", nproc=2, nnodes=1)
    assert code == 0, err
    assert "parallel plan (declared by the model): blocks (FSDP units, activation checkpointing, compile): 4" in out
    assert "attn.q_proj: colwise" in out and "pipeline sequence: 7 pieces" in out
    llama = "model.args={model_type: llama, vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 3, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 16}"
    code, out, err = dry_run(
        capsys,
        config_path,
        "parallel.strategy=fsdp",
        "model.factory=paratrain.models.hf:causal_lm",
        llama,
        nproc=2,
        nnodes=1,
    )
    assert code == 0, err
    assert (
        "parallel plan (derived from _no_split_modules, tp_plan and pp_plan): blocks" in out
        and "3 (model.layers.0 ... model.layers.2); FSDP units besides: model.embed_tokens; model.norm + lm_head" in out
    )
    assert (
        "tensor parallel per block: self_attn.q_proj: colwise" in out
        and "pipeline sequence: 6 pieces (model.embed_tokens ... lm_head), decoder layers fed rotary" in out
    )


def test_the_dry_run_lists_the_hooks_the_model_defines_and_warns_of_a_misspelt_one(capsys, config_path):
    code, out, err = dry_run(capsys, config_path, nproc=1, nnodes=1)
    assert code == 0, err
    assert (
        "model hooks: parallel_plan(), init_parameter(), flops_per_token(), use_sequence_functions(), "
        "use_expert_dispatch(); "
        "not defined: flops_per_sample()" in out
    )
    assert "warning:" not in out
    mlp = ["model.factory=tests.unit.hook_models:build_misspelt_mlp", "model.args={}"]
    code, out, err = dry_run(capsys, config_path, *mlp, nproc=1, nnodes=1)
    assert code == 0, err
    assert (
        "model hooks: none; not defined: parallel_plan(), init_parameter(), flops_per_sample(), flops_per_token(), "
        "use_sequence_functions(), use_expert_dispatch()" in out
    )
    assert "  warning: model MisspeltMLP defines paralel_plan(), one letter away from the hook parallel_plan()" in out


def test_a_context_parallel_dry_run_shows_each_cp_ranks_tokens_and_the_cp_mesh(capsys, config_path):
    code, out, err = dry_run(capsys, config_path, "parallel.cp=2", "parallel.dp_shard=-1", nproc=4, nnodes=1)
    assert code == 0, err
    assert "layout fsdp: pp=1 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=1" in out
    # block_size 16 in 2 x cp = 4 chunks of 4: rank 0 the first and last, rank 1 the middle two.
    assert "tokens of each 16-token sequence held: cp rank 0: 0-3 and 12-15; cp rank 1: 4-7 and 8-11" in out
    assert "cp: 2 group(s) of 2: [0, 1]; [2, 3]" in out
    assert "S(0) on dp_shard_cp" in out  # parameters sharded over dp_shard x cp, not whole on each cp rank


def test_an_expert_parallel_dry_run_shows_the_ep_groups_and_each_ranks_share_of_the_experts(capsys, config_path):
    experts = ["model.args.moe_experts=4", "parallel.dp_shard=4", "parallel.ep=2"]
    code, out, err = dry_run(capsys, config_path, *experts, nproc=4, nnodes=1)
    assert code == 0, err
    assert "layout fsdp: pp=1 x dp_replicate=1 x dp_shard=4 x cp=1 x tp=1, ep=2" in out
    assert "ep (divide the experts): 2 group(s) of 2: [0, 1]; [2, 3]" in out
    assert "efsdp (shard the same experts): 2 group(s) of 2: [0, 2]; [1, 3]" in out
    # 4 experts: 2 per ep rank, each pair FSDP-sharded over the 2 efsdp ranks holding them.
    assert "blocks.*.mlp.experts.up_proj: [4, 64, 256] -> [1, 64, 256]: _S(0, 2) on efsdp, S(0) on ep" in out
