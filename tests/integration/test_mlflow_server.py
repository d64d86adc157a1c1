"""MLflow against the real ``mlflow server`` a user runs: paratrain's client (mlflow-skinny, in .venv)
logs to a server on loopback with a SQLite database, and the store paratrain writes when nothing is
set opens in the server, by the command the run's log prints.

The full server package is heavy, so ``make test`` builds it in its own environment, .venv-mlflow-server
(see the Makefile); these tests fail, naming ``make test``, when it is missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.harness import (
    REPO_ROOT,
    as_new_user,
    free_loopback_port,
    read_metrics,
    run_cli_in_process,
    tiny_config,
    write_config,
)

MLFLOW = REPO_ROOT / ".venv-mlflow-server" / "bin" / "mlflow"
START_TIMEOUT_S = 120  # the server imports pandas, scikit-learn and its web stack on two shared cores


@contextlib.contextmanager
def mlflow_server(arguments: list[str], log: Path) -> Iterator[str]:
    """Runs ``mlflow ARGUMENTS --host 127.0.0.1 --port P`` until the block ends; yields its URL."""
    if not MLFLOW.exists():
        pytest.fail(f"{MLFLOW} is missing: run `make test`, which builds the MLflow server's environment")
    port = free_loopback_port()
    command = [str(MLFLOW), *arguments, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    # Without its job runner (huey consumers for GenAI evaluation, which a training run never asks for),
    # the server starts faster; its own session lets the end of the test stop every process it started.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, server, log)
        yield url
    finally:
        stop_process_group(server)


def stop_process_group(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    with contextlib.suppress(ProcessLookupError):  # workers that outlived the server
        os.killpg(server.pid, signal.SIGKILL)


def wait_until_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    pytest.fail(f"mlflow server did not answer {url}/health within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def train_with_mlflow(tmp_path: Path) -> Path:
    output_dir = tmp_path / "run"
    config = tiny_config(output_dir, train={"max_steps": 3}, log={"every_steps": 1, "trackers": ["jsonl", "mlflow"]})
    config["run"]["name"] = "served"
    code, stderr = run_cli_in_process(["train", str(write_config(tmp_path / "c.yaml", config))])
    assert code == 0, stderr
    return output_dir


def assert_run_reads_back(url: str, output_dir: Path) -> None:
    """The run, read through the server: its status, params and every loss metrics.jsonl holds."""
    client = MlflowClient(tracking_uri=url)
    (run,) = client.search_runs([client.get_experiment_by_name("paratrain").experiment_id])
    assert (run.info.run_name, run.info.status) == ("served", "FINISHED")
    assert run.data.params["train.max_steps"] == "3" and run.data.tags["output_dir"] == str(output_dir)
    logged = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, "loss")}
    assert logged == pytest.approx({record["step"]: record["loss"] for record in read_metrics(output_dir)})
    assert sorted(logged) == [1, 2, 3]


def test_a_run_logs_to_a_real_mlflow_server_with_a_sqlite_database(tmp_path, monkeypatch):
    as_new_user(monkeypatch, tmp_path / "home")
    database = tmp_path / "server" / "mlflow.db"
    database.parent.mkdir()
    server = ["server", "--backend-store-uri", f"sqlite:///{database}"]
    with mlflow_server(server, tmp_path / "server.log") as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        output_dir = train_with_mlflow(tmp_path)
        assert_run_reads_back(url, output_dir)
    assert database.stat().st_size > 0 and not (output_dir / "mlflow.db").exists()


def test_the_default_store_opens_in_mlflow_ui_by_the_command_the_log_prints(tmp_path, monkeypatch, caplog):
    as_new_user(monkeypatch, tmp_path / "home")
    caplog.set_level(logging.INFO, logger="paratrain")
    output_dir = train_with_mlflow(tmp_path)
    (printed,) = re.findall(r"`(mlflow ui --backend-store-uri \S+)`", caplog.text)
    with mlflow_server(shlex.split(printed)[1:], tmp_path / "ui.log") as url:
        assert_run_reads_back(url, output_dir)
