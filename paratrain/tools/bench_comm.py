"""``paratrain bench comm``: time all_reduce, all_gather, reduce_scatter and broadcast over a size sweep.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): ``algbw = S / t`` and ``busbw = algbw x factor``, in
GB/s of 1e9 bytes, where t is the mean time of one operation (averaged over iterations, then over ranks,
as nccl-tests does by default) and S and the factor are, for n ranks:

============== ================================================================ ===============
operation      S                                                                busbw factor
============== ================================================================ ===============
all_reduce     bytes of the buffer on each rank (input = output)                2(n-1)/n
all_gather     bytes of the whole gathered output (n x each rank's input)       (n-1)/n
reduce_scatter bytes of the whole input on each rank (n x each rank's output)   (n-1)/n
broadcast      bytes of the buffer sent from the root                           1
============== ================================================================ ===============

Bus bandwidth is comparable with the hardware's link bandwidth whatever n is. The CLI launches the
workers with torchrun (loopback rendezvous, like ``paratrain train``); rank 0 writes ``comm.json``, and
the CLI prints the table and draws ``comm.png`` from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from paratrain.errors import ConfigError
from paratrain.launch.launcher import LaunchOptions, launch

Operation = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
OPERATIONS: tuple[Operation, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DEFAULT_SIZES = ("1KB", "16KB", "256KB", "1MB", "4MB", "16MB")
ELEMENT_BYTES = 4  # float32
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "KIB": 1024,
    "M": 1024**2,
    "MB": 1024**2,
    "MIB": 1024**2,
    "G": 1024**3,
    "GB": 1024**3,
    "GIB": 1024**3,
}


def bus_factor(operation: Operation, world_size: int) -> float:
    """nccl-tests' correction from algorithm to bus bandwidth."""
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "broadcast": 1.0}[
        operation
    ]


def parse_size(text: str) -> int:
    """``1KB`` -> 1024 bytes. Units are binary (K = 1024), as nccl-tests reads ``-b 8K``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ConfigError(
            f"--sizes {text!r}: not a size; write a number with B, KB, MB or GB (binary units), e.g. 1KB 4MB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def operation_bytes(requested: int, world_size: int) -> int:
    """S rounded down to whole float32 elements that split evenly over the ranks (at least one each)."""
    unit = ELEMENT_BYTES * world_size
    return max(unit, requested // unit * unit)


@dataclass(frozen=True)
class CommResult:
    """One operation at one size. time_s is the mean of one operation; bandwidths are in GB/s (1e9 B/s)."""

    operation: Operation
    size_bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float
    bus_factor: float

    @classmethod
    def from_time(cls, operation: Operation, size_bytes: int, time_s: float, world_size: int) -> CommResult:
        algbw = size_bytes / time_s / 1e9
        factor = bus_factor(operation, world_size)
        return cls(operation, size_bytes, time_s, algbw, algbw * factor, factor)


@dataclass(frozen=True)
class CommBenchmark:
    """What comm.json holds."""

    backend: str
    device: str
    world_size: int
    warmup: int
    iters: int
    results: list[CommResult]

    @classmethod
    def load(cls, path: Path) -> CommBenchmark:
        data = json.loads(path.read_text())
        return cls(**{**data, "results": [CommResult(**result) for result in data["results"]]})


def format_table(bench: CommBenchmark) -> str:
    lines = [
        f"# {bench.world_size} ranks, {bench.backend} on {bench.device}, float32, {bench.warmup} warm-up + "
        f"{bench.iters} timed iterations, time = mean per operation over iterations and ranks",
        "# S: all_reduce buffer per rank; all_gather whole output; reduce_scatter whole input; broadcast buffer",
        f"{'operation':<15}{'size S (B)':>12}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}",
    ]
    for r in bench.results:
        lines.append(
            f"{r.operation:<15}{r.size_bytes:>12}{r.time_s * 1e6:>12.1f}{r.algbw_gbps:>14.4f}{r.busbw_gbps:>14.4f}"
        )
    return "\n".join(lines)


def plot(bench: CommBenchmark, path: Path) -> Path:
    # Lazy: a heavy import (start-up time) that only this path needs.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Lazy: a heavy import (start-up time) that only this path needs.
    from matplotlib.ticker import FuncFormatter

    figure, (times, bus) = plt.subplots(1, 2, figsize=(12.0, 4.2))
    for operation in OPERATIONS:
        rows = [r for r in bench.results if r.operation == operation]
        if rows:
            sizes = [r.size_bytes for r in rows]
            times.plot(sizes, [r.time_s * 1e6 for r in rows], marker="o", label=operation)
            bus.plot(sizes, [r.busbw_gbps for r in rows], marker="o", label=operation)
    for axis, label in ((times, "time per operation (us)"), (bus, "bus bandwidth (GB/s)")):
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _human_size(int(value))))
        axis.set_xlabel("size S (bytes)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    times.set_yscale("log")
    figure.suptitle(f"Collectives: {bench.world_size} ranks, {bench.backend} on {bench.device}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _human_size(size: int) -> str:
    for unit, scale in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size}B"


# ---- the CLI's side ----------------------------------------------------------------------------


def run_benchmark(
    *, nproc_per_node: int, sizes: list[str] | None, iters: int, warmup: int, device: str, out: Path
) -> CommBenchmark | None:
    """Launches the workers, then prints the table and draws the plot from rank 0's comm.json.

    Returns:
        The results, or None when a worker failed (its own output says why).

    Raises:
        ConfigError: Bad options, before any process starts.
    """
    if nproc_per_node < 2:
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node}: collectives need at least 2 processes; use --nproc-per-node 2"
        )
    if iters < 1 or warmup < 0:
        raise ConfigError(f"--iters {iters} --warmup {warmup}: need at least 1 timed iteration and no negative warm-up")
    sizes = sizes or list(DEFAULT_SIZES)
    for size in sizes:
        parse_size(size)
    if device == "cuda":
        if torch.cuda.device_count() < nproc_per_node:
            raise ConfigError(
                f"--device cuda with --nproc-per-node {nproc_per_node} needs {nproc_per_node} GPUs, this "
                f"machine has {torch.cuda.device_count()}; use fewer processes or --device cpu"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm.json").unlink(missing_ok=True)
    worker_args = [
        "--sizes",
        *sizes,
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
        "--device",
        device,
        "--out",
        str(out),
    ]
    code = _launch(nproc_per_node, worker_args)
    if code != 0 or not (out / "comm.json").is_file():
        print(f"paratrain: bench comm workers failed (exit code {code}); their output is above", file=sys.stderr)
        return None
    bench = CommBenchmark.load(out / "comm.json")
    print(format_table(bench))
    print(f"wrote {out / 'comm.json'} and {plot(bench, out / 'comm.png')}")
    return bench


def _launch(nproc_per_node: int, worker_args: list[str]) -> int:
    """torchrun in this process, on the loopback-only rendezvous ``paratrain train`` uses."""

    return launch(LaunchOptions(nproc_per_node=nproc_per_node), worker_args, env={}, worker_module=__name__)


# ---- the workers' side -------------------------------------------------------------------------


def _operation(name: Operation, size_bytes: int, world_size: int, device) -> Callable[[], None]:
    """One call of the collective on freshly allocated float32 buffers of nccl-tests' shapes."""

    total, chunk = size_bytes // ELEMENT_BYTES, size_bytes // ELEMENT_BYTES // world_size
    if name == "all_reduce":
        buffer = torch.ones(total, device=device)
        return lambda: dist.all_reduce(buffer)
    if name == "all_gather":
        piece, gathered = torch.ones(chunk, device=device), torch.empty(total, device=device)
        return lambda: dist.all_gather_single(gathered, piece)  # all_gather_into_tensor, renamed in torch 2.13
    if name == "reduce_scatter":
        full, piece = torch.ones(total, device=device), torch.empty(chunk, device=device)
        return lambda: dist.reduce_scatter_single(piece, full)  # reduce_scatter_tensor, renamed
    buffer = torch.ones(total, device=device)
    return lambda: dist.broadcast(buffer, src=0)


def _time(call: Callable[[], None], *, iters: int, warmup: int, device) -> float:

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        call()
    synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize()
    return (time.perf_counter() - start) / iters


def worker(args: argparse.Namespace) -> None:

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    world, results = dist.get_world_size(), []
    try:
        for operation in OPERATIONS:
            for size in args.sizes:
                size_bytes = operation_bytes(parse_size(size), world)
                seconds = torch.tensor(
                    [
                        _time(
                            _operation(operation, size_bytes, world, device),
                            iters=args.iters,
                            warmup=args.warmup,
                            device=device,
                        )
                    ],
                    dtype=torch.float64,
                    device=device,
                )
                dist.all_reduce(seconds)  # mean over ranks, as nccl-tests reports by default
                results.append(CommResult.from_time(operation, size_bytes, seconds.item() / world, world))
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name(device) if use_cuda else "cpu"
            bench = CommBenchmark(dist.get_backend(), name, world, args.warmup, args.iters, results)
            (Path(args.out) / "comm.json").write_text(json.dumps(asdict(bench), indent=1))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paratrain.tools.bench_comm", description="One rank of paratrain bench comm."
    )
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", required=True)
    worker(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
