"""paratrain plan: the accounting against hand numbers and against what a real run holds, the ranking,
and its bad input."""

from __future__ import annotations

import json
import resource

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.cli import main
from paratrain.config.loading import load_config
from paratrain.config.schema import ModelConfig, OptimConfig
from paratrain.errors import ConfigError
from paratrain.models.gpt import build_gpt
from paratrain.parallel.activation import saved_operators
from paratrain.parallel.dims import ParallelDims, resolve_parallel_dims
from paratrain.planner.accounting import gathered_bytes, model_state_bytes, stage_shares, working_bytes
from paratrain.planner.activations import (
    ActivationShape,
    head_bytes,
    layer_bytes,
    layers_bytes,
    measure_saved_bytes,
    recompute_bytes,
)
from paratrain.planner.command import plan_layouts
from paratrain.planner.communication import expert_traffic, fsdp_units, step_traffic
from paratrain.planner.inputs import plan_inputs
from paratrain.planner.layouts import describe_layout
from paratrain.planner.model_facts import ParamFacts, read_model_facts, transformer_sizes
from paratrain.planner.units import parse_memory
from tests.distributed.count_model_state import LAYOUTS, layout_config
from tests.harness import REPO_ROOT, TINY_GPT, launch_workers, tiny_config, write_config

HF_LLAMA, LLAMA_70B = REPO_ROOT / "examples/hf_llama.yaml", REPO_ROOT / "examples/llama_70b.yaml"


def test_memory_strings_read_decimal_and_binary_units():
    assert parse_memory("80GB", argument="--gpu-memory") == 80 * 10**9
    assert parse_memory("80GiB", argument="--gpu-memory") == 80 * 2**30
    assert parse_memory("512MB", argument="--gpu-memory") == 512 * 10**6
    assert parse_memory("1.5TB", argument="--gpu-memory") == 1_500_000_000_000
    assert parse_memory(" 24 gib ", argument="--gpu-memory") == 24 * 2**30


@pytest.mark.parametrize("text", ["80", "eighty GB", "80XB", "-4GB", "0GB", ""])
def test_a_memory_string_without_a_known_unit_is_refused_naming_the_argument_and_an_example(text):
    with pytest.raises(ConfigError, match=r"--gpu-memory=.* is not a memory size.*e\.g\. --gpu-memory 80GB"):
        parse_memory(text, argument="--gpu-memory")


def test_model_state_matches_hand_counted_bytes_per_layout():
    # A colwise 8x4 layer (weight + bias) feeding a rowwise 4x8 layer (weight + bias) and a norm of 4.
    params = [
        ParamFacts("up.weight", (8, 4), "colwise"),
        ParamFacts("up.bias", (8,), "colwise"),
        ParamFacts("down.weight", (4, 8), "rowwise"),
        ParamFacts("down.bias", (4,)),
        ParamFacts("norm", (4,)),
    ]
    adamw, sgd = OptimConfig(name="adamw"), OptimConfig(name="sgd", momentum=0.9)
    psi = 32 + 8 + 32 + 4 + 4  # 80 parameters, 5 tensors
    assert model_state_bytes(params, dims=ParallelDims("ddp", dp_replicate=4), optim=adamw) == (
        4 * psi,
        4 * psi,
        8 * psi + 4 * 5,
    )
    # FSDP over 4: dim 0 of each tensor cut in 4 (8x4 -> 2x4, 8 -> 2, 4x8 -> 1x8, 4 -> 1, 4 -> 1) = 20 elements.
    assert model_state_bytes(params, dims=ParallelDims("fsdp", dp_shard=4), optim=adamw) == (80, 80, 160 + 20)
    # FSDP over 3 pads up: 8 -> 3 rows, 4 -> 2 rows: 12 + 3 + 16 + 2 + 2 = 35 elements on rank 0.
    assert model_state_bytes(params, dims=ParallelDims("fsdp", dp_shard=3), optim=adamw)[0] == 4 * 35
    # TP over 2: up split on rows (16 + 4), down on columns (16), its bias and the norm whole (4 + 4) = 44.
    assert model_state_bytes(params, dims=ParallelDims("tp", tp=2), optim=sgd) == (176, 176, 176)
    assert model_state_bytes(params, dims=ParallelDims("tp", tp=2), optim=OptimConfig(name="sgd"))[2] == 0


def test_fsdp_holds_a_quarter_of_ddp_model_state_on_four_ranks_as_zero_3_says():
    facts = read_model_facts(load_config(None, ["model.args={n_layer: 2, n_head: 4, n_embd: 64}"]).model)
    ddp = sum(model_state_bytes(facts.params, dims=ParallelDims("ddp", dp_replicate=4), optim=OptimConfig()))
    fsdp = sum(model_state_bytes(facts.params, dims=ParallelDims("fsdp", dp_shard=4), optim=OptimConfig()))
    assert ddp == 16 * facts.num_params + 4 * len(facts.params)  # ZeRO: 16Ψ (+ AdamW's step counters)
    assert fsdp == pytest.approx(ddp / 4, rel=0.01)


def test_activation_formula_is_within_ten_percent_of_the_tensors_autograd_saves():
    # hidden 256, sequence 16, 4 heads: the s x s scores the meta device's attention keeps are 1 / 64 of a layer.
    with torch.device("meta"):
        model = build_gpt(n_layer=3, n_head=4, n_embd=256, block_size=16, vocab_size=512)
        tokens = torch.zeros(4, 16, dtype=torch.long)
    sizes, shape = transformer_sizes(model), ActivationShape(micro_batch=4, element_bytes=4)
    formula = 3 * layer_bytes(sizes, shape) + head_bytes(sizes, shape) - 4 * 16 * 512 * 4  # the loss's log-softmax
    assert measure_saved_bytes(model, tokens) == pytest.approx(formula, rel=0.1)
    checkpointed = ActivationShape(micro_batch=4, element_bytes=4, checkpointing="full")
    assert layer_bytes(sizes, checkpointed) == 16 * 4 * 256 * 4  # the layer input alone
    assert layer_bytes(sizes, ActivationShape(4, 4, tp=2)) == (4 + 14 / 2) * 16 * 4 * 256 * 4
    # Context parallel: each rank holds 16 / 2 tokens of a sample (benchmarks/context_parallel.py measures 0.527).
    assert layer_bytes(sizes, ActivationShape(4, 4, cp=2)) == layer_bytes(sizes, shape) / 2
    assert head_bytes(sizes, ActivationShape(4, 4, cp=2)) == head_bytes(sizes, shape) / 2


# The Linear layers of a GPT block that float8 training converts (parallel/float8.py).
FLOAT8_PROJECTIONS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.up_proj", "mlp.down_proj")


def saved_by_selective_checkpointing(block: torch.nn.Module, hidden: torch.Tensor) -> int:
    """Bytes selective checkpointing keeps of one forward of ``block``: its input, and the output of every
    operator its policy saves (parallel/activation.py), recorded as the block runs (on meta: no memory)."""

    class Record(TorchDispatchMode):
        kept = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            output = func(*args, **(kwargs or {}))
            if func in saved_operators():
                Record.kept += sum(t.numel() * t.element_size() for t in pytree.tree_leaves(output))
            return output

    with Record():
        block(hidden)
    return Record.kept + hidden.numel() * hidden.element_size()


def test_selective_checkpointing_is_counted_as_what_its_policy_keeps_between_none_and_full():
    with torch.device("meta"):
        model = build_gpt(n_layer=3, n_head=4, n_embd=256, block_size=16, vocab_size=512)
        hidden = torch.zeros(4, 16, 256)
    sizes, tensor = transformer_sizes(model), 16 * 4 * 256 * 4
    none, full, selective = (ActivationShape(4, 4, checkpointing=mode) for mode in ("none", "full", "selective"))
    # The operators' outputs as the policy sees them: the meta device's math attention adds its s x s scores
    # (bmm), a quarter of one s x b x h tensor here, to the 11 the formula counts.
    assert saved_by_selective_checkpointing(model.blocks[0], hidden) == pytest.approx(
        layer_bytes(sizes, selective), rel=0.1
    )
    assert layer_bytes(sizes, selective) == 11 * tensor
    assert layer_bytes(sizes, full) < layer_bytes(sizes, selective) < layer_bytes(sizes, none)
    assert recompute_bytes(sizes, selective) == (18 - 11) * tensor  # what backward rebuilds beside what was kept
    # Tensor parallel: 8 inside the pair split, the 2 row-parallel outputs whole plus their all-reduced copies.
    assert layer_bytes(sizes, ActivationShape(4, 4, tp=2, checkpointing="selective")) == (1 + 8 / 2 + 2 * 2) * tensor
    sequence_parallel = ActivationShape(4, 4, tp=2, sequence_parallel=True, checkpointing="selective")
    assert layer_bytes(sizes, sequence_parallel) == (1 / 2 + 8 / 2 + 2 * 1.5) * tensor
    # Every 2nd of 3 layers checkpointed: one selective layer, two that keep everything.
    every_2nd = ActivationShape(4, 4, checkpointing="selective", checkpoint_every=2)
    assert layers_bytes(sizes, every_2nd, num_layers=3) == (11 + 2 * 18) * tensor


def test_float8_all_gather_halves_the_gathered_weights_of_bf16_and_counts_nothing_else():
    overrides = ["model.args={n_layer: 2, n_head: 4, n_embd: 64}", "parallel.fsdp.param_dtype=bf16"]
    config = load_config(None, overrides)
    facts, dims = read_model_facts(config.model), ParallelDims("fsdp", dp_shard=4)
    float8 = [param.name for param in facts.params if param.float8]
    assert float8 == [f"blocks.{i}.{layer}.weight" for i in range(2) for layer in FLOAT8_PROJECTIONS]

    def working(*extra: str) -> int:
        inputs = plan_inputs(load_config(None, [*overrides, *extra]))
        return working_bytes(facts, stage_shares(facts, inputs, dims)[0], inputs, dims)

    # Two blocks gathered at once, each with 4 x 64 x 64 attention and 2 x 64 x 256 MLP weights: 1 byte each
    # instead of bf16's 2. Model state is untouched: torchao keeps the fp32 master weights.
    block_weights = 4 * 64 * 64 + 2 * 64 * 256
    assert working() - working("parallel.float8.enabled=true") == 2 * block_weights * (2 - 1)
    assert working("parallel.float8.enabled=true", "parallel.float8.scaling=rowwise") == working()
    assert working("parallel.float8.enabled=true", "parallel.float8.fsdp_float8_all_gather=false") == working()
    inputs = plan_inputs(load_config(None, [*overrides, "parallel.float8.enabled=true"]))
    share = stage_shares(facts, inputs, dims)[0]
    converted = [param for param in facts.params if param.float8]
    assert 2 * gathered_bytes(converted, dims, inputs.parallel.fsdp, float8=True) == gathered_bytes(
        converted, dims, inputs.parallel.fsdp, float8=False
    )
    bf16_traffic = step_traffic(facts, share, plan_inputs(config), dims, gpus_per_node=8)
    assert step_traffic(facts, share, inputs, dims, gpus_per_node=8).total < bf16_traffic.total


def test_ddp_is_recommended_when_it_fits_and_sharding_when_it_does_not():
    config = load_config(
        None,
        ["model.args={n_layer: 2, n_head: 4, n_embd: 64}", "train.global_batch_size=8", "train.micro_batch_size=2"],
    )
    plan, facts, _ = plan_layouts(config, gpus=4, gpu_memory="80GB")
    assert plan.recommended.dims == ParallelDims("ddp", dp_replicate=4)
    # A GPU between fsdp's and ddp's need: ddp no longer fits, and the recommendation shards.
    ddp, fsdp = ParallelDims("ddp", dp_replicate=4), ParallelDims("fsdp", dp_shard=4)
    need = {estimate.dims: estimate.peak.total for estimate in plan.ranked}
    assert need[fsdp] < need[ddp]
    memory = f"{int((need[fsdp] + need[ddp]) / 2 / 0.9)}B"
    plan, _, _ = plan_layouts(config, gpus=4, gpu_memory=memory)
    fitting = [estimate.dims for estimate in plan.fitting]
    assert fsdp in fitting and ddp not in fitting
    assert plan.recommended.dims != ddp and plan.recommended.peak.total <= 0.9 * parse_memory(memory, argument="m")
    # Ranked by estimated overhead: communication time, plus a pipeline's bubble.
    overheads = [estimate.overhead_seconds for estimate in plan.fitting]
    assert overheads == sorted(overheads) and any(estimate.dims.pp > 1 for estimate in plan.fitting)
    assert all(estimate.bubble_seconds > 0 for estimate in plan.fitting if estimate.dims.pp > 1)


def test_plan_command_prints_the_layouts_and_the_command_to_run_the_recommended_one(tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train={"global_batch_size": 16}))
    # One node of 8 and a tiny model: ddp's one all-reduce costs least, and it fits.
    assert main(["plan", str(config), "--gpus", "8", "--gpu-memory", "16GiB", "--host-memory", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 8 GPU(s) on 1 node(s), 16.00 GiB each (90% usable: 14.40 GiB)" in out
    assert "recommended: ddp dp_replicate=8 (pp=1 x dp_replicate=8 x dp_shard=1 x cp=1 x tp=1)" in out
    assert (
        f"run it: paratrain train {config} --nproc-per-node 8 --nnodes 1 parallel.strategy=ddp parallel.pp=1 "
        f"parallel.dp_replicate=8 parallel.dp_shard=1 parallel.cp=1 parallel.tp=1"
    ) in out
    assert "fsdp dp_shard=8 " in out and "tp=2" in out
    assert "refused: tp tp=8: parallel.tp=8 does not divide model.args.n_head=2" in out
    assert not (tmp_path / "run").exists()


def test_plan_shows_the_young_daly_checkpoint_interval_for_the_cluster_and_a_nodes_mtbf(tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train={"global_batch_size": 16}))
    facts = read_model_facts(ModelConfig(**TINY_GPT))
    size = 12 * facts.num_params + 4 * len(facts.params)  # weights and AdamW's two moments, fp32; a step per tensor
    args = ["plan", str(config), "--gpus", "16", "--gpu-memory", "16GiB", "--host-memory", "1TB", "--nodes", "4"]
    assert main([*args, "--mtbf-hours", "8", "--save-bandwidth", "10KB"]) == 0
    out = capsys.readouterr().out
    cost, mtbf = size / 4 / 1e4, 2 * 3600  # each node writes a quarter; four nodes fail four times as often
    assert f"a synchronous save blocks about {cost:.3g} s; MTBF 8 h per node (--mtbf-hours), 2 h for 4 node(s)" in out
    assert f"save every {(2 * cost * mtbf) ** 0.5 / 60:.1f} min (Young/Daly" in out
    assert main(args) == 0  # no MTBF in the config nor on the command line
    assert "give --mtbf-hours" in capsys.readouterr().out


def test_on_two_nodes_the_recommendation_sends_less_across_them_and_tensor_parallel_stays_in_one():
    config = load_config(
        None,
        [
            "model.args={block_size: 16, n_layer: 2, n_head: 8, n_embd: 512}",
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
        ],
    )
    plan, _, _ = plan_layouts(config, gpus=8, nodes=2, gpu_memory="16GiB")
    ddp = next(estimate for estimate in plan.ranked if estimate.dims == ParallelDims("ddp", dp_replicate=8))
    best = plan.recommended
    assert ddp.traffic.inter_node > 0 and best.traffic.inter_node < ddp.traffic.inter_node / 10
    assert best.overhead_seconds < ddp.overhead_seconds
    assert max(estimate.dims.tp for estimate in plan.ranked) == 4  # 8 heads would allow 8; a node has 4 GPUs


def test_plan_exits_1_when_no_layout_fits(tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    assert main(["plan", str(config), "--gpus", "2", "--gpu-memory", "100KB"]) == 1
    assert "no layout fits in" in capsys.readouterr().out


def test_a_model_that_is_not_a_transformer_gets_activations_measured_on_meta():
    def plan_mlp(hidden_features: int):
        config = load_config(
            None,
            [
                "model.factory=paratrain.models.mlp:build_mlp",
                f"model.args.hidden_features={hidden_features}",
                "data.factory=paratrain.data.regression:build_regression_dataset",
            ],
        )
        return plan_layouts(config, gpus=2, gpu_memory="1GB")

    (narrow, facts, source), (wide, _, _) = plan_mlp(64), plan_mlp(4096)
    assert facts.transformer is None and source.startswith("measured")
    assert narrow.recommended.dims == wide.recommended.dims
    # The hidden layers' outputs are what is measured: 64 times wider layers must show up.
    assert 0 < narrow.recommended.peak.activations < wide.recommended.peak.activations


def test_a_model_whose_forward_needs_tensor_values_is_planned_without_activations():
    config = load_config(
        None,
        [
            "model.factory=tests.tools.planner_models:build_value_dependent_mlp",
            "data.factory=paratrain.data.regression:build_regression_dataset",
        ],
    )
    plan, _, source = plan_layouts(config, gpus=2, gpu_memory="1GB")
    assert source.startswith("not estimated (one forward on the meta device failed: RuntimeError: ")
    assert plan.recommended is not None and plan.recommended.peak.activations == 0


def test_plan_of_the_hf_llama_example_prints_its_layouts_from_the_transformer_formula(capsys):
    pytest.importorskip("transformers")
    assert main(["plan", str(HF_LLAMA), "--gpus", "2", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "model: paratrain.models.hf:causal_lm, 90,432 parameters (21 tensors)" in out
    assert "activations: transformer formula (layers 2, hidden 64, heads 4, sequence 64, vocab 128)" in out
    assert "fsdp dp_shard=2 " in out and "tp tp=2 " in out
    assert f"run it: paratrain train {HF_LLAMA} --nproc-per-node 2 --nnodes 1 " in out


def test_a_70b_llama_is_planned_on_the_meta_device_without_allocating_its_weights(capsys):
    pytest.importorskip("transformers")
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    # 8 GPUs of 80 GB cannot hold 16 bytes of model state for each of 70.6B parameters: exit code 1.
    assert main(["plan", str(LLAMA_70B), "--gpus", "8", "--gpu-memory", "80GB", "--host-memory", "2TB"]) == 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 2 * 2**20  # its weights: 263 GiB
    out = capsys.readouterr().out
    assert "70,553,706,496 parameters (723 tensors)" in out
    assert "transformer formula (layers 80, hidden 8192, heads 64, sequence 8192, vocab 128256)" in out
    assert "fsdp pp=2 dp_shard=4 " in out and "no layout fits in 67.06 GiB per GPU" in out
    # The node's host memory does fit: docs/planner.md gives this line as the 70B figure, so it must stay true.
    host = next(line for line in out.splitlines() if line.startswith("host memory of "))
    assert host.startswith("host memory of fsdp pp=2 cp=4: 310 GiB per node of 1.82 TiB: fits; 8 GPU process(es)")
    assert host in (REPO_ROOT / "docs/planner.md").read_text()


def test_llama_activation_formula_equals_the_tensors_autograd_saves_in_a_real_forward():
    transformers = pytest.importorskip("transformers")
    # Grouped-query attention (2 of 8 heads for k and v) and a SwiGLU MLP of 3.5 x hidden: a real forward on the
    # CPU, whose fused attention keeps no s x s scores; a layer is what a second layer adds.
    sizes = {"hidden_size": 512, "intermediate_size": 1792, "num_attention_heads": 8, "num_key_value_heads": 2}
    saved = []
    for layers in (1, 2):
        config = transformers.LlamaConfig(vocab_size=16, num_hidden_layers=layers, **sizes)
        model = transformers.LlamaForCausalLM(config)
        saved.append(measure_saved_bytes(model, torch.zeros(1, 8, dtype=torch.long)))
    facts_sizes = transformer_sizes(model, seq_len=8)
    assert (facts_sizes.kv_heads, facts_sizes.ffn_hidden, facts_sizes.gated_mlp) == (2, 1792, True)
    formula = layer_bytes(facts_sizes, ActivationShape(micro_batch=1, element_bytes=4))
    assert formula == 22.5 * 8 * 512 * 4  # 18 - 2 x (1 - 2/8) + (4 x 3.5 - 8) tensors of s x b x h
    assert saved[1] - saved[0] == pytest.approx(formula, rel=0.05)


@pytest.fixture(scope="module")
def measured_model_state(tmp_path_factory) -> dict:
    """Every rank's bytes after one step of each layout, from ONE torchrun launch of 4 processes."""
    root = tmp_path_factory.mktemp("model_state")
    out = root / "bytes.json"
    result = launch_workers(4, "tests.distributed.count_model_state", str(out), str(root), *LAYOUTS)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "layout, dims",
    [
        ("ddp", ParallelDims("ddp", dp_replicate=4)),
        ("fsdp", ParallelDims("fsdp", dp_shard=4)),
        ("fsdp2", ParallelDims("hsdp", dp_replicate=2, dp_shard=2)),  # each parameter cut across 2 ranks
        ("tp", ParallelDims("tp", tp=4)),
    ],
)
def test_planned_bytes_per_rank_are_within_ten_percent_of_what_a_real_step_holds(
    measured_model_state, layout, dims, tmp_path
):
    config = layout_config(layout, str(tmp_path))
    facts = read_model_facts(config.model)
    planned = dict(
        zip(("params", "grads", "optimizer"), model_state_bytes(facts.params, dims=dims, optim=config.optim))
    )
    for rank, measured in enumerate(measured_model_state[layout]):
        for kind, planned_bytes in planned.items():
            assert measured[kind] == pytest.approx(planned_bytes, rel=0.10), f"{layout} rank {rank} {kind}"
    if layout in ("fsdp", "fsdp2", "tp"):  # sharding really happened: fewer bytes than ddp's
        assert measured_model_state[layout][0]["params"] < 0.6 * measured_model_state["ddp"][0]["params"]


def test_fsdp_units_counted_for_traffic_include_a_transformers_models_outer_units_without_a_pipeline():
    pytest.importorskip("transformers")
    llama = "{model_type: llama, vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 3, num_attention_heads: 4, num_key_value_heads: 2}"
    gpt2 = "{model_type: gpt2, vocab_size: 128, n_positions: 16, n_embd: 32, n_layer: 3, n_head: 2}"
    for args, expected in ((llama, 3 + 2 + 1), (gpt2, 3 + 1)):  # GPT-2: tied head, no pipeline sequence
        config = load_config(None, ["model.factory=paratrain.models.hf:causal_lm", f"model.args={args}"])
        facts = read_model_facts(config.model)
        share = stage_shares(facts, plan_inputs(config), resolve_parallel_dims(config.parallel, world_size=1))[0]
        assert fsdp_units(facts, share) == expected


def test_context_parallel_is_recommended_when_a_long_sequences_activations_do_not_fit_otherwise():
    # 16k tokens per sample: activations are most of a rank's memory, and only cp divides them by its degree.
    config = load_config(
        None,
        [
            "model.args={n_layer: 2, n_head: 4, n_embd: 256, block_size: 16384, vocab_size: 128}",
            "data.args.block_size=16384",
            "train.global_batch_size=4",
            "train.micro_batch_size=1",
        ],
    )

    def recommended(memory: str) -> str:
        plan, _, _ = plan_layouts(config, gpus=4, gpu_memory=memory, read_data_sample=False)
        return describe_layout(plan.fitting[0].dims)

    assert recommended("4GiB") == "ddp dp_replicate=4"  # everything fits: no reason to split sequences
    assert recommended("0.5GiB") == "fsdp dp_shard=2 cp=2"  # its all-to-alls cost less than tp's all-reduces
    assert recommended("0.3GiB") == "fsdp cp=4"  # the only layout that fits


def test_the_planner_counts_expert_parallels_shares_and_all_to_all_traffic():
    config = load_config(
        None,
        [
            "model.args={n_layer: 2, n_head: 4, n_embd: 64, block_size: 16, moe_experts: 4, moe_top_k: 2}",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
        ],
    )
    facts, inputs = read_model_facts(config.model, seq_len=16), plan_inputs(config)
    experts = [param for param in facts.params if param.expert]
    assert [param.name for param in experts] == [
        f"blocks.{i}.mlp.experts.{name}" for i in range(2) for name in ("up_proj", "down_proj")
    ]
    fsdp, ep = ParallelDims("fsdp", dp_shard=4), ParallelDims("fsdp", dp_shard=4, ep=2)
    # Stored: FSDP shards experts over 4 ranks either way (2 per ep rank, over 2 efsdp ranks).
    assert model_state_bytes(experts, dims=ep, optim=OptimConfig()) == model_state_bytes(
        experts, dims=fsdp, optim=OptimConfig()
    )
    # Gathered to compute: half the experts under ep=2 (blocks streamed two at a time, plus one gradient).
    (share,) = stage_shares(facts, inputs, fsdp)
    expert_numel = sum(param.numel for param in experts)
    saved = working_bytes(facts, share, inputs, fsdp) - working_bytes(facts, share, inputs, ep)
    assert saved == 4 * 3 * expert_numel // 2 // 2  # fp32 x (2 blocks gathered + 1 gradient) x half of a block's
    # All-to-all: 4 per MoE layer and micro-batch, each of 16 tokens x 2 samples x top-2 x 64 x 4 bytes, half sent.
    traffic = expert_traffic(facts, share, inputs, ep, micro_batches=2, gpus_per_node=8)
    assert traffic.messages == 4 * 2 * 2
    assert traffic.intra_node == 16 * (16 * 2 * 2 * 64 * 4) / 2
    assert expert_traffic(facts, share, inputs, fsdp, micro_batches=2, gpus_per_node=8).total == 0


def test_the_planner_offers_expert_parallel_for_a_mixture_of_experts_and_recommends_it_when_cheaper():
    config = load_config(
        None,
        [
            "model.args={n_layer: 8, n_head: 4, n_embd: 512, block_size: 64, moe_experts: 8}",
            "train.global_batch_size=16",
            "train.micro_batch_size=4",
        ],
    )
    plan, _, _ = plan_layouts(config, gpus=4, gpu_memory="80GB")
    by_layout = {estimate.dims: estimate for estimate in plan.ranked}
    fsdp, ep4 = ParallelDims("fsdp", dp_shard=4), ParallelDims("fsdp", dp_shard=4, ep=4)
    assert ParallelDims("fsdp", dp_shard=4, ep=2) in by_layout and ep4 in by_layout
    # The same bytes stored, a quarter of the experts gathered, and far less gathered over the network.
    assert by_layout[ep4].peak.model_state == by_layout[fsdp].peak.model_state
    assert by_layout[ep4].peak.working < by_layout[fsdp].peak.working
    assert plan.recommended.dims == ep4
    # tp keeps the experts whole on every tp rank: the planner counts their repeated compute against it.
    tp4 = by_layout[ParallelDims("tp", tp=4)]
    assert tp4.repeated_seconds > 0 and by_layout[fsdp].repeated_seconds == by_layout[ep4].repeated_seconds == 0
    dense = load_config(None, ["model.args={n_layer: 2, n_head: 4, n_embd: 64}"])
    assert all(not estimate.dims.ep_enabled for estimate in plan_layouts(dense, gpus=4, gpu_memory="80GB")[0].ranked)


def test_plan_says_what_lora_saves_and_what_dpos_reference_costs(tmp_path, capsys):
    from paratrain.tools.sft_example import preferences, write_base_model, write_tokenizer

    vocab = write_tokenizer(tmp_path / "tokenizer")
    write_base_model(tmp_path / "base", vocab_size=vocab)
    (tmp_path / "pref.jsonl").write_text("".join(json.dumps(row) + "\n" for row in preferences(8)))
    dpo = [
        "model.factory=paratrain.models.hf:causal_lm",
        f"model.args={{config_dir: {tmp_path / 'base'}}}",
        f"model.pretrained={tmp_path / 'base'}",
        "eval.factory=null",
        "data.factory=paratrain.data.preference:preference_data",
        f"data.args={{files: {tmp_path / 'pref.jsonl'}, tokenizer: {tmp_path / 'tokenizer'}, seq_len: 16}}",
        "loss.factory=paratrain.losses:dpo",
    ]
    lora = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"
    for overrides in (dpo, [*dpo, lora]):
        main(
            [
                "plan",
                "examples/quickstart.yaml",
                *overrides,
                "--gpus",
                "2",
                "--gpu-memory",
                "80GB",
                "--host-memory",
                "64GB",
            ]
        )
        out = capsys.readouterr().out
        assert "DPO: the reference is the model as it starts" in out and "no second copy of the model" in out
        assert ("LoRA: " in out) == (lora in overrides)
    assert "parameters train (" in out and "of gradients and optimizer state a full fine-tune would hold" in out


def test_the_planner_counts_a_transformers_families_experts_and_recommends_ep_when_they_dominate():
    """Qwen3-MoE's stacked experts (transformers 5), 8 per layer, hold most of its parameters: the planner
    counts them as experts, offers ep and recommends ep=4 on 4 GPUs, as for paratrain's GPT."""
    pytest.importorskip("transformers", minversion="5")
    config = load_config(
        None,
        [
            "model.factory=paratrain.models.hf:causal_lm",
            "model.args={model_type: qwen3_moe, vocab_size: 256, hidden_size: 512, intermediate_size: 1024, "
            "moe_intermediate_size: 1024, num_hidden_layers: 8, num_attention_heads: 4, num_key_value_heads: 2, "
            "head_dim: 128, num_experts: 8, num_experts_per_tok: 2, max_position_embeddings: 64}",
            "data.args.block_size=64",
            "train.global_batch_size=16",
            "train.micro_batch_size=4",
        ],
    )
    facts = read_model_facts(config.model, seq_len=64)
    experts = [param.name for param in facts.params if param.expert]
    assert experts == [
        f"model.layers.{i}.mlp.experts.{name}" for i in range(8) for name in ("gate_up_proj", "down_proj")
    ]
    assert facts.expert_params > facts.num_params / 2
    plan, _, _ = plan_layouts(config, gpus=4, gpu_memory="80GB")
    by_layout = {estimate.dims: estimate for estimate in plan.ranked}
    fsdp, ep4 = ParallelDims("fsdp", dp_shard=4), ParallelDims("fsdp", dp_shard=4, ep=4)
    assert by_layout[ep4].peak.working < by_layout[fsdp].peak.working
    assert plan.recommended.dims == ep4
