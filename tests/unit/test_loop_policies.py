"""The decisions the training loop asks for, fed plain numbers: which steps are logged and what their record
holds (tracking.metrics), which steps end with a save and how (checkpoint.policy), which checkpoint a run
resumes (checkpoint.policy), and each step's batches and data position (data.feed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from paratrain.checkpoint.checkpointer import Checkpointer
from paratrain.checkpoint.policy import SaveDue, choose_resume, save_due
from paratrain.config.schema import CheckpointConfig, DataConfig
from paratrain.data.feed import DataFeed
from paratrain.errors import CheckpointError, ConfigError
from paratrain.tracking.metrics import LogWindow, build_record, should_log


def test_the_first_every_nth_and_last_steps_are_logged():
    logged = [step for step in range(1, 26) if should_log(step, every_steps=10, max_steps=25)]
    assert logged == [1, 10, 20, 25]


def test_a_window_averages_only_the_applied_steps_and_counts_its_data_wait():
    window = LogWindow.open(torch.device("cpu"))
    window.add_step(torch.tensor(2.0), finite=torch.tensor(True))
    window.add_step(torch.tensor(float("nan")), finite=torch.tensor(False))  # skipped: not in the sum
    window.add_step(torch.tensor(4.0), finite=torch.tensor(True))
    window.next_batch(iter([["batch"]]))
    assert window.steps == 3
    assert window.mean_loss(2) == 3.0
    assert window.data_wait >= 0.0
    assert math.isnan(window.mean_loss(0))


def test_time_left_out_of_a_window_does_not_count_as_step_time():
    window = LogWindow(torch.zeros(()), started=100.0, steps=4)
    window.leave_out(30.0)
    assert window.started == 130.0


def test_a_record_holds_the_rates_the_window_measured():
    window = LogWindow(torch.zeros(()), steps=4, data_wait=0.2)
    window.started -= 2.0  # four steps in two seconds: half a second each
    record = build_record(
        window,
        step=40,
        loss=1.5,
        lr=1e-3,
        grad_norm=0.7,
        samples_per_step=16,
        tokens_per_sample=64,
        epoch=2,
        world_size=4,
        skipped_steps=0,
    )
    assert record["step"] == 40 and record["loss"] == 1.5 and record["epoch"] == 2 and record["world_size"] == 4
    assert record["step_time_s"] == pytest.approx(0.5, rel=0.05)
    assert record["samples_per_s"] == pytest.approx(32.0, rel=0.05)
    assert record["tokens_per_s"] == pytest.approx(32.0 * 64, rel=0.05)
    assert record["data_wait_fraction"] == pytest.approx(0.1, rel=0.05)
    assert "skipped_steps" not in record


def test_a_record_names_skipped_steps_and_leaves_out_tokens_of_non_token_samples():
    window = LogWindow(torch.zeros(()), steps=1)
    record = build_record(
        window,
        step=3,
        loss=float("nan"),
        lr=0.1,
        grad_norm=float("inf"),
        samples_per_step=8,
        tokens_per_sample=None,
        epoch=0,
        world_size=1,
        skipped_steps=2,
    )
    assert record["skipped_steps"] == 2
    assert "tokens_per_s" not in record


def test_saves_fall_every_n_steps_and_at_the_end():
    options = CheckpointConfig(every_steps=4)
    due = {step: save_due(step, options, max_steps=10) for step in range(1, 11)}
    assert [step for step, decision in due.items() if decision] == [4, 8, 10]
    assert due[4] == SaveDue(blocking=True, periodic=True)
    assert due[10] == SaveDue(blocking=True, periodic=False)  # the last save, not one of the interval


def test_no_final_save_without_save_final_and_none_at_all_by_default_midway():
    assert save_due(10, CheckpointConfig(save_final=False), max_steps=10) is None
    assert save_due(5, CheckpointConfig(), max_steps=10) is None


def test_asynchronous_saves_block_only_at_the_last_step_and_on_a_stop():
    options = CheckpointConfig(every_steps=2, async_save=True)
    assert save_due(2, options, max_steps=10) == SaveDue(blocking=False, periodic=True)
    assert save_due(10, options, max_steps=10) == SaveDue(blocking=True)
    assert save_due(3, options, max_steps=10, preempted=True) == SaveDue(blocking=True)
    assert save_due(5, options, max_steps=10, ending_early=True) == SaveDue(blocking=True)


def test_a_preempted_or_early_ended_step_saves_even_off_the_period():
    options = CheckpointConfig(every_steps=0)
    assert save_due(3, options, max_steps=10, preempted=True) is not None
    assert save_due(3, options, max_steps=10, ending_early=True) is not None
    assert save_due(3, CheckpointConfig(save_final=False), max_steps=10, ending_early=True) is None


class _Counter:
    """A Stateful of one number, to write real checkpoints in one process."""

    def __init__(self, value: int):
        self.value = torch.tensor([value])

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state_dict):
        self.value.copy_(state_dict["value"])


def _checkpointer(directory: Path, config: dict) -> Checkpointer:
    return Checkpointer(directory, keep_last=None, rank=0, world_size=1, config=config)


def test_resume_takes_the_newest_checkpoint_never_none_and_a_named_one(tmp_path):
    config = {"train": {"seed": 1}, "log": {"every_steps": 10}}
    checkpointer = _checkpointer(tmp_path, config)
    for step in (2, 4):
        checkpointer.save(step, {"counter": _Counter(step)})
    auto, never = CheckpointConfig(resume="auto"), CheckpointConfig(resume="never")
    assert choose_resume(checkpointer, auto, config=config, is_main=True) == tmp_path / "step-4"
    assert choose_resume(checkpointer, never, config=config, is_main=True) is None
    named = CheckpointConfig(resume=str(tmp_path / "step-2"))
    assert choose_resume(checkpointer, named, config=config, is_main=True) == tmp_path / "step-2"
    with pytest.raises(CheckpointError):
        choose_resume(checkpointer, CheckpointConfig(resume=str(tmp_path / "step-9")), config=config, is_main=True)


def test_resume_refuses_a_changed_seed_unless_allowed_and_lets_a_logging_change_through(tmp_path):
    saved = {"train": {"seed": 1}, "log": {"every_steps": 10}}
    _checkpointer(tmp_path, saved).save(2, {"counter": _Counter(2)})
    checkpointer = _checkpointer(tmp_path, saved)
    changed_seed = {"train": {"seed": 2}, "log": {"every_steps": 10}}
    with pytest.raises(ConfigError, match="train.seed"):
        choose_resume(checkpointer, CheckpointConfig(), config=changed_seed, is_main=True)
    allowed = CheckpointConfig(allow_config_change=True)
    assert choose_resume(checkpointer, allowed, config=changed_seed, is_main=True) == tmp_path / "step-2"
    logging_only = {"train": {"seed": 1}, "log": {"every_steps": 5}}
    assert choose_resume(checkpointer, CheckpointConfig(), config=logging_only, is_main=True) == tmp_path / "step-2"


def _numbers(count: int) -> TensorDataset:
    values = torch.arange(count, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(values, values)


def _feed(dataset, **kw) -> DataFeed:
    options = {"global_batch_size": 4, "micro_batch_size": 1, "seed": 0, "dp_rank": 0, "dp_size": 2, **kw}
    return DataFeed(dataset, DataConfig(factory="unused", shuffle=False), **options)


def test_a_feed_hands_this_ranks_micro_batches_and_moves_its_position_per_step():
    feed = _feed(_numbers(10))  # 2 global batches of 4 per epoch; rank 0 of 2 takes 2 micro-batches of 1
    assert feed.micro_batches_per_step == 2 and feed.tokens_per_sample is None
    batches = feed.step_batches()
    first = next(batches)
    assert [inputs.flatten().tolist() for inputs, _ in first] == [[0.0], [1.0]]
    feed.step_done()
    feed.step_done()
    assert (feed.position.epoch, feed.position.batch_in_epoch) == (1, 0)


def test_a_feed_resumes_from_its_position_and_peeks_without_moving():
    feed = _feed(_numbers(10), dp_rank=1)
    feed.step_done()  # one global batch read: the next starts at sample 4
    assert [inputs.item() for inputs, _ in feed.first_samples(2)] == [0.0, 1.0]
    assert [inputs.flatten().tolist() for inputs, _ in next(feed.step_batches())] == [[6.0], [7.0]]
    assert feed.position.batch_in_epoch == 1


def test_a_feed_counts_tokens_of_integer_samples():
    ids = torch.arange(12).view(4, 3)
    assert _feed(TensorDataset(ids, ids), dp_size=1).tokens_per_sample == 3


def test_a_feed_refuses_a_dataset_smaller_than_a_global_batch():
    with pytest.raises(ConfigError, match="larger than the dataset"):
        _feed(_numbers(3))
