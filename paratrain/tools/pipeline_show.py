"""``paratrain pipeline show``: a config's pipeline as text and PNG, with its bubble in theory and,
when the run has recorded timelines, as measured."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paratrain.config.factories import call_factory
from paratrain.config.schema import Config
from paratrain.errors import ConfigError
from paratrain.models.meta import on_meta
from paratrain.parallel.dims import resolve_parallel_dims
from paratrain.parallel.pipeline.assembly import pipeline_shape
from paratrain.parallel.pipeline.recorder import measured_bubble, read_timelines
from paratrain.parallel.pipeline.schedules import PipelineShape, check_shape
from paratrain.parallel.pipeline.split import cut_stages
from paratrain.parallel.pipeline.timeline import Timeline, render_text, simulate, theoretical_bubble

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#55A868", "W": "#8C8C3C"}


@dataclass(frozen=True)
class Bar:
    """One action drawn on one rank's row."""

    start: float
    end: float
    kind: str
    label: str


def show_pipeline(config: Config, *, world_size: int, nproc_per_node: int, out: Path, run_dir: Path | None) -> str:
    """The report as text; writes the theoretical timeline (and the measured one, if any) as PNGs."""
    dims = resolve_parallel_dims(config.parallel, world_size=world_size, local_world_size=nproc_per_node)
    if dims.pp == 1:  # nothing to show: a request the config cannot answer, so bad input (exit 2), not success
        raise ConfigError(
            f"{dims.describe()}: no pipeline at world size {world_size} to show; set parallel.pp (or "
            f"parallel.strategy=pp) and --nproc-per-node"
        )
    shape = pipeline_shape(config.pipeline, dims=dims, train=config.train)
    check_shape(shape)
    timeline = simulate(shape)
    lines = [
        f"pipeline: {shape.describe()} ({dims.describe()})",
        *_stage_lines(config, shape),
        "",
        render_text(timeline),
        "",
        _theory_line(shape, timeline),
    ]
    draw(
        _theory_bars(timeline), out, title=f"{shape.describe()}: bubble {float(timeline.idle_fraction()):.3f} (theory)"
    )
    lines.append(f"timeline drawn to {out}")
    lines += _measured_lines(run_dir or config.run.output_dir, out, shape)
    return "\n".join(lines)


def _stage_lines(config: Config, shape: PipelineShape) -> list[str]:
    with on_meta():
        model = call_factory(config.model, key="model")
    stages = cut_stages(model, config.pipeline, shape.num_stages)
    owner = shape.stage_to_rank()
    lines = []
    for index, pieces in enumerate(stages):
        params = sum(p.numel() for path in pieces for p in model.get_submodule(path).parameters())
        lines.append(f"  stage {index} on pp rank {owner[index]}: {', '.join(pieces)} ({params:,} parameters)")
    return lines


def _theory_line(shape: PipelineShape, timeline: Timeline) -> str:
    idle = timeline.idle_fraction()
    formula = theoretical_bubble(shape.pp, shape.microbatches, shape.stages_per_rank)
    return (
        f"bubble in theory (uniform stages, backward = 2 x forward, free communication): {idle} = {float(idle):.3f}; "
        f"(p-1)/(v*m+p-1) = {formula} = {float(formula):.3f}"
    )


def _measured_lines(run_dir: Path, out: Path, shape: PipelineShape) -> list[str]:
    timelines = read_timelines(run_dir / "pipeline")
    if not timelines:
        return [
            f"no measured timeline in {run_dir}/pipeline (train with pipeline.record_timeline=true, then run this "
            f"again, or pass --run RUN_DIR)"
        ]
    try:
        bubble = measured_bubble(timelines)
    except ValueError as error:
        return [f"measured: {error}"]
    first = timelines[0]
    measured_png = out.with_name(out.stem + "-measured" + out.suffix)
    draw(measured_bars(timelines), measured_png, title=f"measured, last recorded step: bubble {bubble:.3f} (all steps)")
    steps = min(len(record["steps"]) for record in timelines)
    recorded = PipelineShape(first["schedule"], first["pp"], first["stages_per_rank"], first["microbatches"])
    lines = [
        f"bubble measured in {run_dir} ({recorded.describe()}, {steps - 1} steps after the first): {bubble:.3f}",
        f"measured timeline drawn to {measured_png}",
    ]
    if recorded != shape:
        lines.append(f"note: that run recorded {recorded.describe()}, not this config's {shape.describe()}")
    return lines


def _theory_bars(timeline: Timeline) -> list[list[Bar]]:
    return [
        [Bar(float(s.start), float(s.end), s.kind, f"{s.stage}{s.kind}{s.microbatch}") for s in slots]
        for slots in timeline.ranks
    ]


def measured_bars(timelines: list[dict]) -> list[list[Bar]]:
    """The last recorded step of the first pipeline replica, in milliseconds from its start."""
    replica = [record for record in timelines if record["replica"] == timelines[0]["replica"]]
    replica.sort(key=lambda record: record["pp_rank"])
    start = max(record["steps"][-1]["start"] for record in replica)
    return [
        [
            Bar((a_start - start) * 1e3, (a_end - start) * 1e3, kind, f"{stage}{kind}{mb}")
            for stage, kind, mb, a_start, a_end in record["steps"][-1]["actions"]
        ]
        for record in replica
    ]


def draw(ranks: list[list[Bar]], path: Path, *, title: str) -> None:
    """One row per rank, one coloured box per action, white where the rank is idle."""
    # Lazy: a heavy import (start-up time) that only this path needs.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Lazy: a heavy import (start-up time) that only this path needs.
    from matplotlib.patches import Patch

    end = max(bar.end for bars in ranks for bar in bars)
    figure, axes = plt.subplots(
        figsize=(max(8.0, min(24.0, 0.5 * sum(len(b) for b in ranks) / len(ranks))), 1.0 + 0.6 * len(ranks))
    )
    for row, bars in enumerate(ranks):
        for bar in bars:
            axes.barh(row, bar.end - bar.start, left=bar.start, color=_COLOURS[bar.kind], edgecolor="white", height=0.8)
            if (bar.end - bar.start) / end > 0.02:
                axes.text(
                    (bar.start + bar.end) / 2, row, bar.label, ha="center", va="center", fontsize=7, color="white"
                )
    axes.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in range(len(ranks))])
    axes.invert_yaxis()
    axes.set_xlim(0, end)
    axes.set_xlabel("time (1 = one forward through 1/p of the model)" if "measured" not in title else "time (ms)")
    axes.set_title(title, fontsize=10)
    figure.legend(
        handles=[
            Patch(color=c, label=k)
            for k, c in zip(("forward", "backward", "input grad", "weight grad"), _COLOURS.values())
        ],
        loc="lower center",
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    figure.tight_layout(rect=(0, 0.1 if len(ranks) > 2 else 0.16, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
