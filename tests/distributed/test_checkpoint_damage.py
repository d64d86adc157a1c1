"""A damaged file found while loading, by one rank only, makes every rank fall back together."""

from __future__ import annotations

from tests.distributed import checkpoint_checks


def test_a_file_damaged_on_one_rank_only_makes_every_rank_resume_from_the_previous_checkpoint(ranks, tmp_path):
    per_rank = ranks.run(checkpoint_checks.resume_with_one_ranks_file_damaged, str(tmp_path / "checkpoints"), 2)
    # Chosen by the checks that read no data, found damaged by rank 2's load, fallen back from by all.
    assert [result["chosen"] for result in per_rank] == ["step-2"] * ranks.world_size
    assert [result["loaded"] for result in per_rank] == ["step-1"] * ranks.world_size
    assert [result["values"] for result in per_rank] == [[1.0]] * ranks.world_size
    assert [result["step"] for result in per_rank] == [1] * ranks.world_size
