"""The config loader refuses files and values it could only guess at, through the CLI in-process: exit
code 2, no traceback, the file or key named."""

from __future__ import annotations

import pytest

from tests.harness import run_cli_in_process, tiny_config, write_config


def refused(args: list[str], *expected: str) -> str:
    code, stderr = run_cli_in_process(args)
    assert code == 2, f"exit {code}:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    for text in expected:
        assert text in stderr, f"{text!r} not in:\n{stderr}"
    return stderr


def test_a_directory_passed_as_the_config_is_named_as_a_directory(tmp_path):
    refused(["train", str(tmp_path)], f"config file {tmp_path} is a directory")


def test_a_config_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    refused(["config", "show", str(path)], "is not UTF-8 text (byte 16 is 0xe9)")


def test_duplicate_keys_are_refused_with_both_line_numbers(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  max_steps: 10\n  seed: 1\n  max_steps: 20\n")
    refused(["config", "show", str(path)], "duplicate key 'max_steps' on lines 2 and 4")


def test_duplicate_sections_are_refused(tmp_path):
    path = tmp_path / "sections.yaml"
    path.write_text("optim:\n  lr: 0.1\ntrain:\n  seed: 1\noptim:\n  lr: 0.2\n")
    refused(["config", "show", str(path)], "duplicate key 'optim' on lines 1 and 5")


@pytest.mark.parametrize("override", ["run.output_dir=", "run.output_dir=' '"])
def test_an_empty_output_dir_is_refused(tmp_path, override):
    config = write_config(tmp_path / "config.yaml", tiny_config(tmp_path / "run"))
    refused(["config", "show", str(config), override], "run.output_dir: is empty")


def test_evaluation_every_n_steps_without_an_evaluation_dataset_is_refused(tmp_path):
    config = write_config(tmp_path / "config.yaml", tiny_config(tmp_path / "run"))
    refused(["train", str(config), "eval.every_steps=5"], "eval.every_steps=5", "eval.factory is null")
