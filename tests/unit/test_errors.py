"""The one map from the ways a run ends early to the documented exit codes, read by both entries."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from paratrain.errors import (
    RUN_ENDINGS,
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    IncompleteHeal,
    NonFiniteStop,
    Preempted,
    StoppedAwaitingQuorum,
    UserCodeError,
    exit_code_of,
)

ENDINGS = [
    (ConfigError("train.max_steps=-1 must be positive"), 2),
    (CheckpointError("step-3 has no manifest"), 2),
    (UserCodeError("model.factory raised"), 2),
    (Preempted(step=4, checkpoint=Path("ckpt/step-4"), signal_name="SIGTERM"), 75),
    (NonFiniteStop(step=7, reason="non-finite gradients", checkpoint=None), 3),
    (CheckpointWriteError(step=5, path=Path("ckpt"), errno=errno.ENOSPC, checkpoint=None, fix="free space"), 74),
    (StoppedAwaitingQuorum(step=5, group=1, signal_name="SIGTERM", cause="tcp connect error"), 77),
    (IncompleteHeal(group=1, healed=1, ranks=2), 77),
]


def test_every_exit_code_is_in_the_documented_table():
    table = (Path(__file__).resolve().parents[2] / "docs/health.md").read_text()
    for _, code in ENDINGS:
        assert f"\n| {code} | " in table, code


@pytest.mark.parametrize(("error", "code"), ENDINGS, ids=lambda value: type(value).__name__)
def test_each_way_a_run_ends_early_has_its_documented_exit_code(error, code):
    assert isinstance(error, RUN_ENDINGS)
    assert exit_code_of(error) == code


def test_an_unexpected_exception_is_not_a_run_ending():
    assert not isinstance(RuntimeError("bug"), RUN_ENDINGS)
