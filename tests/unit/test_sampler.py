from __future__ import annotations

import pytest

from paratrain.data.sampler import DataPosition, GlobalBatchSampler
from paratrain.errors import ConfigError


def sampler(dp_rank=0, dp_size=1, *, size=50, global_batch=8, micro=2, seed=0) -> GlobalBatchSampler:
    return GlobalBatchSampler(size, global_batch, micro, dp_rank, dp_size, seed)


def take(iterator, count):
    return [next(iterator) for _ in range(count)]


def test_order_depends_only_on_seed_and_epoch():
    assert sampler().epoch_order(3).tolist() == sampler(dp_rank=1, dp_size=2).epoch_order(3).tolist()
    assert sampler().epoch_order(0).tolist() != sampler().epoch_order(1).tolist()
    assert sampler().epoch_order(0).tolist() != sampler(seed=1).epoch_order(0).tolist()


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_data_parallel_ranks_split_each_global_batch_without_overlap(dp_size):
    order = sampler().epoch_order(0)
    for batch in range(sampler().batches_per_epoch):
        per_rank = [sampler(r, dp_size).step_micro_batches(order, batch) for r in range(dp_size)]
        seen = [index for micro_batches in per_rank for micro in micro_batches for index in micro]
        assert seen == order[batch * 8 : (batch + 1) * 8].tolist()


def test_every_sample_is_seen_once_per_epoch_except_the_dropped_tail():
    s = sampler(size=50)
    indices = [i for micro in take(s.iter_micro_batches(DataPosition()), 6 * 4) for i in micro]
    assert len(indices) == len(set(indices)) == 48  # 50 samples, 6 global batches of 8, 2 dropped


def test_resuming_mid_epoch_continues_exactly_where_the_run_left_off():
    s = sampler()
    uninterrupted = take(s.iter_micro_batches(DataPosition()), 4 * 10)
    position = DataPosition()
    for _ in range(7):  # 7 steps cross the epoch boundary (6 batches per epoch)
        position.advance(s.batches_per_epoch)
    assert (position.epoch, position.batch_in_epoch) == (1, 1)
    resumed = take(s.iter_micro_batches(position), 4 * 3)
    assert resumed == uninterrupted[4 * 7 :]


def test_position_round_trips_through_its_state_dict():
    position = DataPosition(epoch=3, batch_in_epoch=5)
    restored = DataPosition()
    restored.load_state_dict(position.state_dict())
    assert restored == position


def test_global_batch_larger_than_the_dataset_is_refused():
    with pytest.raises(ConfigError, match="larger than the dataset"):
        sampler(size=4)


def test_global_batch_not_divisible_by_micro_batch_times_ranks_is_refused():
    with pytest.raises(ConfigError, match="multiple of 8"):
        sampler(dp_size=4, global_batch=12, micro=2)


@pytest.mark.parametrize("before,after", [(2, 4), (4, 1), (1, 2), (4, 2)])
def test_resuming_on_another_data_parallel_size_sees_every_sample_of_the_epoch_exactly_once(before, after):
    """Steps 1-3 on `before` ranks, a checkpointed position, then the rest of the epoch on `after`
    ranks: the union over ranks and steps is the epoch's samples, each once (the tail excepted)."""
    size, steps_before = 64, 3
    per_step = 8 // 2  # micro-batches of 2 in a global batch of 8, summed over ranks

    def read(dp_size: int, start: DataPosition, steps: int) -> list[int]:
        ranks = [sampler(r, dp_size, size=size).iter_micro_batches(start) for r in range(dp_size)]
        return [i for rank in ranks for micro in take(rank, steps * per_step // dp_size) for i in micro]

    position = DataPosition()
    seen = read(before, position, steps_before)
    for _ in range(steps_before):
        position.advance(sampler(size=size).batches_per_epoch)
    restored = DataPosition()
    restored.load_state_dict(position.state_dict())
    seen += read(after, restored, sampler(size=size).batches_per_epoch - steps_before)
    assert sorted(seen) == sorted(sampler(size=size).epoch_order(0).tolist())  # no repeats, no skips
