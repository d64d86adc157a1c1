"""paratrain report: PNG plots and one self-contained HTML page for one run and for several overlaid."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import pytest
from PIL import Image

from paratrain.cli import main
from paratrain.config.loading import config_to_yaml, load_config
from paratrain.tools.report import NO_MEMORY, load_runs
from tests.harness import tiny_config, write_config


def write_run(
    directory: Path, *, name: str, lr: float, world_size: int = 1, memory: bool = False, steps: int = 20
) -> Path:
    """A run directory as paratrain train leaves it: the resolved config.yaml and one metrics line per step."""
    directory.mkdir(parents=True)
    strategy = "ddp" if world_size > 1 else "single"
    write_config(
        directory / "given.yaml",
        tiny_config(directory, run={"name": name}, optim={"lr": lr}, parallel={"strategy": strategy}),
    )
    (directory / "config.yaml").write_text(config_to_yaml(load_config(directory / "given.yaml", [])))
    with open(directory / "metrics.jsonl", "w") as metrics:
        for step in range(1, steps + 1):
            step_time = 0.05 + 0.002 * (step % 3)
            record = {
                "step": step,
                "loss": 4.9 * math.exp(-lr * 30 * step),
                "lr": lr * min(1.0, step / 2) * (1 - step / (2 * steps)),
                "grad_norm": 2.0 / step,
                "step_time_s": step_time,
                "samples_per_s": 8 / step_time,
                "epoch": 0,
                "world_size": world_size,
                "time": 1.7e9 + step * step_time,
                "tokens_per_s": 128 / step_time,
            }
            if memory:
                record |= {"memory_rss_max_gb": 0.5 + 0.01 * step, "memory_rss_min_gb": 0.45 + 0.01 * step}
            metrics.write(json.dumps(record) + "\n")
    return directory


def embedded_images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def check_plot(path: Path) -> None:
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert 500 <= image.width <= 2000 and 300 <= image.height <= 600, image.size
        assert len(image.convert("L").getcolors(maxcolors=65536) or ()) > 10  # something was drawn, not a blank canvas


def test_report_of_one_run_writes_plots_and_a_page_embedding_them(tmp_path, capsys):
    run = write_run(tmp_path / "run", name="baseline", lr=1e-3)

    assert main(["report", str(run)]) == 0

    out = run / "report"
    plots = [out / name for name in ("loss.png", "lr.png", "throughput.png")]
    for plot in plots:
        check_plot(plot)
    assert not (out / "memory.png").exists()
    page = (out / "report.html").read_text()
    assert embedded_images(page) == [plot.read_bytes() for plot in plots]
    assert 'src="http' not in page and "<link" not in page  # nothing to fetch: the page stands alone
    assert NO_MEMORY in page and NO_MEMORY in capsys.readouterr().out
    assert "<td>baseline</td>" in page and "<td>20/20</td>" in page
    assert f"<td>{4.9 * math.exp(-1e-3 * 30 * 20):.4f}</td>" in page  # the final loss


def test_report_of_two_runs_overlays_them_and_plots_memory_when_recorded(tmp_path):
    first = write_run(tmp_path / "a", name="lr-1e-3", lr=1e-3, memory=True)
    second = write_run(tmp_path / "b", name="lr-3e-3", lr=3e-3, world_size=2, steps=15)

    assert main(["report", str(first), str(second), "--out", str(tmp_path / "report")]) == 0

    out = tmp_path / "report"
    plots = [out / name for name in ("loss.png", "lr.png", "throughput.png", "memory.png")]
    for plot in plots:
        check_plot(plot)
    page = (out / "report.html").read_text()
    assert embedded_images(page) == [plot.read_bytes() for plot in plots]
    assert NO_MEMORY not in page
    assert "<td>lr-1e-3</td>" in page and "<td>lr-3e-3</td>" in page
    assert (
        "<td>single x1</td>" in page and "<td>ddp x2</td>" in page
    )  # strategy from config.yaml, world size from the metrics


def test_runs_sharing_a_name_are_told_apart_by_directory(tmp_path):
    runs = load_runs(
        [write_run(tmp_path / "first", name="test", lr=1e-3), write_run(tmp_path / "second", name="test", lr=2e-3)]
    )
    assert [run.label for run in runs] == ["test (first)", "test (second)"]


def test_report_on_a_directory_without_metrics_names_it_and_exits_2(tmp_path, capsys):
    good = write_run(tmp_path / "good", name="good", lr=1e-3)
    (tmp_path / "empty").mkdir()

    assert main(["report", str(good), str(tmp_path / "empty"), str(tmp_path / "missing")]) == 2

    error = capsys.readouterr().err
    assert f"{tmp_path / 'empty'} has no metrics.jsonl" in error
    assert f"{tmp_path / 'missing'} does not exist" in error
    assert not (good / "report").exists()


@pytest.mark.parametrize("content", ["", "{not json\n"])
def test_report_on_an_empty_or_garbled_metrics_file_says_so(tmp_path, capsys, content):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path / "run")]) == 2
    assert str(tmp_path / "run" / "metrics.jsonl") in capsys.readouterr().err
