"""Who computes which slice of the global batch when replica groups are missing (paratrain.launch.group_shares):
decisions as data, no process launched."""

from __future__ import annotations

import itertools

import pytest

from paratrain.launch.group_shares import GroupShares, coverage, plan_shares, read_coverage


def shares_of_every_live_group(live: list[int], *, replica_groups: int, batch: str = "fixed"):
    return {group: plan_shares(live, group=group, replica_groups=replica_groups, batch=batch) for group in live}


@pytest.mark.parametrize("replica_groups", [2, 3, 4, 5])
def test_under_fixed_every_slice_is_computed_exactly_once_by_some_live_group_whoever_is_missing(replica_groups):
    for count in range(1, replica_groups + 1):
        for live in itertools.combinations(range(replica_groups), count):
            shares = shares_of_every_live_group(list(live), replica_groups=replica_groups)
            computed = sorted(index for share in shares.values() for index in share.slices)
            assert computed == list(range(replica_groups)), live
            # Each group's own slice comes first, and the work is spread as evenly as the counts allow.
            assert all(share.slices[0] == group for group, share in shares.items())
            loads = [len(share.slices) for share in shares.values()]
            assert max(loads) - min(loads) <= 1


def test_the_scale_makes_the_mean_over_live_groups_the_mean_over_every_slice():
    # 1 of 3 live: its 3 slices' mean gradients summed, x 1/3, divided by 1 live group = the mean over 3 slices.
    alone = plan_shares([2], group=2, replica_groups=3, batch="fixed")
    assert alone.slices == (2, 0, 1) and alone.scale == pytest.approx(1 / 3) and alone.live == 1
    two = shares_of_every_live_group([0, 1], replica_groups=3)
    assert two[0].slices == (0, 2) and two[1].slices == (1,)
    assert two[0].scale == two[1].scale == pytest.approx(2 / 3)


def test_with_every_group_live_nothing_changes_whatever_the_mode():
    for batch in ("fixed", "shrink"):
        share = plan_shares([0, 1, 2], group=1, replica_groups=3, batch=batch)
        assert share.slices == (1,) and share.scale == 1.0  # exactly 1: the gradients are not touched


def test_under_shrink_each_live_group_computes_only_its_own_slice():
    shares = shares_of_every_live_group([0, 2], replica_groups=3, batch="shrink")
    assert {group: (share.slices, share.scale) for group, share in shares.items()} == {0: ((0,), 1.0), 2: ((2,), 1.0)}


def test_a_group_healing_in_the_quorum_computes_its_own_slice_alone_and_the_others_take_it_over():
    healing = plan_shares([0, 2], group=1, replica_groups=3, batch="fixed")
    assert healing == GroupShares((1,), 1.0, 2)
    takers = [plan_shares([0, 2], group=group, replica_groups=3, batch="fixed") for group in (0, 2)]
    assert [shares.slices for shares in takers] == [(0, 1), (2,)]


def test_coverage_lets_a_step_commit_only_when_no_slice_is_repeated_and_under_fixed_none_is_missing():
    def summed(*groups_slices):
        vectors = [coverage(slices, replica_groups=3) for slices in groups_slices]
        return [sum(column) for column in zip(*vectors)]

    whole = read_coverage(summed((0, 2), (1,)))
    assert whole.computed == 3 and whole.complete(batch="fixed") and whole.complete(batch="shrink")
    # Two groups that disagree on the quorum: both take over slice 2.
    twice = read_coverage(summed((0, 2), (1, 2)))
    assert twice.repeated == (2,) and not twice.complete(batch="fixed") and not twice.complete(batch="shrink")
    # Slice 2 left out: a shrunk step, never a fixed one.
    short = read_coverage(summed((0,), (1,)))
    assert short.missing == (2,) and short.computed == 2
    assert short.complete(batch="shrink") and not short.complete(batch="fixed")
    # The vectors travel as floats averaged over the live groups; read back they round to counts.
    assert read_coverage([x / 3 * 3 for x in (1.0, 1.0, 1.0)]).computed == 3
