"""Expert parallel (parallel.ep) trains paratrain's MoE GPT like a single process: ep x2 and x4, ep beside
FSDP over the ranks ep leaves (dp_shard=4, ep=2), beside a pipeline and beside tensor parallel (and tp
alone, the MoE feed-forward whole on each tp rank); the experts each rank's router
sends tokens to are counted as one process counts them; checkpoints hold whole stacked experts, so an
ep x4 run resumes under ep x2 and that one in a single process, and an ep run restarted from a checkpoint
trains on bit for bit. Aux-loss-free balancing (moe_balance: bias) moves each expert's router bias
under ep x2 as in one process."""

from __future__ import annotations

import pytest
import torch

from tests.harness import (
    LayoutRuns,
    assert_matches_single_process,
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    read_metrics,
)

pytestmark = pytest.mark.timeout(900)

# Checkpoints every 3 steps: a restart from the first; a chain resumes at the middle (6) and three quarters (9).
STEPS, EVERY, MIDPOINT, LATE = 12, 3, 6, 9
LOSS_RTOL = 1e-5
# Capacity 1.0 drops assignments (each forward holds 2 x 16 tokens in every layout, so each expert keeps
# the same 16 places): the dropped counts are compared too, and some experts get no token from a rank.
MOE_ARGS = (
    "vocab_size: 128, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32, "
    "moe_experts: 4, moe_top_k: 2, moe_capacity_factor: 1.0"
)
GPT_MOE = ["model.factory=paratrain.models.gpt:build_gpt", f"model.args={{{MOE_ARGS}, moe_aux_loss_coef: 0.1}}"]
# Under a pipeline the load-balancing loss cannot reach the loss function (refused): its coefficient is 0.
GPT_MOE_NO_AUX = ["model.factory=paratrain.models.gpt:build_gpt", f"model.args={{{MOE_ARGS}, moe_aux_loss_coef: 0}}"]

# Aux-loss-free balancing: each expert's router bias moved after every step (capacity still drops tokens).
GPT_MOE_BIAS = GPT_MOE + ["model.args.moe_balance=bias", "model.args.moe_bias_update_rate=0.01"]

LAYOUTS = {
    "single": (GPT_MOE, 1),
    "single bias": (GPT_MOE_BIAS, 1),
    "ep x2 bias": (GPT_MOE_BIAS + ["parallel.dp_shard=2", "parallel.ep=2"], 2),
    "single no aux": (GPT_MOE_NO_AUX, 1),
    "ep x2": (GPT_MOE + ["parallel.dp_shard=2", "parallel.ep=2"], 2),
    "ep x4": (GPT_MOE + ["parallel.dp_shard=4", "parallel.ep=4"], 4),
    "ep x2 x dp_shard 4": (GPT_MOE + ["parallel.dp_shard=4", "parallel.ep=2"], 4),
    "ep x2 x pp 2": (GPT_MOE_NO_AUX + ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"], 4),
    # Attention split over tp, the MoE feed-forward whole on each tp rank; then its experts divided by ep too.
    "tp x2": (GPT_MOE + ["parallel.tp=2"], 2),
    "ep x2 x tp 2": (GPT_MOE + ["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2"], 4),
    # The ep x2 run restarted from its first checkpoint, in the same layout.
    "ep x2 restarted": (
        GPT_MOE + ["parallel.dp_shard=2", "parallel.ep=2", f"checkpoint.resume={{run:ep x2}}/checkpoints/step-{EVERY}"],
        2,
    ),
    # The ep x4 run's midpoint checkpoint resumed under ep x2, and that one's later checkpoint in one process.
    "ep x4 to ep x2": (
        GPT_MOE
        + ["parallel.dp_shard=2", "parallel.ep=2", f"checkpoint.resume={{run:ep x4}}/checkpoints/step-{MIDPOINT}"],
        2,
    ),
    "ep x2 to single": (GPT_MOE + [f"checkpoint.resume={{run:ep x4 to ep x2}}/checkpoints/step-{LATE}"], 1),
}
EP_LAYOUTS = [
    name for name in LAYOUTS if name.startswith(("ep", "tp")) and " to " not in name and "restarted" not in name
]
ROUTER_FIELDS = ("moe_expert_tokens_min", "moe_expert_tokens_max", "moe_dropped_tokens")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LayoutRuns:
    return LayoutRuns(
        tmp_path_factory.mktemp("ep"),
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS},
        checkpoint={"every_steps": EVERY, "keep_last": None},
        debug={"dump_gradients_at_steps": [1]},
    )


def single_of(layout: str) -> str:
    return "single no aux" if " pp " in layout else "single bias" if layout.endswith(" bias") else "single"


@pytest.mark.parametrize("layout", EP_LAYOUTS)
def test_expert_parallel_matches_a_single_process_losses_and_first_gradients(runs, layout):
    reference, laid_out = runs.get(single_of(layout)), runs.get(layout)
    expected = assert_matches_single_process(reference, laid_out, steps=STEPS, loss_rtol=LOSS_RTOL)
    assert any("experts" in name for name in expected)


@pytest.mark.parametrize("layout", EP_LAYOUTS)
def test_expert_parallel_logs_the_single_process_expert_token_counts(runs, layout):
    expected, actual = read_metrics(runs.get(single_of(layout))), read_metrics(runs.get(layout))
    assert len(actual) == len(expected) == STEPS
    assert all(record["moe_dropped_tokens"] > 0 for record in expected)
    # Under a pipeline the first step also counts torch's shape-inference forward (run with grad inside the
    # schedule's first step), with or without ep, so its counts start at step 2.
    first = 1 if " pp " in layout else 0
    for step, (want, got) in enumerate(zip(expected[first:], actual[first:], strict=True), start=first + 1):
        assert [got[field] for field in ROUTER_FIELDS] == [want[field] for field in ROUTER_FIELDS], step


def test_the_balance_bias_moves_under_ep_as_in_one_process(runs):
    """moe_balance: bias: every step each expert's bias moves by the counts of every rank, so ep x2 holds one
    process's biases (and routes as it does: the counts above)."""
    expected = checkpoint_weights(runs.get("single bias") / f"checkpoints/step-{STEPS}")
    actual = checkpoint_weights(runs.get("ep x2 bias") / f"checkpoints/step-{STEPS}")
    for block in range(2):
        name = f"blocks.{block}.mlp.router.expert_bias"
        assert expected[name].any(), name  # moved, by 0.01 a step
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6, msg=name)


def test_an_ep_x4_checkpoint_resumes_under_ep_x2_then_in_one_process_and_trains_on_identically(runs):
    origin = losses_by_step(runs.get("ep x4"))
    chained = {
        **{s: loss for s, loss in losses_by_step(runs.get("ep x4 to ep x2")).items() if MIDPOINT < s <= LATE},
        **{s: loss for s, loss in losses_by_step(runs.get("ep x2 to single")).items() if s > LATE},
    }
    assert sorted(chained) == list(range(MIDPOINT + 1, STEPS + 1))
    assert max_relative_difference(chained, {s: origin[s] for s in chained}) <= LOSS_RTOL
    expected = checkpoint_weights(runs.get("ep x4") / f"checkpoints/step-{STEPS}")
    actual = checkpoint_weights(runs.get("ep x2 to single") / f"checkpoints/step-{STEPS}")
    assert actual.keys() == expected.keys()
    assert expected["blocks.0.mlp.experts.up_proj"].shape == (4, 32, 128)  # whole stacked experts
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-5, msg=name)


def test_an_ep_run_restarted_from_a_checkpoint_trains_on_bit_identical(runs):
    """ep x2 restarted from its first checkpoint in a new process group: the same losses and, at the last
    step, the same weights bit for bit (the token exchange adds nothing nondeterministic)."""
    origin, restarted = runs.get("ep x2"), runs.get("ep x2 restarted")
    resumed_losses = losses_by_step(restarted)
    assert sorted(resumed_losses) == list(range(EVERY + 1, STEPS + 1))
    assert resumed_losses == {step: loss for step, loss in losses_by_step(origin).items() if step > EVERY}
    expected = checkpoint_weights(origin / f"checkpoints/step-{STEPS}")
    actual = checkpoint_weights(restarted / f"checkpoints/step-{STEPS}")
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs after the restart"
