"""The in-house harness: run the real ``paratrain`` CLI on tiny configs and read back what it wrote.

Commands are argv lists, never shell strings. Multi-process runs go through the CLI's own torchrun
launch, on CPU with gloo.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from paratrain.checkpoint.tensor_reader import TensorReader
from tests import warm_python

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY_GPT = {
    "factory": "paratrain.models.gpt:build_gpt",
    "args": {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32},
}
TINY_TEXT = {"factory": "paratrain.data.text:build_char_dataset", "args": {"block_size": 16, "max_chars": 40_000}}


def tiny_config(output_dir: Path, **sections: Any) -> dict[str, Any]:
    """A config that trains in well under a second per step on one CPU core."""
    config: dict[str, Any] = {
        "run": {"name": "test", "output_dir": str(output_dir)},
        "train": {"max_steps": 20, "global_batch_size": 8, "micro_batch_size": 2, "seed": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "log": {"every_steps": 1},
        "checkpoint": {"every_steps": 0},
        "model": TINY_GPT,
        "data": TINY_TEXT,
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def restartable_loopback_port() -> int:
    """A free loopback port below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), for a
    server a test kills and starts again there. The kernel hands a port of that range to any connection or
    port-0 listener, so a port from ``free_loopback_port`` can be taken while its server is down (another
    test's listener took a killed lighthouse's, and the new one failed: address in use); none below it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(low // 2, low), 100):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {low // 2}-{low - 1}")


def start_cli(
    args: list[str], *, env: dict[str, str] | None = None, output: Path | None = None, unset: tuple[str, ...] = ()
) -> subprocess.Popen:
    """Starts ``python -m paratrain.cli ARGS`` without waiting (e.g. one process per node).

    Args:
        output: A file for stdout and stderr together, for a process that runs beside others for long: an
            unread pipe fills (64 KiB) and blocks the process's next write, stalling whatever waits on it.
            None: pipes, read by ``communicate()``.
        unset: Variables left out of its environment, as a user who never set them (e.g. OMP_NUM_THREADS).
            The run then starts in a fresh interpreter, as the user's does; otherwise in a fork of the warm
            one (tests/warm_python.py).
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env = {name: value for name, value in full_env.items() if name not in unset}
    with contextlib.ExitStack() as files:
        stream = files.enter_context(output.open("w")) if output is not None else subprocess.PIPE
        return (subprocess.Popen if unset else warm_python.WarmPopen)(
            [sys.executable, "-m", "paratrain.cli", *args],
            stdout=stream,
            stderr=subprocess.STDOUT if output is not None else subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=REPO_ROOT,
        )


def wait_for_first_step(output_dir: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    """Returns once the run started by start_cli has logged a step to output_dir/metrics.jsonl."""
    metrics, deadline = output_dir / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert process.poll() is None, f"run ended early: {process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.05)


def child_pids(pid: int) -> list[int]:
    """The processes started by process pid (from any of its threads)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()]


def worker_pids(launcher: int) -> list[int]:
    """torchrun's workers under paratrain's launcher: its children, or its fork server's where the workers
    are forked (paratrain.launch.forked_workers; the launcher's other child is multiprocessing's tracker)."""
    from paratrain.launch.forked_workers import forks_workers

    children = child_pids(launcher)
    return [worker for child in children for worker in child_pids(child)] if forks_workers() else children


def run_cli(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Runs ``python -m paratrain.cli ARGS`` (in a fork of the warm interpreter, tests/warm_python.py) and
    returns it finished, output captured."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return warm_python.run(
        [sys.executable, "-m", "paratrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or REPO_ROOT,
    )


def run_cli_in_process(args: list[str]) -> tuple[int, str]:
    """``paratrain ARGS`` as ``cli.main`` in this process: (exit code, stderr). For commands that stop
    before training, such as bad input, it saves the interpreter's start-up (most of their time)."""
    from paratrain.cli import main

    stderr, saved_path = io.StringIO(), list(sys.path)
    try:
        with contextlib.redirect_stderr(stderr):
            code = main(args)
    except SystemExit as stopped:  # argparse's usage errors
        code = stopped.code
    finally:
        sys.path[:] = saved_path  # main puts the working directory first, as `python -m` does
    return code, stderr.getvalue()


def train_in_this_process(config: Any) -> Any:
    """``paratrain.train.run(config)`` in the test process; what the run imported (dynamo for compile, a
    model's modules) then leaves the garbage collector's reach, so later runs' collections skip it."""
    from paratrain.train import run  # lazy: most tests of the harness train in launched processes

    result = run(config)
    gc.freeze()
    return result


def train(
    config_path: Path, *extra: str, nproc: int = 1, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    args = ["train", str(config_path), *extra]
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc)]
    result = run_cli(args, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"paratrain train failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def launch_workers(
    nproc: int,
    module: str,
    *args: str,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.CompletedProcess:
    """Runs ``python -m MODULE ARGS`` on nproc processes through paratrain's launcher, whose stores
    listen on loopback only (see tests/launch_workers.py), and returns it finished. ``env`` replaces the
    environment (this one with ``OMP_NUM_THREADS=1`` otherwise) and starts a fresh interpreter, as a user's
    would (a fork of the warm one otherwise, tests/warm_python.py); the launcher inherits ``pass_fds``."""
    return (subprocess.run if env is not None else warm_python.run)(
        [sys.executable, "-m", "tests.launch_workers", str(nproc), module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env,
        pass_fds=pass_fds,
    )


def train_many_in_one_launch(
    runs: list[tuple[Path, list[str]]], nproc: int, runs_file: Path, timeout: float = 600
) -> None:
    """Trains each (config, overrides) one after the other in one launch of nproc processes
    (tests/train_many.py): the processes start once for all of them."""
    runs_file.write_text(json.dumps([[str(config), overrides] for config, overrides in runs]))
    result = launch_workers(nproc, "tests.train_many", str(runs_file), timeout=timeout)
    assert result.returncode == 0, f"{nproc}-process launch failed:\n{result.stderr[-4000:]}"


def in_private_network(command: list[str]) -> list[str]:
    """command, run in a new network namespace that holds only loopback: a server that listens on every
    interface (plain torchrun's stores, pytorch#173909) can then be reached from nowhere else."""
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]


def private_network_unavailable() -> str | None:
    """Why in_private_network cannot run here (not root, no unshare or ip), or None when it can."""
    probe = (
        subprocess.run(in_private_network(["true"]), capture_output=True, text=True)
        if shutil.which("unshare")
        else None
    )
    if probe is None or probe.returncode != 0:
        return "needs `unshare --net` and `ip` (root) to keep torchrun's stores off every interface but loopback"
    return None


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses_by_step(output_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in read_metrics(output_dir)}


def checkpoint_weights(checkpoint_dir: Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The full tensors of a checkpoint under prefix ("model." for weights, "optimizer.state." for
    AdamW's moments), by name."""
    with TensorReader(checkpoint_dir, verify=False) as reader:
        return {key.removeprefix(prefix): tensor for key, tensor in reader.read(reader.tensors(prefix))}


def max_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), f"different steps logged: {sorted(a)} vs {sorted(b)}"
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


def assert_matches_single_process(
    reference: Path, laid_out: Path, *, steps: int, loss_rtol: float = 1e-5
) -> dict[str, torch.Tensor]:
    """A layout's run against one process's on the same seed and batch: every step's loss within loss_rtol
    (relative), and the step-1 gradients (``debug.dump_gradients_at_steps: [1]``) tensor by tensor.
    Returns the reference's gradients, by name, for checks of which tensors there are."""
    losses = losses_by_step(laid_out)
    assert len(losses) == steps
    assert max_relative_difference(losses, losses_by_step(reference)) <= loss_rtol
    expected = load_file(str(reference / "gradients/step-1.safetensors"))
    actual = load_file(str(laid_out / "gradients/step-1.safetensors"))
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)
    return expected


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


class LayoutRuns:
    """Trains each named layout at most once per test module, on demand, on the same tiny config.

    Args:
        layouts: name -> (overrides, processes). ``{run:NAME}`` in an override stands for the output
            directory of layout NAME, e.g. to resume from its checkpoint.
        together: layouts trained in one launch per process count, all of them on the first request
            for any: start-up is most of a tiny run's time (see tests/train_many.py). Launches go from
            the most processes to the fewest and keep the listed order within one, so a layout may
            resume from one listed before it, or from one with more processes.
        sections: config sections every run shares (see tiny_config).
    """

    def __init__(
        self, root: Path, layouts: dict[str, tuple[list[str], int]], *, together: tuple[str, ...] = (), **sections: Any
    ):
        self.root, self.layouts, self.together, self.sections = root, layouts, together, sections
        self.done: dict[str, Path] = {}

    def get(self, layout: str, *extra: str, name: str | None = None) -> Path:
        """The output_dir of ``layout`` trained with ``extra`` overrides (cached under ``name``)."""
        name = name or layout
        if name not in self.done:
            if name == layout and layout in self.together:
                self._train_together()
            else:
                config_path, output_dir = self._write_config(name)
                train(config_path, *self._overrides(layout), *extra, nproc=self.layouts[layout][1])
                self.done[name] = output_dir
        return self.done[name]

    def _train_together(self) -> None:
        for nproc in sorted({self.layouts[name][1] for name in self.together}, reverse=True):
            self._train_in_one_launch([name for name in self.together if self.layouts[name][1] == nproc])

    def _train_in_one_launch(self, names: list[str]) -> None:
        names = [name for name in names if name not in self.done]
        if not names:
            return
        runs, output_dirs, nproc = [], {}, self.layouts[names[0]][1]
        for name in names:
            config_path, output_dirs[name] = self._write_config(name)
            runs.append([str(config_path), self._overrides(name)])
        runs_file = self.root / f"together-{nproc}-{len(self.done)}.json"
        runs_file.write_text(json.dumps(runs))
        result = launch_workers(nproc, "tests.train_many", str(runs_file), timeout=600)
        assert result.returncode == 0, (
            f"training {names} together failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
        self.done.update(output_dirs)

    def _overrides(self, layout: str) -> list[str]:
        return [
            re.sub(r"\{run:([^}]+)\}", lambda match: str(self._output_dir(match[1])), override)
            for override in self.layouts[layout][0]
        ]

    def _output_dir(self, name: str) -> Path:
        return self.root / name.replace(" ", "_").replace("+", "_")

    def _write_config(self, name: str) -> tuple[Path, Path]:
        output_dir = self._output_dir(name)
        config = tiny_config(output_dir, **self.sections)
        return write_config(self.root / f"{output_dir.name}.yaml", config), output_dir


# What a user who has set nothing up lacks: the trackers' variables, and anything in their own HOME.
TRACKER_VARIABLES = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_ALLOW_FILE_STORE",
    "MLFLOW_EXPERIMENT_NAME",
    "WANDB_MODE",
    "WANDB_API_KEY",
    "WANDB_BASE_URL",
    "WANDB_CONFIG_DIR",
    "NETRC",
)


def as_new_user(monkeypatch, home: Path) -> None:
    """The environment of a first try: no tracker variables, and an empty HOME (no ~/.netrc from
    `wandb login`, no W&B settings), whatever this machine's own user has set up."""
    for name in TRACKER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
