"""Initialising only what a rank holds (models/init_recording.py, models/init_replay.py), in one process:

- what is recorded is the model's own initialisation (transformers' ``_init_weights`` for several families,
  paratrain's ``init_parameter``), so the replayed weights have its distribution: its zeros and ones exactly,
  its standard deviations within sampling error;
- any box of a tensor replays to exactly that box of the whole tensor, so every layout's slices assemble
  to the same weights;
- a box of rows draws only the blocks that meet it, so a rank's drawing falls with its shard;
- what the recording cannot divide is initialised whole from a generator seeded by the name.
"""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch
from torch import nn

from paratrain.models import init_replay
from paratrain.models.gpt import build_gpt
from paratrain.models.hf import causal_lm
from paratrain.models.init import build_on_meta, materialize
from paratrain.models.init_recording import record_declared_init, record_transformers_init
from paratrain.models.init_replay import BLOCK_ELEMENTS, Box, replay, rows_drawn

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "llama": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    "gemma": dict(num_key_value_heads=2, head_dim=16),
    "phi3": dict(num_key_value_heads=2, pad_token_id=0),
    "olmo2": dict(num_key_value_heads=2),
}


def replayed(factory, seed: int = 0) -> nn.Module:
    model = build_on_meta(factory, seed=seed)
    materialize(model, factory=factory, device=torch.device("cpu"), seed=seed)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_model_gets_its_own_initialisations_distribution(family):
    factory = lambda: causal_lm(model_type=family, **SMALL, **FAMILIES[family])  # noqa: E731
    torch.manual_seed(0)
    reference = dict(factory().named_parameters())  # transformers' own init, for real
    ours = dict(replayed(factory).named_parameters())
    assert ours.keys() == reference.keys()
    for name, theirs in reference.items():
        mine = ours[name]
        if theirs.std() == 0:  # a constant (zeros, ones): exactly that constant
            assert torch.equal(mine, theirs), name
        else:  # drawn: the same distribution, within the sampling error of this many numbers
            spread = theirs.std().item() * 6 / math.sqrt(theirs.numel())
            assert abs(mine.mean().item() - theirs.mean().item()) < 2 * spread, name
            assert mine.std().item() == pytest.approx(theirs.std().item(), rel=0.1), name


def test_a_padding_row_transformers_zeroes_is_zero_and_the_rest_is_drawn():
    factory = lambda: causal_lm(model_type="phi3", **SMALL, **FAMILIES["phi3"])  # noqa: E731
    embedding = replayed(factory).get_parameter("model.embed_tokens.weight")
    assert torch.count_nonzero(embedding[0]) == 0 and torch.count_nonzero(embedding[1:]) == embedding[1:].numel()


def test_paratrains_gpt_records_its_init_parameter_and_keeps_its_depth_scaled_residuals():
    factory = lambda: build_gpt(vocab_size=256, n_layer=4, n_embd=64, n_head=4)  # noqa: E731
    model = replayed(factory)
    residual, plain = model.blocks[0].attn.out_proj.weight, model.blocks[0].attn.q_proj.weight
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert plain.std().item() == pytest.approx(0.02, rel=0.1)
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in model.named_parameters() if "norm" in n and "weight" in n)


def test_two_processes_with_the_same_seed_replay_the_same_weights_and_another_seed_does_not():
    factory = lambda: causal_lm(model_type="llama", **SMALL, **FAMILIES["llama"])  # noqa: E731
    first, again, other = replayed(factory, 7), replayed(factory, 7), replayed(factory, 8)
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), again.parameters(), strict=True))
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


@pytest.mark.parametrize(
    "shape, box",
    [
        ((1000, 300), Box((250, 0), (250, 300))),  # fsdp x4's second shard: rows
        ((1000, 300), Box((0, 150), (1000, 150))),  # tensor parallel's rowwise half: columns
        ((1000, 300), Box((500, 100), (250, 100))),  # fsdp x tp: a block of both
        ((3, 2000, 200), Box((1, 0, 0), (2, 2000, 200))),  # stacked experts, ep x3
        ((5000,), Box((1234,), (2000,))),  # a vector
        ((2, 600_000), Box((1, 0), (1, 600_000))),  # rows longer than a block
        ((), Box((), ())),  # a number
    ],
)
def test_any_box_of_a_tensor_replays_to_exactly_that_box_of_the_whole(shape, box):
    model = nn.Linear(1, 1)  # any module: what is recorded is a random op then elementwise ones on `shape`
    model.init_parameter = lambda name, tensor, generator: (
        nn.init.uniform_(tensor, -0.9, 0.9).erfinv_().mul_(0.7).clamp_(-1, 1)
    )
    record = record_declared_init(model, "w", torch.empty(shape, device="meta"))
    assert [op.method for op in record.ops] == ["uniform_", "erfinv_", "mul_", "clamp_"]
    whole = replay(record, name="w", seed=3, shape=shape, box=Box.whole(shape), dtype=torch.float32)
    part = replay(record, name="w", seed=3, shape=shape, box=box, dtype=torch.float32)
    assert torch.equal(part, whole[box.slices()])
    assert whole.abs().max() <= 1.0 and (whole.numel() == 1 or whole.std() > 0.3)


def test_a_box_of_rows_draws_only_the_blocks_that_meet_it():
    shape = (8192, 1024)  # 256 rows per block: 32 blocks
    quarter = Box((2048, 0), (2048, 1024))
    drawn = rows_drawn(shape, quarter)
    assert drawn == 2048  # exactly its rows: the shard is whole blocks
    assert rows_drawn(shape, Box((100, 0), (300, 1024))) <= 300 + 2 * BLOCK_ELEMENTS // 1024
    assert rows_drawn(shape, Box.whole(shape)) == 8192


def test_an_op_on_part_of_a_tensor_lands_only_where_a_box_holds_that_part():
    linear = nn.Embedding(100, 8, padding_idx=60)
    linear.init_parameter = lambda name, tensor, generator: (nn.init.normal_(tensor), nn.init.zeros_(tensor[60]))
    record = record_declared_init(linear, "weight", torch.empty(100, 8, device="meta"))
    assert [op.view is None for op in record.ops] == [True, False]
    whole = replay(record, name="weight", seed=0, shape=(100, 8), box=Box.whole((100, 8)), dtype=torch.float32)
    assert torch.count_nonzero(whole[60]) == 0
    for box in (Box((50, 0), (25, 8)), Box((0, 4), (100, 4)), Box((75, 0), (25, 8))):
        part = replay(record, name="weight", seed=0, shape=(100, 8), box=box, dtype=torch.float32)
        assert torch.equal(part, whole[box.slices()])


def test_what_the_recording_cannot_divide_is_opaque_and_initialised_whole():
    model = nn.Linear(4, 4)
    for init in (nn.init.orthogonal_, nn.init.trunc_normal_):  # a QR; a rejection sampling that reads its draws
        model.init_parameter = lambda name, tensor, generator, init=init: init(tensor)
        assert record_declared_init(model, "weight", torch.empty(6, 4, device="meta")).opaque

    factory = lambda: Orthogonal()  # noqa: E731
    first, again = replayed(factory, 1), replayed(factory, 1)
    weight = first.weight
    assert torch.allclose(weight.T @ weight, torch.eye(4), atol=1e-5)  # orthogonal: the model's own init
    assert torch.equal(weight, again.weight)  # seeded by the name: the same in every process


def test_a_transformers_recording_divides_every_weight_of_a_llama():
    model = build_on_meta(lambda: causal_lm(model_type="llama", **SMALL, **FAMILIES["llama"]), seed=0)
    records = record_transformers_init(model)
    assert set(records) == {name for name, _ in model.named_parameters()}
    assert not any(record.opaque for record in records.values())
    assert all(record.starts_whole() for record in records.values())


class Orthogonal(nn.Module):
    """A model whose init the recording cannot divide (QR of the whole matrix)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(6, 4))

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator | None) -> None:
        nn.init.orthogonal_(tensor, generator=generator)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs @ self.weight.T


def test_blocks_drawn_in_place_into_a_shard_equal_the_blocks_drawn_apart():
    """A rank holding whole blocks draws them straight into its shard (no copy): the same numbers."""
    model = nn.Linear(1, 1)
    model.init_parameter = lambda name, tensor, generator: nn.init.normal_(tensor, std=0.02)
    shape = (4096, 256)  # 1024 rows per block
    record = record_declared_init(model, "w", torch.empty(shape, device="meta"))
    whole = replay(record, name="w", seed=1, shape=shape, box=Box.whole(shape), dtype=torch.float32)
    for box in (Box((1024, 0), (2048, 256)), Box((1000, 0), (1100, 256))):  # whole blocks; parts of blocks
        shard = torch.empty(box.lengths)
        replay(record, name="w", seed=1, shape=shape, box=box, out=shard)
        assert torch.equal(shard, whole[box.slices()])


def test_blocks_drawn_on_several_threads_equal_the_blocks_drawn_on_one(monkeypatch):
    """A tensor's blocks are drawn on a thread pool (each block its own generator and rows): the values do not
    depend on how many threads draw them, for whole blocks drawn in place and for parts of blocks alike."""
    model = nn.Linear(1, 1)
    model.init_parameter = lambda name, tensor, generator: nn.init.trunc_normal_(tensor, std=0.02)
    shape = (8192, 256)  # 8 blocks
    record = record_declared_init(model, "w", torch.empty(shape, device="meta"))
    drawn = {}
    for threads in (1, 4):
        monkeypatch.setattr(init_replay, "draw_threads", lambda threads=threads: threads)
        drawn[threads] = [
            replay(record, name="w", seed=5, shape=shape, box=box, dtype=torch.float32)
            for box in (Box.whole(shape), Box((1000, 0), (5000, 256)), Box((0, 100), (8192, 100)))
        ]
        parameter = nn.Parameter(torch.empty(shape))  # materialize fills parameters in place, under no_grad
        with torch.no_grad():
            replay(record, name="w", seed=5, shape=shape, box=Box.whole(shape), out=parameter)
        drawn[threads].append(parameter.detach())
    assert all(torch.equal(one, four) for one, four in zip(drawn[1], drawn[4], strict=True))
    assert torch.equal(drawn[1][0], drawn[1][-1]) and drawn[1][0].std() > 0.015


def test_each_local_process_draws_on_its_share_of_the_cpus(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert init_replay.draw_threads() == min(cpus, init_replay.MAX_DRAW_THREADS)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus * 2))
    assert init_replay.draw_threads() == 1


def test_no_drawing_thread_outlives_the_init_into_the_data_loaders_forks(monkeypatch):
    monkeypatch.setattr(init_replay, "draw_threads", lambda: 2)
    factory = lambda: build_gpt(vocab_size=4096, n_layer=1, n_embd=128, n_head=4)  # noqa: E731 - a 2-block embedding
    drawing = []
    fill_block = init_replay._fill_block
    monkeypatch.setattr(
        init_replay,
        "_fill_block",
        lambda *a, **k: (drawing.append(threading.current_thread().name), fill_block(*a, **k)),
    )
    replayed(factory)
    assert any(name.startswith("paratrain-init") for name in drawing)  # the pool drew
    assert not [thread.name for thread in threading.enumerate() if thread.name.startswith("paratrain-init")]
