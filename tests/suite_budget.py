"""The suite's budget: how many Python processes each test file may start.

Most of the suite's time is processes starting (about 2 CPU-s each in torch's imports), so the budget is
counted in processes, not seconds: a count does not depend on how fast or how loaded the machine is, and a
feature that adds launches fails here, naming its file, before it slows every later run. Every Python
interpreter a test starts, however deep (the CLI, torchrun's agent, each worker, a fork server), counts itself
through ``tests/launch_counter/sitecustomize.py``, and so does a fork of the warm interpreter standing for one
(``tests/warm_python.py``); a worker forked from a fork server starts no interpreter
(``paratrain.launch.forked_workers``). A file over its budget fails the session, with the fix: share a
launch (``tests/harness.LayoutRuns``, ``train_many_in_one_launch``, ``tests/distributed/rank_pool``) or
raise its entry in ``LAUNCHES`` with the reason. The end of the session prints the slowest files.
"""

from __future__ import annotations

import collections
import multiprocessing.resource_tracker
import os
import resource
import tempfile
from pathlib import Path

import pytest

from tests import warm_python

COUNTER = Path(__file__).resolve().parent / "launch_counter"
LOG_ENV = "PARATRAIN_TEST_LAUNCH_LOG"
DIRECTORY_ENV = "PARATRAIN_TEST_LAUNCH_DIR"
# Kept by tests that run commands in a user's environment (PARATRAIN_* otherwise dropped): counting only.
COUNTER_VARIABLES = (LOG_ENV, DIRECTORY_ENV)
# A file left out of LAUNCHES may start this many processes (a CLI run or two).
DEFAULT_LAUNCHES = 4
# Python processes per file, as counted in a full `make test` (the session's last lines print them), with
# about a fifth to spare: restarts after a kill land a process or two either way.
LAUNCHES: dict[str, int] = {
    "tests/distributed/test_auto_layout.py": 6,
    "tests/distributed/test_layers.py": 6,
    "tests/integration/test_bad_input.py": 8,
    "tests/integration/test_cli.py": 17,
    "tests/integration/test_combination_matrix.py": 6,
    "tests/integration/test_disk_full.py": 7,
    "tests/integration/test_documented_commands.py": 56,
    "tests/integration/test_documented_commands_second_half.py": 63,
    "tests/integration/test_launch.py": 7,  # two launches of a probe of what a worker starts with
    "tests/integration/test_lm_resume.py": 8,
    "tests/integration/test_multinode.py": 32,
    "tests/integration/test_replica_groups.py": 95,
    "tests/integration/test_resume.py": 26,
    "tests/parity/test_context_parallel_matches_single.py": 12,
    "tests/parity/test_ddp_matches_single.py": 12,
    "tests/parity/test_dpo.py": 8,
    "tests/parity/test_expert_parallel_matches_single.py": 8,
    "tests/parity/test_hf_experts_match_single.py": 12,
    "tests/parity/test_hf_matches_single.py": 11,
    "tests/parity/test_lora.py": 11,
    "tests/parity/test_pipeline_matches_single.py": 14,
    "tests/parity/test_resume_matrix.py": 8,
    "tests/parity/test_sharded_matches_single.py": 15,
    "tests/parity/test_target_token_loss.py": 6,
    "tests/parity/test_tp_families_match_single.py": 6,
    "tests/slurm/test_real_slurm.py": 26,
    "tests/tools/test_plan.py": 6,
    "tests/unit/test_stuck_vote.py": 6,  # five ranks, each its own interpreter: the watch acts on its own process
    "tests/tools/test_verify.py": 8,
}


def configure(config: pytest.Config) -> None:
    """Called from tests/conftest.py's ``pytest_configure``."""
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers) sets up for all
        os.environ[DIRECTORY_ENV] = tempfile.mkdtemp(prefix="paratrain-launches-")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(COUNTER), os.environ.get("PYTHONPATH")]))
    # multiprocessing starts one tracker process per interpreter, on the first queue or lock of any test: started
    # here it is the session's, not charged to whichever file happens to run first on this worker.
    multiprocessing.resource_tracker.ensure_running()
    config.pluginmanager.register(SuiteBudget(), "paratrain-suite-budget")


class SuiteBudget:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.cpu_seconds: dict[str, float] = collections.defaultdict(float)
        self._cpu_at_setup = 0.0

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # Before any fixture: a module-scoped launch counts for the file that needs it.
        os.environ[LOG_ENV] = str(_log_of(item.nodeid.split("::")[0]))
        self._cpu_at_setup = _cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        # The teardown report carries the test's CPU to the controller (user_properties travel with it): CPU
        # far below the wall time is a test waiting (timeouts, sleeps), which more processes do not speed up.
        if call.when == "teardown":
            item.user_properties.append(("cpu_seconds", _cpu_seconds() - self._cpu_at_setup))
        yield

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::")[0]
        self.seconds[path] += report.duration
        if report.when == "teardown":
            self.cpu_seconds[path] += dict(report.user_properties).get("cpu_seconds", 0.0)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):
            return
        over = over_budget(launches_by_file())
        if over:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            session.config._paratrain_over_budget = over  # noqa: SLF001 - read back by the summary below

    def pytest_terminal_summary(self, terminalreporter, config: pytest.Config) -> None:
        if hasattr(config, "workerinput") or not self.seconds:
            return
        launches = launches_by_file()
        terminalreporter.section(
            "slowest files (seconds of setup, call and teardown; CPU-seconds of the test and what it started; "
            "Python processes started)"
        )
        for path, seconds in sorted(self.seconds.items(), key=lambda item: -item[1])[:15]:
            line = f"{seconds:8.1f} s {self.cpu_seconds[path]:8.1f} CPU-s {launches.get(path, 0):5d}  {path}"
            terminalreporter.write_line(line)
        total_cpu, total_launches = sum(self.cpu_seconds.values()), sum(launches.values())
        terminalreporter.write_line(
            f"{sum(self.seconds.values()):8.1f} s {total_cpu:8.1f} CPU-s {total_launches:5d}  in all"
        )
        for line in getattr(config, "_paratrain_over_budget", []):
            terminalreporter.write_line(line, red=True)


def _cpu_seconds() -> float:
    """User and system CPU of this process and of every process it started that has ended, the warm
    interpreter's forks included (tests/warm_python.py: its children, reaped there)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = warm_python.cpu_seconds_of_children
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + warm


def _log_of(path: str) -> Path:
    return Path(os.environ[DIRECTORY_ENV]) / (path.replace("/", "__") + ".log")


def launches_by_file() -> dict[str, int]:
    directory = Path(os.environ[DIRECTORY_ENV])
    return {log.stem.replace("__", "/"): len(log.read_text().splitlines()) for log in directory.glob("*.log")}


def over_budget(launches: dict[str, int]) -> list[str]:
    """One line per file that started more processes than its budget, naming the file and the fix."""
    return [
        f"suite budget: {path} started {count} Python processes, over its budget of "
        f"{LAUNCHES.get(path, DEFAULT_LAUNCHES)}: share a launch (tests/harness.LayoutRuns, "
        f"train_many_in_one_launch, tests/distributed/rank_pool) or raise its entry in tests/suite_budget.py"
        for path, count in sorted(launches.items())
        if count > LAUNCHES.get(path, DEFAULT_LAUNCHES)
    ]
