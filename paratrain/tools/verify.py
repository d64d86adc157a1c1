"""``paratrain verify``: does a layout train like one process? The parity tests' oracle, for any config.

The config's layout and a single-process reference train for the same few steps on the same seed and
global batch, each through the real ``paratrain train`` into its own directory
(``OUTPUT_DIR/verify/layout`` and ``OUTPUT_DIR/verify/reference``, replaced on every verify), logging
every step. The verdict compares their losses step by step against ``LOSS_RTOL``, the tolerance the
parity tests hold every layout to.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config.loading import load_config
from paratrain.config.schema import Config
from paratrain.errors import EXIT_USER_ERROR, ConfigError
from paratrain.parallel.dims import runs_in_one_process

LOSS_RTOL = 1e-5
MAX_PROCESSES_PER_CPU = 4  # beyond this a CPU check crawls and gloo's collectives risk their timeout
_REDUCE_HINT = (
    "to check a layout larger than this machine, scale it down: fewer processes with smaller parallel "
    "degrees, and a smaller model through overrides (e.g. model.args.n_layer=2); see docs/planner.md, "
    "'Checking a layout against one process: paratrain verify'"
)
# Every step logged, nothing saved: verify compares losses and leaves no checkpoints behind.
_RUN_OVERRIDES = [
    "log.every_steps=1",
    "log.tensorboard=false",
    "checkpoint.every_steps=0",
    "checkpoint.save_final=false",
    "checkpoint.resume=never",
]
_SINGLE_OVERRIDES = [
    "parallel.strategy=single",
    "parallel.dp_replicate=null",
    "parallel.dp_shard=null",
    "parallel.tp=null",
    "parallel.pp=null",
]


@dataclass(frozen=True)
class StepLoss:
    step: int
    layout: float
    reference: float

    @property
    def relative_difference(self) -> float:
        return abs(self.layout - self.reference) / abs(self.reference) if self.reference else abs(self.layout)


@dataclass(frozen=True)
class Verdict:
    """The comparison; ``passed`` when both runs logged the same steps, each within ``tolerance``."""

    layout: str
    steps: list[StepLoss]
    tolerance: float
    missing_steps: list[int]

    @property
    def max_relative_difference(self) -> float:
        return max((s.relative_difference for s in self.steps), default=float("inf"))

    @property
    def passed(self) -> bool:
        return bool(self.steps) and not self.missing_steps and self.max_relative_difference <= self.tolerance


def default_nproc(config: Config) -> int:
    return 1 if runs_in_one_process(config.parallel) else 2


def verify(config_path: str, overrides: list[str], *, nproc_per_node: int | None, steps: int) -> int:
    """Runs both, prints the per-step table and the verdict; returns the exit code (0 pass, 1 mismatch)."""
    config = load_config(config_path, overrides)
    nproc = nproc_per_node or default_nproc(config)
    root = config.run.output_dir / "verify"
    layout_overrides = [*overrides, *_RUN_OVERRIDES, f"train.max_steps={steps}", f"run.output_dir={root / 'layout'}"]
    reference_overrides = [*layout_overrides, *_SINGLE_OVERRIDES, f"run.output_dir={root / 'reference'}"]
    layout = f"{config.parallel.strategy or 'parallel degrees'} on {nproc} process{'es' if nproc > 1 else ''}"
    check_machine_can_run(config, nproc_per_node=nproc, steps=steps)
    for directory in (root / "layout", root / "reference"):
        shutil.rmtree(directory, ignore_errors=True)
    _preflight(load_config(config_path, layout_overrides), nproc, part=f"the layout ({layout})")
    _preflight(load_config(config_path, reference_overrides), 1, part="the single-process reference")

    for name, run_overrides, processes in (("layout", layout_overrides, nproc), ("reference", reference_overrides, 1)):
        print(
            f"verify: training the {name} ({layout if name == 'layout' else 'single, 1 process'}) for {steps} steps "
            f"into {root / name}",
            flush=True,
        )
        code = _train(config_path, run_overrides, processes)
        if code != 0:
            print(
                f"paratrain: error: verify: the {name} run failed (exit code {code}); its output is above",
                file=sys.stderr,
            )
            return code if code == EXIT_USER_ERROR else 1
    verdict = compare(layout, _losses(root / "layout"), _losses(root / "reference"), tolerance=LOSS_RTOL)
    print(format_verdict(verdict))
    return 0 if verdict.passed else 1


def check_machine_can_run(config: Config, *, nproc_per_node: int, steps: int) -> None:
    """Raises ConfigError naming the part of the layout this machine cannot run, and a smaller one to try."""
    if steps < 1:
        raise ConfigError(f"--steps {steps}: verify needs at least 1 step; e.g. --steps 20")
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {nproc_per_node}: needs at least 1 process")
    if config.optim.lr_scaling != "none":
        raise ConfigError(
            f"optim.lr_scaling={config.optim.lr_scaling} scales the learning rate by the data-parallel size, "
            f"so no layout can match one process; verify with optim.lr_scaling=none"
        )

    gpus = torch.cuda.device_count()
    device = config.train.device
    if device == "cuda" or (device == "auto" and gpus):
        if gpus == 0:
            raise ConfigError(
                "train.device=cuda but this machine has no GPU: verify the layout on CPU with train.device=cpu "
                f"(gloo), at a smaller world size if it needs more processes than CPU cores; {_REDUCE_HINT}"
            )
        if nproc_per_node > gpus:
            raise ConfigError(
                f"--nproc-per-node {nproc_per_node} with train.device={device} needs {nproc_per_node} GPUs, "
                f"this machine has {gpus}: verify at world size {gpus} or less (--nproc-per-node {gpus}), "
                f"or on CPU with train.device=cpu; {_REDUCE_HINT}"
            )
        return
    limit = MAX_PROCESSES_PER_CPU * (os.cpu_count() or 1)
    if nproc_per_node > limit:
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node} on CPU: this machine has {os.cpu_count()} cores, and verify "
            f"runs at most {MAX_PROCESSES_PER_CPU} processes per core ({limit}); verify at a smaller world "
            f"size, e.g. --nproc-per-node {min(limit, 4)}; {_REDUCE_HINT}"
        )


def _preflight(config: Config, nproc: int, *, part: str) -> None:
    from paratrain.checks.preflight import preflight  # lazy: loads torch.distributed

    try:
        preflight(config, world_size=nproc, nproc_per_node=nproc)
    except ConfigError as error:
        raise ConfigError(f"verify: {part} cannot run here:\n{error}\n({_REDUCE_HINT})") from None


def _train(config_path: str, overrides: list[str], nproc: int) -> int:
    """The real ``paratrain train``, in a fresh interpreter so the two runs share no process state."""
    argv = [sys.executable, "-m", "paratrain.cli", "train", config_path, *overrides, "--nproc-per-node", str(nproc)]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-4000:])
    return result.returncode


def _losses(output_dir: Path) -> dict[int, float]:

    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def compare(layout: str, losses: dict[int, float], reference: dict[int, float], *, tolerance: float) -> Verdict:
    steps = [StepLoss(step, losses[step], reference[step]) for step in sorted(losses.keys() & reference.keys())]
    return Verdict(layout, steps, tolerance, sorted(losses.keys() ^ reference.keys()))


def format_verdict(verdict: Verdict) -> str:
    lines = [f"{'step':>6}  {'layout loss':>14}  {'reference loss':>14}  {'relative diff':>13}"]
    for s in verdict.steps:
        flag = "" if s.relative_difference <= verdict.tolerance else "  <- over tolerance"
        lines.append(f"{s.step:>6}  {s.layout:>14.8f}  {s.reference:>14.8f}  {s.relative_difference:>13.2e}{flag}")
    if verdict.missing_steps:
        lines.append(f"steps logged by only one run: {verdict.missing_steps}")
    worst = verdict.max_relative_difference
    if verdict.passed:
        lines.append(
            f"PASS: {verdict.layout} matches one process: every step's loss within {verdict.tolerance:g} "
            f"relative (largest {worst:.2e})"
        )
    else:
        first = next((s.step for s in verdict.steps if s.relative_difference > verdict.tolerance), None)
        where = f", first at step {first}" if first is not None else ""
        lines.append(
            f"FAIL: {verdict.layout} does not match one process: largest relative loss difference {worst:.2e} "
            f"> tolerance {verdict.tolerance:g}{where}"
        )
    return "\n".join(lines)
