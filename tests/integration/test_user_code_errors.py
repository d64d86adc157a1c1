"""An exception in the user's own factory is one clear block on stderr: which factory, the exception's type
and message, and the user's frames only (no paratrain, torch or standard-library frames), exit code 2."""

from __future__ import annotations

import pytest

from tests.harness import run_cli_in_process, tiny_config, write_config

FACTORIES = "tests.integration.user_factories"


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            f"model.factory={FACTORIES}:broken_model",
            [
                "model.factory=",
                "raised ValueError: width 32 is not a multiple of 7",
                "in _check_width",
                "in broken_model",
            ],
        ),
        (f"data.factory={FACTORIES}:broken_data", ["data.factory=", "raised AttributeError", "in broken_data"]),
        (
            f"loss.factory={FACTORIES}:broken_loss",
            ["loss.factory=", "raised KeyError: 'cross_entropy'", "in broken_loss"],
        ),
        (
            f"model.factory={FACTORIES}:model_with_a_forward_bug",
            ["the first training step", "raised RuntimeError: normalising by the wrong axis", "in _norm"],
        ),
        (
            f"callbacks=[{{factory: {FACTORIES}:broken_callback}}]",
            ["callbacks[0].factory=", "raised LookupError: no callback registry configured", "in _callbacks_registry"],
        ),
    ],
)
def test_an_exception_in_a_user_factory_is_one_block_with_the_users_frames(tmp_path, override, expected):
    config = write_config(tmp_path / "config.yaml", tiny_config(tmp_path / "run"))
    code, stderr = run_cli_in_process(["train", str(config), override, "train.max_steps=1"])
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    block = stderr[stderr.index("paratrain: error:") :]
    for text in expected:
        assert text in block, f"{text!r} not in:\n{block}"
    frames = [line for line in block.splitlines() if line.strip().startswith("File ")]
    assert frames and all("user_factories.py" in line for line in frames), block
