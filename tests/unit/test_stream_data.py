"""The streamed corpus: the same windows as the packed one, and a position that resumes exactly on the
same and on another data-parallel size, in memory and through a real checkpoint."""

from __future__ import annotations

import itertools

import pytest
import torch

from paratrain.data.lm import packed_text, streamed_text
from paratrain.data.stream import StreamBatches
from tests.harness import checkpoint_weights, run_cli_in_process, tiny_config, write_config
from tests.unit.test_lm_data import corpus  # noqa: F401 (a fixture)


def stream_args(corpus):  # noqa: F811
    return {key: corpus[key] for key in ("files", "tokenizer")}


def test_the_stream_yields_the_packed_windows_in_order_and_starts_a_new_epoch_after_the_last(corpus):  # noqa: F811
    packed = packed_text(**corpus, block_size=4)
    stream = streamed_text(**stream_args(corpus), block_size=4)
    windows = list(itertools.islice(iter(stream), len(packed) + 1))
    for i in range(len(packed)):
        assert torch.equal(windows[i][0], packed[i][0]) and torch.equal(windows[i][1], packed[i][1])
    assert stream.position.epoch == 1 and torch.equal(windows[-1][0], packed[0][0])


def steps_on(stream_state, corpus, *, dp_size, steps):  # noqa: F811
    """Each rank's own stream (as in separate processes) from stream_state; the global batches they read."""
    per_step, states = [[] for _ in range(steps)], []
    for rank in range(dp_size):
        stream = streamed_text(**stream_args(corpus), block_size=4)
        if stream_state is not None:
            stream.position.load_state_dict(stream_state)
        batches = StreamBatches(stream, global_batch_size=8, micro_batch_size=2, dp_rank=rank, dp_size=dp_size)
        for step in range(steps):
            per_step[step].extend(row for micro in next(batches) for row in micro[0].tolist())
        states.append(stream.position.state_dict())
    assert all(str(state) == str(states[0]) for state in states), "every rank is at the same stream position"
    return per_step, states[0]


@pytest.mark.parametrize("before,after", [(2, 2), (2, 4), (4, 1)])
def test_a_resumed_stream_reads_what_the_uninterrupted_one_reads_on_any_data_parallel_size(corpus, before, after):  # noqa: F811
    uninterrupted, _ = steps_on(None, corpus, dp_size=1, steps=9)  # past the end of the first epoch
    first, state = steps_on(None, corpus, dp_size=before, steps=4)
    rest, _ = steps_on(state, corpus, dp_size=after, steps=5)
    assert first + rest == uninterrupted


def test_a_streamed_run_resumed_from_its_checkpoint_ends_bit_identical(tmp_path, corpus):  # noqa: F811
    data = {"factory": "paratrain.data.lm:streamed_text", "args": {**stream_args(corpus), "block_size": 8}}
    model = {"args": {"vocab_size": 64, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16}}
    config = tiny_config(
        tmp_path / "run", data=data, model=model, train={"max_steps": 8}, checkpoint={"every_steps": 3}
    )
    path = write_config(tmp_path / "run.yaml", config)
    assert run_cli_in_process(["train", str(path)])[0] == 0
    resumed = [f"checkpoint.resume={tmp_path}/run/checkpoints/step-3", f"run.output_dir={tmp_path}/resumed"]
    code, stderr = run_cli_in_process(["train", str(path), *resumed])
    assert code == 0, stderr
    expected = checkpoint_weights(tmp_path / "run/checkpoints/step-8")
    actual = checkpoint_weights(tmp_path / "resumed/checkpoints/step-8")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_loader_workers_with_a_stream_are_refused_naming_the_key(tmp_path, corpus):  # noqa: F811
    data = {"factory": "paratrain.data.lm:streamed_text", "args": {**stream_args(corpus), "block_size": 8}}
    config = tiny_config(tmp_path / "run", data={**data, "num_workers": 2}, model={"args": {"vocab_size": 64}})
    code, stderr = run_cli_in_process(["train", str(write_config(tmp_path / "run.yaml", config))])
    assert code == 2 and "data.num_workers=2: a streamed corpus is read in the training process" in stderr
