"""log.trackers with the real packages in their local modes: W&B offline (its .wandb transaction log
read back record by record), MLflow on a file store (read back with MlflowClient), TensorBoard event
files (read with TensorBoard's own EventAccumulator), all against metrics.jsonl. Then a new user's
first try, with none of the trackers' variables set: MLflow's default store, W&B without a login."""

from __future__ import annotations

import importlib.util
import logging
import signal
import struct
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from paratrain.callbacks import Callback
from paratrain.errors import EXIT_REQUEUE, EXIT_USER_ERROR, ConfigError
from paratrain.tracking import trackers
from paratrain.tracking.metrics import MetricsLogger
from paratrain.tracking.readiness import check_trackers_ready
from paratrain.tracking.trackers import RunInfo
from tests.harness import as_new_user, free_loopback_port, read_metrics, run_cli_in_process, tiny_config, write_config

ALL = ["jsonl", "tensorboard", "wandb", "mlflow"]

MLFLOW_MAJOR = int(version("mlflow-skinny").split(".")[0])


@pytest.fixture
def local_trackers(tmp_path, monkeypatch) -> str:
    """Both packages pointed at tmp_path; returns the MLflow tracking URI."""
    uri = f"file://{tmp_path}/mlruns"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # MLflow 3 refuses the file store unless asked; it is the store that needs no server or database.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def wandb_records(output_dir: Path) -> list:
    """The records of the one finished offline run under output_dir/wandb, its exit record included.
    wandb-core answers finish() before its writer has always flushed the exit record to the file (a CI
    run read the file without it), so this reads again until the exit record is there (bounded)."""
    deadline = time.monotonic() + 60
    while True:
        records = read_wandb_log(output_dir)
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            return records
        assert time.monotonic() < deadline, "the W&B run's exit record never reached its .wandb file"
        time.sleep(0.1)


def read_wandb_log(output_dir: Path) -> list:
    """The records in the one offline run's .wandb file so far: a LevelDB log (32 KiB blocks of CRC,
    length, type-framed chunks) of wandb_internal_pb2.Record. wandb 0.31 ships no Python reader for it
    any more, so the framing is read here."""
    (path,) = output_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", "not a W&B transaction log"
    position, records, pending = 7, [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 or position + 7 + length > len(data):  # padding, or a chunk still being written
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def mlflow_run(uri: str, name: str):
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("paratrain").experiment_id])
    assert run.info.run_name == name
    return client, run


def test_every_tracker_gets_the_config_each_metrics_record_and_the_run_name(tmp_path, local_trackers):
    output_dir = tmp_path / "run"
    config = tiny_config(output_dir, train={"max_steps": 3}, log={"every_steps": 1, "trackers": ALL})
    config["run"]["name"] = "tracked"
    code, stderr = run_cli_in_process(["train", str(write_config(tmp_path / "c.yaml", config))])
    assert code == 0, stderr
    losses = {record["step"]: record["loss"] for record in read_metrics(output_dir)}
    assert sorted(losses) == [1, 2, 3]

    records = wandb_records(output_dir)
    (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project) == ("tracked", "paratrain")
    wandb_config = {item.key: yaml.safe_load(item.value_json) for item in run.config.update}
    assert wandb_config["train"]["max_steps"] == 3
    assert wandb_config["output_dir"] == str(output_dir)
    history = [
        {(item.key or "/".join(item.nested_key)): float(item.value_json) for item in record.history.item}
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]
    assert {int(row["_step"]): row["loss"] for row in history} == pytest.approx(losses)
    assert [record.exit.exit_code for record in records if record.WhichOneof("record_type") == "exit"] == [0]

    client, mlrun = mlflow_run(local_trackers, "tracked")
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["train.max_steps"] == "3" and mlrun.data.params["model.args.n_layer"] == "2"
    assert mlrun.data.tags["output_dir"] == str(output_dir)
    logged = {metric.step: metric.value for metric in client.get_metric_history(mlrun.info.run_id, "loss")}
    assert logged == pytest.approx(losses)

    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    assert {event.step: event.value for event in events.Scalars("train/loss")} == pytest.approx(losses)


class StopAfterTwoSteps(Callback):
    """A callback that preempts its own run, as Slurm's USR1 would, after step 2."""

    def on_step_end(self, context) -> None:
        if context.step == 2:
            signal.raise_signal(signal.SIGUSR1)


def test_a_preempted_run_is_closed_as_killed_in_mlflow(tmp_path, local_trackers):
    output_dir = tmp_path / "run"
    callbacks = [{"factory": f"{__name__}:StopAfterTwoSteps"}]
    config = tiny_config(output_dir, train={"max_steps": 5}, log={"trackers": ["jsonl", "mlflow"]})
    config["callbacks"] = callbacks
    code, stderr = run_cli_in_process(["train", str(write_config(tmp_path / "c.yaml", config))])
    assert code == EXIT_REQUEUE, stderr
    client, mlrun = mlflow_run(local_trackers, "test")
    assert mlrun.info.status == "KILLED"
    logged = {metric.step: metric.value for metric in client.get_metric_history(mlrun.info.run_id, "loss")}
    assert logged == pytest.approx({record["step"]: record["loss"] for record in read_metrics(output_dir)})
    assert max(logged) < 5  # stopped early, every step it logged reached MLflow


def test_a_failed_run_is_closed_as_failed_in_wandb_and_mlflow(tmp_path, local_trackers):
    run = RunInfo(name="broken", output_dir=tmp_path, hparams={"train": {"max_steps": 1}})
    logger = MetricsLogger(run, trackers=["wandb", "mlflow"], progress_bar="off", start_step=0, max_steps=1)
    logger.close("failed")
    exits = [record.exit.exit_code for record in wandb_records(tmp_path) if record.WhichOneof("record_type") == "exit"]
    assert exits == [1]
    assert mlflow_run(local_trackers, "broken")[1].info.status == "FAILED"


def test_unknown_tracker_is_refused_before_training(tmp_path):
    config = tiny_config(tmp_path / "run", log={"trackers": ["jsonl", "neptune"]})
    code, stderr = run_cli_in_process(["train", str(write_config(tmp_path / "c.yaml", config))])
    assert code == EXIT_USER_ERROR
    assert "log.trackers" in stderr and "neptune" in stderr and "wandb" in stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tracker_whose_package_is_missing_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(
        trackers.TRACKER_PACKAGES, "wandb", ("wandb_not_installed_here", "pip install 'paratrain[wandb]'")
    )
    config = tiny_config(tmp_path / "run", log={"trackers": ["wandb"]})
    code, stderr = run_cli_in_process(["train", str(write_config(tmp_path / "c.yaml", config))])
    assert code == EXIT_USER_ERROR
    assert "pip install 'paratrain[wandb]'" in stderr and "log.trackers" in stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.fixture
def new_user(tmp_path, monkeypatch) -> Path:
    """No tracker variables, an empty HOME, and an empty working directory, which is returned."""
    as_new_user(monkeypatch, tmp_path / "home")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def train_tracked(tmp_path: Path, names: list[str]) -> tuple[int, str, Path]:
    output_dir = tmp_path / "run"
    config = tiny_config(output_dir, train={"max_steps": 3}, log={"every_steps": 1, "trackers": names})
    code, stderr = run_cli_in_process(["train", str(write_config(tmp_path / "c.yaml", config))])
    return code, stderr, output_dir


def test_mlflow_with_nothing_set_logs_to_a_sqlite_store_in_output_dir_and_says_how_to_open_it(
    tmp_path, new_user, caplog
):
    caplog.set_level(logging.INFO, logger="paratrain")
    code, stderr, output_dir = train_tracked(tmp_path, ["jsonl", "mlflow"])
    assert code == 0, stderr
    uri = f"sqlite:///{output_dir.resolve()}/mlflow.db"
    assert f"`mlflow ui --backend-store-uri {uri}`" in caplog.text
    client, mlrun = mlflow_run(uri, "test")
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["train.max_steps"] == "3"
    logged = {metric.step: metric.value for metric in client.get_metric_history(mlrun.info.run_id, "loss")}
    assert logged == pytest.approx({record["step"]: record["loss"] for record in read_metrics(output_dir)})
    assert sorted(logged) == [1, 2, 3]
    # Nothing in the working directory: no ./mlflow.db, no runs. (MLflow 2's client makes its SQLite store's
    # default artifact root, ./mlruns, when it opens the store; it stays empty.)
    leftovers = [path for path in new_user.iterdir() if not (path.name == "mlruns" and MLFLOW_MAJOR < 3)]
    assert leftovers == [] and not any(new_user.glob("mlruns/*"))


def test_an_explicit_mlflow_tracking_uri_wins_over_the_default_store(tmp_path, new_user, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="paratrain")
    uri = f"sqlite:///{tmp_path}/team.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    code, stderr, output_dir = train_tracked(tmp_path, ["mlflow"])
    assert code == 0, stderr
    assert mlflow_run(uri, "test")[1].info.status == "FINISHED"
    assert not (output_dir / "mlflow.db").exists() and "MLFLOW_TRACKING_URI is unset" not in caplog.text


def test_mlflow_file_store_without_its_opt_in_stops_before_training(tmp_path, new_user, monkeypatch):
    if MLFLOW_MAJOR < 3:
        pytest.skip("MLflow 2 opens its file store without an opt-in (MLFLOW_ALLOW_FILE_STORE came with 3)")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    code, stderr, output_dir = train_tracked(tmp_path, ["mlflow"])
    assert code == EXIT_USER_ERROR
    assert "MLFLOW_ALLOW_FILE_STORE=true" in stderr and "Traceback" not in stderr
    assert not output_dir.exists() and not (tmp_path / "mlruns").exists()


def test_wandb_without_a_login_stops_before_training_naming_the_ways_to_log_in(tmp_path, new_user):
    code, stderr, output_dir = train_tracked(tmp_path, ["jsonl", "wandb"])
    assert code == EXIT_USER_ERROR
    (line,) = [line for line in stderr.splitlines() if "wandb" in line]
    assert "`wandb login`" in line and "WANDB_API_KEY" in line and "WANDB_MODE=offline" in line
    assert "Traceback" not in stderr and not output_dir.exists()


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_in_a_local_mode_needs_no_login(tmp_path, new_user, monkeypatch, mode):
    monkeypatch.setenv("WANDB_MODE", mode)
    check_trackers_ready(["wandb"], output_dir=tmp_path / "run")


def test_a_wandb_api_key_of_the_wrong_shape_is_named_before_training(tmp_path, new_user, monkeypatch):
    if importlib.util.find_spec("wandb.sdk.lib.wbauth") is None:
        pytest.skip("this wandb release (the floor) has no key-shape check before it contacts its server")
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    with pytest.raises(ConfigError, match="WANDB_API_KEY invalid.*set a valid WANDB_API_KEY"):
        check_trackers_ready(["wandb"], output_dir=tmp_path / "run")


def test_a_wandb_login_in_netrc_passes_the_check(tmp_path, new_user, monkeypatch):
    # A W&B host on a closed loopback port: its key is looked up, the host is never reached.
    host = f"127.0.0.1:{free_loopback_port()}"
    monkeypatch.setenv("WANDB_BASE_URL", f"http://{host}")
    with pytest.raises(ConfigError, match="no W&B login was found"):
        check_trackers_ready(["wandb"], output_dir=tmp_path / "run")
    netrc = tmp_path / "home" / ".netrc"  # as `wandb login` writes it
    # As `wandb login` writes it: host and port since wandb 0.2x, the host alone before (the floor, 0.19).
    key = "a" * 40
    netrc.write_text(
        f"machine {host}\n  login user\n  password {key}\nmachine 127.0.0.1\n  login user\n  password {key}\n"
    )
    netrc.chmod(0o600)
    check_trackers_ready(["wandb"], output_dir=tmp_path / "run")


def test_the_login_check_leaves_no_wandb_state_a_later_run_would_read(tmp_path, new_user, monkeypatch):
    # A one-process run trains where preflight ran: wandb's process-wide setup, if the check left one,
    # would hold the settings read then (no WANDB_MODE) and send a later offline run to the login prompt.
    with pytest.raises(ConfigError, match="no W&B login was found"):
        check_trackers_ready(["wandb"], output_dir=tmp_path / "first")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunInfo(name="after-check", output_dir=tmp_path / "second", hparams={})
    tracker = trackers.WandbTracker(run)
    tracker.close("success")
    assert list((tmp_path / "second").glob("wandb/offline-run-*/run-*.wandb"))
