"""Experiment trackers rank 0 reports to, chosen by name in ``log.trackers``.

Each tracker receives the resolved config as hyperparameters once, every metrics record, and is
closed with how the run ended. wandb and mlflow are optional extras, imported only when named;
their own environment variables choose where the run goes (``WANDB_MODE``/``WANDB_PROJECT``,
``MLFLOW_TRACKING_URI``/``MLFLOW_EXPERIMENT_NAME``), so a cluster's existing set-up applies as is.
With ``MLFLOW_TRACKING_URI`` unset, MLflow logs to a SQLite store in the run's output_dir
(``mlflow_tracking_uri``); readiness.py checks before launch that each named tracker can open.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from paratrain.config.loading import flatten_dotted
from paratrain.errors import ConfigError

Outcome = Literal["success", "failed", "preempted"]

logger = logging.getLogger("paratrain")

# Name -> (module to import, install command). "jsonl" and "tensorboard" ship with paratrain's core deps.
TRACKER_PACKAGES = {
    "jsonl": (None, None),
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'paratrain[wandb]'"),
    "mlflow": ("mlflow", "pip install 'paratrain[mlflow]'"),
}


@dataclass(frozen=True)
class RunInfo:
    """What every tracker records about the run besides its metrics."""

    name: str
    output_dir: Path
    hparams: dict[str, Any]


class Tracker(Protocol):
    def log(self, metrics: dict[str, Any]) -> None: ...

    def close(self, outcome: Outcome) -> None: ...


def check_trackers_installed(names: list[str]) -> None:
    """Raises ConfigError naming the install command for each named tracker whose package is missing,
    so the run stops before any process starts rather than at the first log step."""
    missing = [name for name in names if _package_missing(name)]
    if missing:
        fixes = "; ".join(
            f"log.trackers names {name!r} but its package is not installed: {TRACKER_PACKAGES[name][1]}"
            for name in missing
        )
        raise ConfigError(f"{fixes} (or remove it from log.trackers)")


def build_trackers(names: list[str], run: RunInfo) -> list[Tracker]:
    """Opens each named tracker, in the order given; if one fails to open, those already open are closed
    as failed, so no W&B or MLflow run is left marked running."""
    builders = {
        "jsonl": JsonlTracker,
        "tensorboard": TensorBoardTracker,
        "wandb": WandbTracker,
        "mlflow": MlflowTracker,
    }
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(builders[name](run))
    except BaseException:
        for tracker in opened:
            tracker.close("failed")
        raise
    return opened


def _package_missing(name: str) -> bool:
    module = TRACKER_PACKAGES[name][0]
    return module is not None and importlib.util.find_spec(module) is None


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    # bool is an int to Python but not a metric to a tracker; "step" is the x axis, not a series.
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step"
    }


class JsonlTracker:
    """One JSON object per logged step in output_dir/metrics.jsonl, read by ``paratrain report``."""

    def __init__(self, run: RunInfo):
        self._file = open(run.output_dir / "metrics.jsonl", "a", buffering=1)

    def log(self, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps(metrics, allow_nan=False) + "\n")

    def close(self, outcome: Outcome) -> None:
        self._file.close()


class TensorBoardTracker:
    """Event files in output_dir/tensorboard/, scalars under train/, the config as hparams text."""

    def __init__(self, run: RunInfo):
        # Lazy: a heavy import (start-up time) that only this path needs.
        from torch.utils.tensorboard import SummaryWriter  # imported only when named: it loads TensorBoard

        self._writer = SummaryWriter(log_dir=str(run.output_dir / "tensorboard"))
        self._writer.add_text("config", "```\n" + json.dumps(run.hparams, indent=2, default=str) + "\n```")

    def log(self, metrics: dict[str, Any]) -> None:
        for name, value in _scalars(metrics).items():
            self._writer.add_scalar(f"train/{name}", value, metrics["step"])

    def close(self, outcome: Outcome) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run named after run.name, its files under output_dir/wandb/; WANDB_MODE=offline keeps it local."""

    def __init__(self, run: RunInfo):
        # Lazy: an optional dependency, imported only where it is used.
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "paratrain"),
            name=run.name,
            dir=str(run.output_dir),
            config={**run.hparams, "output_dir": str(run.output_dir)},
            reinit="create_new",
        )

    def log(self, metrics: dict[str, Any]) -> None:
        self._run.log(_scalars(metrics), step=metrics["step"])

    def close(self, outcome: Outcome) -> None:
        # A preempted run is requeued and resumes: W&B marks it not successful, which is what it is so far.
        self._run.finish(exit_code=0 if outcome == "success" else 1)


def mlflow_tracking_uri(output_dir: Path) -> str:
    """MLFLOW_TRACKING_URI when set; otherwise a SQLite store in output_dir.

    MLflow 3's own default, ``sqlite:///mlflow.db`` in the working directory, is refused by mlflow-skinny
    without sqlalchemy, and its file store refuses to start unless MLFLOW_ALLOW_FILE_STORE=true. A store
    per output_dir is writable wherever the run is (preflight checked), keeps the run's files together,
    and is never written by two runs at once (SQLite would answer "database is locked").
    """
    explicit = os.environ.get("MLFLOW_TRACKING_URI")
    if explicit:
        return explicit
    # Spelled as MLflow's own path_to_local_sqlite_uri does: sqlite:/// and the absolute path.
    return "sqlite:///" + urllib.request.pathname2url(str((output_dir / "mlflow.db").resolve()))


class MlflowTracker:
    """An MLflow run named after run.name with the flattened config as params and output_dir as a tag."""

    def __init__(self, run: RunInfo):
        # Lazy: an optional dependency, imported only where it is used.
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = mlflow_tracking_uri(run.output_dir)
        default_store = not os.environ.get("MLFLOW_TRACKING_URI")
        if default_store:
            logger.info(
                "mlflow: MLFLOW_TRACKING_URI is unset, so this run logs to %s; see it with "
                "`mlflow ui --backend-store-uri %s` (pip install mlflow), or set MLFLOW_TRACKING_URI to your server",
                uri,
                uri,
            )
        self._client = MlflowClient(tracking_uri=uri)
        # The default store keeps its (so far unused) artifact root beside it, not in the working directory.
        artifacts = (run.output_dir / "mlflow-artifacts").resolve().as_uri() if default_store else None
        experiment_id = self._experiment_id(
            os.environ.get("MLFLOW_EXPERIMENT_NAME", "paratrain"), artifact_location=artifacts
        )
        tags = {"mlflow.runName": run.name, "output_dir": str(run.output_dir)}
        self._run_id = self._client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
        params = flatten_dotted(run.hparams)  # MLflow takes flat key/value parameters
        # MLflow caps a param value at 6000 characters and a batch at 100 params.
        items = [(key, str(value)[:6000]) for key, value in params.items()]
        for start in range(0, len(items), 100):
            self._client.log_batch(self._run_id, params=[Param(k, v) for k, v in items[start : start + 100]])

    def _experiment_id(self, name: str, *, artifact_location: str | None) -> str:
        experiment = self._client.get_experiment_by_name(name)
        if experiment:
            return experiment.experiment_id
        return self._client.create_experiment(name, artifact_location=artifact_location)

    def log(self, metrics: dict[str, Any]) -> None:
        # Lazy: an optional dependency, imported only where it is used.
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        batch = [Metric(name, value, timestamp, metrics["step"]) for name, value in _scalars(metrics).items()]
        self._client.log_batch(self._run_id, metrics=batch)

    def close(self, outcome: Outcome) -> None:
        # KILLED is MLflow's word for a run stopped from outside, which a preemption is.
        status = {"success": "FINISHED", "failed": "FAILED", "preempted": "KILLED"}[outcome]
        self._client.set_terminated(self._run_id, status=status)
