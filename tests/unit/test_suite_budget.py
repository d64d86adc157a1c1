"""The suite's budget counts every Python process a test starts and names a file that starts too many."""

from __future__ import annotations

import ast
import multiprocessing.resource_tracker
import os
import subprocess
import sys
from pathlib import Path

from tests import suite_budget
from tests.distributed.conftest import POOL_WORLD_SIZE

TESTS = Path(__file__).resolve().parents[1]


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


def test_every_file_sharing_the_rank_pool_may_start_it():
    # Which of these files starts the session's pool (tests/distributed/conftest.py) depends on how the files fall
    # to the workers; multiprocessing's resource tracker is started with the session (suite_budget.configure).
    for path in _files_taking_the_ranks_fixture():
        assert suite_budget.LAUNCHES.get(path, suite_budget.DEFAULT_LAUNCHES) >= POOL_WORLD_SIZE, path


def test_the_resource_tracker_runs_before_any_file_is_charged():
    assert multiprocessing.resource_tracker._resource_tracker._check_alive()  # noqa: SLF001 - no public probe


def _files_taking_the_ranks_fixture() -> list[str]:
    files = []
    for path in sorted(TESTS.rglob("test_*.py")):
        functions = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)]
        if any(argument.arg == "ranks" for function in functions for argument in function.args.args):
            files.append(path.relative_to(TESTS.parent).as_posix())
    assert files, "no test takes the ranks fixture: the check below would pass on nothing"
    return files
