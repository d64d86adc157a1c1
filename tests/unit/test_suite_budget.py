"""The suite's budget counts every Python process a test starts and names a file that starts too many."""

from __future__ import annotations

import os
import subprocess
import sys

from tests import suite_budget


def test_every_python_process_started_counts_itself_in_the_running_files_log(tmp_path):
    log = tmp_path / "file.log"
    env = {**os.environ, "PYTHONPATH": str(suite_budget.COUNTER), suite_budget.LOG_ENV: str(log)}
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)  # a process that starts another
    assert len(log.read_text().splitlines()) == 2


def test_a_file_over_its_budget_is_named_with_the_fix_and_one_within_is_not(monkeypatch):
    monkeypatch.setattr(suite_budget, "LAUNCHES", {"tests/a.py": 10})
    lines = suite_budget.over_budget({"tests/a.py": 10, "tests/b.py": suite_budget.DEFAULT_LAUNCHES + 1})
    assert len(lines) == 1
    assert "tests/b.py started 5 Python processes" in lines[0] and "share a launch" in lines[0]
