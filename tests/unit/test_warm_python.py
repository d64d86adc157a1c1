"""The warm interpreter's children (tests/warm_python.py) start as a fresh ``python -m MODULE`` (or ``-c``) would: the
suite's launches go through them, so a difference here would be one between the suite's runs and a user's."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys

import pytest

from tests import warm_python

PROBE = """
import json, os, signal, sys
print(json.dumps({
    "name": __name__,
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "value": os.environ.get("PROBE_VALUE"),
    "leaked": os.environ.get("PROBE_LEAK"),
    "files": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "handlers": [str(signal.getsignal(number)) for number in (signal.SIGTERM, signal.SIGCHLD)],
}))
print("on stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_child_has_its_own_arguments_directory_environment_files_and_handlers(tmp_path, monkeypatch):
    (tmp_path / "probe_module.py").write_text(PROBE)
    monkeypatch.setenv("PROBE_LEAK", "the test's own")  # in this process only: the child's env is given
    env = {name: value for name, value in os.environ.items() if name != "PROBE_LEAK"}
    done = warm_python.run(
        [sys.executable, "-m", "probe_module", "3", "more"],
        cwd=tmp_path,
        env={**env, "PROBE_VALUE": "given"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (3, "on stderr\n")
    seen = json.loads(done.stdout)
    assert seen["name"] == "__main__" and seen["argv"] == ["3", "more"]
    assert seen["cwd"] == seen["path0"] == str(tmp_path)  # its module found where `python -m` looks first
    assert (seen["value"], seen["leaked"]) == ("given", None)
    assert seen["files"] in ([0, 1, 2], [0, 1, 2, 3])  # 3: the directory listdir reads
    assert seen["handlers"] == [str(signal.SIG_DFL)] * 2


def test_a_passed_file_keeps_its_number_and_a_killed_child_reports_the_signal(tmp_path):
    (tmp_path / "sleeper.py").write_text("import os, sys, time\nos.write(int(sys.argv[1]), b'up')\ntime.sleep(600)\n")
    read_end, write_end = os.pipe()
    process = warm_python.WarmPopen(
        [sys.executable, "-m", "sleeper", str(write_end)], cwd=tmp_path, pass_fds=(write_end,)
    )
    os.close(write_end)
    assert os.read(read_end, 2) == b"up"
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.1)
    process.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL
    os.close(read_end)


def test_python_c_runs_its_code_as_main_with_the_directory_first_on_the_path(tmp_path):
    (tmp_path / "near.py").write_text("WHERE = 'the working directory'\n")
    code = PROBE.replace("import json,", "import near, json,").replace('"cwd":', '"near": near.WHERE, "cwd":')
    done = warm_python.run(
        [sys.executable, "-c", code, "4"],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (4, "on stderr\n")
    seen = json.loads(done.stdout)
    assert seen["name"] == "__main__" and seen["argv"] == ["4"]
    assert (seen["path0"], seen["near"]) == ("", "the working directory")  # as `python -c` has it


def test_only_python_m_and_c_commands_are_taken():
    with pytest.raises(ValueError, match="-m MODULE"):
        warm_python.WarmPopen(["echo", "hello"])


def test_a_running_process_dropped_in_a_reference_cycle_leaves_later_popens_working(tmp_path):
    """A failed test's traceback holds its processes in cycles: the collector then finalizes the process (which
    subprocess keeps, to poll later) and its connection (closed) together. Every later Popen polls it first."""
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    process = warm_python.WarmPopen([sys.executable, "-m", "sleeper"], cwd=tmp_path)
    pid = process.pid
    process.cycle = process
    del process
    gc.collect()
    try:
        assert subprocess.run(["true"]).returncode == 0
    finally:
        os.kill(pid, signal.SIGKILL)
