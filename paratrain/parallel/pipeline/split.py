"""Cutting a model's pipeline sequence into consecutive stages.

The model declares its pipeline sequence (``ParallelPlan.pipeline_sequence``): module paths whose
chained calls make up its forward. A stage is a run of consecutive pieces. Where the runs end comes
either from split points the user names (each a piece that ends a stage, as in torch's
``pipeline(..., split_spec={"layer.4": SplitPoint.END})``) or from balancing a cost per piece (parameter count, or a
measured time) so that the most expensive stage is as cheap as possible.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from paratrain.config.schema import PipelineConfig
from paratrain.errors import ConfigError
from paratrain.models.plan_derivation import plan_of

Stage = tuple[str, ...]


def pipeline_sequence(model: nn.Module) -> tuple[str, ...]:
    """The model's declared pipeline sequence, checked to cover every parameter exactly once.

    Raises:
        ConfigError: the model declares none, names a module it lacks, or leaves parameters outside.
    """
    plan = plan_of(model)
    sequence = plan.pipeline_sequence
    if not sequence and plan.pipeline_refusal:
        raise ConfigError(plan.pipeline_refusal)
    if not sequence:
        raise ConfigError(
            "the model declares no pipeline sequence, so it cannot be cut into stages; give it a parallel_plan() "
            "returning ParallelPlan(pipeline_sequence=('embed', 'blocks.0', ..., 'head')) whose chained calls equal "
            "its forward (see paratrain/models/gpt.py), or make it an nn.Sequential"
        )
    for path in sequence:
        _require_module(model, path, key="ParallelPlan.pipeline_sequence")
    _require_covers_parameters(model, sequence)
    return sequence


def cut_stages(
    model: nn.Module, options: PipelineConfig, num_stages: int, costs: list[float] | None = None
) -> list[Stage]:
    """Every stage's pieces: at the named split points, else balanced by cost (default: parameters)."""
    sequence = pipeline_sequence(model)
    if options.split_points:
        stages = split_at(sequence, options.split_points, model=model)
        if len(stages) != num_stages:
            raise ConfigError(
                f"pipeline.split_points names {len(options.split_points)} stage end(s), which makes {len(stages)} "
                f"stages, but the pipeline has {num_stages} (parallel.pp x pipeline.stages_per_rank); "
                f"name {num_stages - 1} split points, or none to cut automatically"
            )
        return stages
    check_stage_count(len(sequence), num_stages, sequence)
    return balance(sequence, costs if costs is not None else parameter_costs(model, sequence), num_stages)


def split_at(sequence: Sequence[str], split_points: Sequence[str], *, model: nn.Module) -> list[Stage]:
    """Stages that end at each named split point (the last stage takes the rest)."""
    for point in split_points:
        _require_module(model, point, key="pipeline.split_points")
        if point not in sequence:
            raise ConfigError(
                f"pipeline.split_points: {point!r} is a module of the model but not a place a stage can end; "
                f"choose among the pipeline sequence: {', '.join(sequence[:-1])}"
            )
    ends = sorted(sequence.index(point) for point in split_points)
    if len(set(ends)) != len(ends) or (ends and ends[-1] == len(sequence) - 1):
        raise ConfigError(
            f"pipeline.split_points={list(split_points)} must name distinct modules, in order, none of them the "
            f"last piece ({sequence[-1]}), so every stage gets at least one piece"
        )
    bounds = [0, *(end + 1 for end in ends), len(sequence)]
    return [tuple(sequence[start:stop]) for start, stop in zip(bounds, bounds[1:])]


def balance(sequence: Sequence[str], costs: Sequence[float], num_stages: int) -> list[Stage]:
    """Consecutive stages that minimise the largest stage cost (ties: the earliest cut wins).

    Exact dynamic programme over cut positions, O(pieces² × stages): pipelines have tens of pieces.
    """
    check_stage_count(len(sequence), num_stages, sequence)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[k][i]: the smallest possible largest-stage cost of putting the first i pieces in k stages.
    infinity = float("inf")
    best = [[infinity] * (len(sequence) + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (len(sequence) + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, len(sequence) + 1):
            for j in range(k - 1, i):
                candidate = max(best[k - 1][j], prefix[i] - prefix[j])
                if candidate < best[k][i]:
                    best[k][i], cut[k][i] = candidate, j
    stages, end = [], len(sequence)
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        stages.append(tuple(sequence[start:end]))
        end = start
    return stages[::-1]


def parameter_costs(model: nn.Module, sequence: Sequence[str]) -> list[float]:
    """Parameter count of each piece: a proxy for its compute when the pieces are alike."""
    return [float(sum(p.numel() for p in model.get_submodule(path).parameters())) for path in sequence]


def check_stage_count(pieces: int, num_stages: int, sequence: Sequence[str]) -> None:
    if num_stages > pieces:
        raise ConfigError(
            f"the pipeline needs {num_stages} stages (parallel.pp x pipeline.stages_per_rank), but the model has only "
            f"{pieces} pieces to cut between ({', '.join(sequence)}); use at most {pieces} stages, or a deeper model"
        )


def _require_module(model: nn.Module, path: str, *, key: str) -> None:
    try:
        model.get_submodule(path)
    except AttributeError:
        names = [name for name, _ in model.named_modules() if name and name.count(".") <= 1]
        raise ConfigError(
            f"{key}: the model has no module {path!r}; modules near the top are: "
            f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''}"
        ) from None


def _require_covers_parameters(model: nn.Module, sequence: Sequence[str]) -> None:
    owners: dict[int, list[str]] = {}
    for path in sequence:
        for param in model.get_submodule(path).parameters():
            owners.setdefault(id(param), []).append(path)
    outside = [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) not in owners]
    shared = sorted({" and ".join(paths) for paths in owners.values() if len(paths) > 1})
    if outside or shared:
        problem = (
            f"leaves parameters outside every piece ({', '.join(outside[:5])})"
            if outside
            else f"shares parameters between pieces ({'; '.join(shared[:3])}), e.g. tied embeddings"
        )
        raise ConfigError(
            f"ParallelPlan.pipeline_sequence {problem}; each parameter must live in exactly one piece so each "
            f"stage owns and updates its own weights"
        )


def measured_costs(pieces: Sequence[nn.Module], sample: torch.Tensor, *, repeats: int = 3) -> list[float]:
    """Seconds each piece takes for forward + backward on ``sample`` (pieces of a real, materialised model,
    each a one-piece stage so it gets the inputs it needs).

    Pieces run in order, each on the previous one's output; the median of ``repeats`` timings after
    one warm-up run is kept. On CPU the clock is the process's CPU time: a wall clock also counts the
    time other processes take the core, which on a busy machine made a piece 100 times smaller come out
    3 times larger (the suite, 2026-11-26). On CUDA it is the wall clock, around a device wait.
    """
    clock = time.perf_counter if sample.device.type == "cuda" else time.process_time
    timings: list[list[float]] = [[] for _ in pieces]
    for attempt in range(repeats + 1):
        x = sample
        for index, piece in enumerate(pieces):
            x_in = x.detach().requires_grad_() if x.is_floating_point() else x
            _wait_for_device(sample.device)
            start = clock()
            y = piece(x_in)
            y.backward(torch.ones_like(y))
            # CUDA kernels run asynchronously: without waiting, the clock would time their launch only.
            _wait_for_device(sample.device)
            if attempt:
                timings[index].append(clock() - start)
            x = y
    return [statistics.median(values) for values in timings]


def _wait_for_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
