"""``paratrain report``: a finished (or running) run's metrics as PNG plots and one self-contained HTML page.

Several run directories are overlaid in each plot, one line per run, labelled by ``run.name`` (with the
directory name when two runs share a name). The HTML page embeds the PNGs as base64 data URIs, so it can
be mailed or attached on its own.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from paratrain.errors import ConfigError

# A metric is plotted as memory when its name contains one of these (the names memory monitors use).
_MEMORY_WORDS = ("mem", "rss", "allocated", "reserved")
NO_MEMORY = "no memory metrics recorded"


@dataclass(frozen=True)
class RunMetrics:
    """One run directory's metrics.jsonl and resolved config.yaml (empty when missing)."""

    directory: Path
    label: str
    records: list[dict[str, Any]]
    config: dict[str, Any]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.records if isinstance(r.get(key), (int, float))]
        return [step for step, _ in points], [value for _, value in points]


@dataclass(frozen=True)
class Report:
    """What ``write_report`` wrote: the page, the plots, and the memory metrics found (maybe none)."""

    html: Path
    plots: list[Path]
    memory_keys: list[str]


def load_run(directory: Path) -> RunMetrics:
    """Reads a run directory. Raises ConfigError naming it when it holds no metrics to report."""
    metrics = directory / "metrics.jsonl"
    if not metrics.is_file():
        what = "does not exist" if not directory.exists() else "has no metrics.jsonl"
        raise ConfigError(
            f"report: {directory} {what}; pass a run's output_dir (run.output_dir), "
            f"where paratrain train writes metrics.jsonl"
        )
    records = []
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise ConfigError(
                f"report: {metrics} line {number} is not JSON; was the file written by paratrain train?"
            ) from None
    if not records:
        raise ConfigError(f"report: {metrics} is empty: the run logged no step yet")
    config_file = directory / "config.yaml"
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    name = config.get("run", {}).get("name") or directory.name
    return RunMetrics(directory, name, records, config)


def load_runs(directories: list[Path]) -> list[RunMetrics]:
    """Loads every directory, reporting all bad ones at once; labels runs that share a name by directory."""
    runs, problems = [], []
    for directory in directories:
        try:
            runs.append(load_run(directory))
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError("\n".join(problems))
    names = [run.label for run in runs]
    return [
        RunMetrics(run.directory, f"{run.label} ({run.directory.name})", run.records, run.config)
        if names.count(run.label) > 1
        else run
        for run in runs
    ]


def memory_keys(runs: list[RunMetrics]) -> list[str]:
    keys = {
        key
        for run in runs
        for record in run.records
        for key, value in record.items()
        if isinstance(value, (int, float)) and any(word in key.lower() for word in _MEMORY_WORDS)
    }
    return sorted(keys)


def write_report(directories: list[Path], *, out: Path) -> Report:
    """Writes loss.png, lr.png, throughput.png (and memory.png when recorded) and report.html into out."""
    runs = load_runs(directories)
    out.mkdir(parents=True, exist_ok=True)
    plots = [
        _plot(runs, [("loss", "loss")], out / "loss.png", title="Training loss"),
        _plot(runs, [("lr", "learning rate")], out / "lr.png", title="Learning rate"),
        _plot(
            runs,
            [("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")],
            out / "throughput.png",
            title="Throughput",
        ),
    ]
    memory = memory_keys(runs)
    if memory:
        plots.append(_plot(runs, [(key, key) for key in memory], out / "memory.png", title="Memory"))
    page = out / "report.html"
    page.write_text(_html(runs, plots, memory))
    return Report(page, plots, memory)


def _plot(runs: list[RunMetrics], panels: list[tuple[str, str]], path: Path, *, title: str) -> Path:
    """One row of panels (one per metric present in some run), every run a line in each."""
    # Lazy: a heavy import (start-up time) that only this path needs.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Lazy: a heavy import (start-up time) that only this path needs.
    from matplotlib.ticker import MaxNLocator

    present = [(key, label) for key, label in panels if any(run.series(key)[0] for run in runs)] or panels[:1]
    figure, axes = plt.subplots(1, len(present), figsize=(6.4 * len(present), 4.0), squeeze=False)
    for axis, (key, label) in zip(axes[0], present):
        for run in runs:
            steps, values = run.series(key)
            if steps:
                axis.plot(
                    steps,
                    values,
                    marker="o" if len(steps) <= 30 else None,
                    markersize=3,
                    linewidth=1.5,
                    label=run.label,
                )
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        if axis.has_data():
            axis.legend(fontsize="small")
        else:
            axis.text(0.5, 0.5, f"no {key} recorded", ha="center", va="center", transform=axis.transAxes)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def run_summary(run: RunMetrics) -> dict[str, str]:
    """The config that tells runs apart, and where each ended, as short strings for the table."""
    config, last = run.config, run.records[-1]
    section = lambda name: config.get(name) or {}  # noqa: E731
    train, parallel, model = section("train"), section("parallel"), section("model")
    later = run.records[1:] or run.records  # step 1 includes start-up (compile, first allocations)

    def mean(key: str) -> str:
        values = [r[key] for r in later if isinstance(r.get(key), (int, float))]
        return f"{sum(values) / len(values):,.1f}" if values else "-"

    args = ", ".join(f"{k}={v}" for k, v in (model.get("args") or {}).items())
    return {
        "run": run.label,
        "directory": str(run.directory),
        "layout": f"{parallel.get('strategy', '?')} x{last.get('world_size', '?')}",
        "model": f"{model.get('factory', '?')}({args})",
        "batch (global/micro)": f"{train.get('global_batch_size', '?')}/{train.get('micro_batch_size', '?')}",
        "lr": str(section("optim").get("lr", "?")),
        "precision": str(config.get("precision", "?")),
        "steps": f"{last['step']}/{train.get('max_steps', '?')}",
        "final loss": f"{last['loss']:.4f}" if isinstance(last.get("loss"), (int, float)) else "-",
        "min loss": f"{min(run.series('loss')[1]):.4f}" if run.series("loss")[1] else "-",
        "samples/s (mean)": mean("samples_per_s"),
        "tokens/s (mean)": mean("tokens_per_s"),
    }


def _html(runs: list[RunMetrics], plots: list[Path], memory: list[str]) -> str:
    summaries = [run_summary(run) for run in runs]
    header = "".join(f"<th>{html.escape(column)}</th>" for column in summaries[0])
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(value)}</td>" for value in summary.values()) + "</tr>"
        for summary in summaries
    )
    images = "".join(
        f'<figure><img alt="{plot.stem}" src="data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()}">'
        f"</figure>"
        for plot in plots
    )
    memory_note = "" if memory else f"<p><em>{NO_MEMORY}</em> (add a memory monitor to log them).</p>"
    title = "paratrain report: " + ", ".join(run.label for run in runs)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }}
th {{ background: #f3f3f3; }}
img {{ max-width: 100%; }}
figure {{ margin: 1em 0; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
<h2>Runs</h2>
<table><tr>{header}</tr>{rows}</table>
<h2>Metrics against step</h2>
{images}
{memory_note}
</body></html>
"""
