"""Checkpoint save and load throughput against the disk's own bandwidth and plain DCP.

One run measures, side by side on the same disk:

- *disk*: a plain sequential write of a file the size of the checkpoint (64 MiB writes, then one
  fsync), and a cold read of it: its pages are dropped from the page cache first, through
  ``/proc/sys/vm/drop_caches`` when running as root, else ``posix_fadvise(DONTNEED)`` on the file
  (the header line says which). The same with ``dd`` (``bs=64M conv=fsync``, then a cold read into
  /dev/null), as a check on the Python probe.
- *paratrain*: ``Checkpointer.save`` synchronous (DCP write with fsync, then the manifest with each
  file's checksum), asynchronous (*blocked*: until the call returns; *background*: until the
  checkpoint is complete), and a cold load as a resume does it: ``check_checkpoint`` on rank 0 (the
  manifest, every file's size, ``.metadata``) then ``Checkpointer.load``, which checks each file's
  checksum as it reads it. ``--compare-threads 1,4`` adds synchronous saves with that many writer
  threads per rank (the default is ``hashing.WRITE_THREADS``).
- *plain DCP*: ``torch.distributed.checkpoint.save``/``load`` of the same state with
  ``FileSystemWriter`` defaults (fsync on, one thread), no checksum; cold load.

The state is a GPT from ``paratrain.models.gpt`` sized by ``--state-gb`` (weights + AdamW's two
moments, fp32), saved from one process, and again sharded ``fsdp`` over ``--fsdp-ranks`` processes
(torchrun, gloo; every rank writes its shard to the same disk at once). Throughput is checkpoint
bytes on disk over wall time; the ratio is to the disk's write (saves) or read (loads). Each
operation runs ``--rounds`` times, the order rotating every round; the table holds medians. Beside the
wall time it prints the CPU seconds (user + system, every thread, summed over ranks) each operation
took: on a shared machine others' jobs stretch the wall time several-fold between runs, the CPU far less.
It prints, it never asserts; results belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/checkpoint_io.py --state-gb 1 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint import writer as writer_module
from paratrain.checkpoint.hashing import WRITE_THREADS, HashingWriter
from paratrain.checkpoint.manifest import check_checkpoint
from paratrain.checkpoint.state import ModelState, OptimizerState, Progress
from paratrain.models.gpt import build_gpt

REPO_ROOT = Path(__file__).resolve().parent.parent
CHUNK = 64 << 20
N_LAYER = 8
HEAD_DIM = 64


def build_state(state_gb: float, *, fsdp: bool) -> dict:
    """Model, optimizer and progress of a GPT whose weights + AdamW moments take about state_gb."""
    torch.manual_seed(0)
    # 12 d^2 weights per block (attention 4 d^2, MLP 8 d^2), 3 fp32 copies (weights, two moments).
    width = int((state_gb * 1e9 / (3 * 4 * 12 * N_LAYER)) ** 0.5) // HEAD_DIM * HEAD_DIM
    width = max(width, HEAD_DIM)
    model = build_gpt(n_layer=N_LAYER, n_embd=width, n_head=width // HEAD_DIM, block_size=64)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():  # fills both moments without a forward pass
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "progress": Progress()}


def drop_from_cache(paths: list[Path]) -> None:
    """Makes the next read of paths come from the disk."""
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())  # only clean pages can be dropped
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if os.geteuid() == 0:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1")


def cache_method() -> str:
    if os.geteuid() == 0:
        return "page cache dropped before each read (/proc/sys/vm/drop_caches=1, and fadvise DONTNEED)"
    return "page cache dropped before each read (posix_fadvise DONTNEED per file; not root)"


def files_under(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]


def disk_write(path: Path, size: int) -> float:
    block = os.urandom(CHUNK)
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as handle:
        for _ in range(max(1, size // CHUNK)):
            handle.write(block)
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def disk_read(path: Path) -> float:
    drop_from_cache([path])
    buffer = bytearray(CHUNK)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass
    return time.perf_counter() - started


def fresh(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def in_sync(action: Callable[[], object]) -> tuple[float, float]:
    """Wall time of action on every rank, from a common start to the last rank's end, and the CPU
    seconds it took (every thread of every rank)."""
    if dist.is_initialized():
        dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    action()
    cpu = time.process_time() - cpu_started
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - started, summed_over_ranks(cpu)


def summed_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


class Bench:
    """The operations of one round, on one process or on every rank of a group."""

    def __init__(self, state: dict, scratch: Path, *, rank: int, world_size: int, compare_threads: list[int]):
        self.state = state
        self.compare_threads = compare_threads
        self.scratch = scratch
        self.rank = rank
        distributed = dist.is_initialized()
        self.checkpointer = Checkpointer(
            scratch / "paratrain", keep_last=1, rank=rank, world_size=world_size, config={}, async_save=True
        )
        self.step = 0
        self.no_dist = not distributed

    def _save_sync(self, threads: int = WRITE_THREADS) -> tuple[float, float]:
        self.step += 1
        writer_module.HashingWriter = functools.partial(HashingWriter, thread_count=threads)  # type: ignore[misc]
        try:
            timing = in_sync(lambda: self.checkpointer.save(self.step, self.state, blocking=True))
        finally:
            writer_module.HashingWriter = HashingWriter  # type: ignore[misc]
        self._let_rotation_finish()
        return timing

    def _save_async(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(wall, CPU) until the call returned, and until the checkpoint was complete."""
        self.step += 1
        if dist.is_initialized():
            dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        self.checkpointer.save(self.step, self.state, blocking=False)
        blocked = time.perf_counter() - started, time.process_time() - cpu_started
        self.checkpointer.wait()
        cpu = time.process_time() - cpu_started
        if dist.is_initialized():
            dist.barrier()
        until_complete = time.perf_counter() - started, summed_over_ranks(cpu)
        self._let_rotation_finish()
        return (blocked[0], summed_over_ranks(blocked[1])), until_complete

    def _load_paratrain(self) -> tuple[float, float]:
        path = self.checkpointer.directory / f"step-{self.step}"
        self._drop(path)

        def resume() -> None:
            if self.rank == 0:
                check_checkpoint(path)  # rank 0 checks what needs no data reading, as choosing a resume does
            if dist.is_initialized():
                dist.barrier()
            self.checkpointer.load(path, self.state)  # every file's checksum checked as it is read

        return in_sync(resume)

    def _save_dcp(self) -> tuple[float, float]:
        path = self.scratch / "dcp"
        if self.rank == 0:
            fresh(path)
        return in_sync(lambda: dcp.save(self.state, checkpoint_id=path, no_dist=self.no_dist))

    def _load_dcp(self) -> tuple[float, float]:
        path = self.scratch / "dcp"
        self._drop(path)
        return in_sync(lambda: dcp.load(self.state, checkpoint_id=path, no_dist=self.no_dist))

    def _let_rotation_finish(self) -> None:
        """The previous checkpoint's files are deleted after a save completes, beside what follows it
        (training, in a run): waited for untimed, so that deletion does not land in the next timed load."""
        self.checkpointer.wait_for_rotation()
        if dist.is_initialized():
            dist.barrier()

    def _drop(self, path: Path) -> None:
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            drop_from_cache(files_under(path))
        if dist.is_initialized():
            dist.barrier()

    def run_round(self, index: int) -> dict[str, tuple[float, float]]:
        """(wall, CPU) seconds of each save and load with each side, the side going first rotating by round."""
        times: dict[str, tuple[float, float]] = {}

        def paratrain() -> None:
            for threads in self.compare_threads:
                times[f"paratrain sync save, {threads} writer threads"] = self._save_sync(threads)
            times["paratrain sync save"] = self._save_sync()
            times["paratrain load"] = self._load_paratrain()
            blocked, background = self._save_async()
            times["paratrain async save, blocked"] = blocked
            times["paratrain async save, until complete"] = background

        def plain() -> None:
            times["dcp save"] = self._save_dcp()
            times["dcp load"] = self._load_dcp()

        for side in (paratrain, plain) if index % 2 == 0 else (plain, paratrain):
            side()
        return times

    def bytes_on_disk(self) -> tuple[int, int]:
        newest = self.checkpointer.directory / f"step-{self.step}"
        return sum(p.stat().st_size for p in files_under(newest)), sum(
            p.stat().st_size for p in files_under(self.scratch / "dcp")
        )


def measure(state_gb: float, rounds: int, scratch: Path, *, fsdp: bool, compare_threads: list[int]) -> dict:
    """Medians of every operation, on this process or (under torchrun) every rank together."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    state = build_state(state_gb, fsdp=fsdp)
    bench = Bench(state, scratch, rank=rank, world_size=world_size, compare_threads=compare_threads)
    results = [bench.run_round(index) for index in range(rounds)]
    bench.checkpointer.close()
    paratrain_bytes, dcp_bytes = bench.bytes_on_disk()
    medians = {name: statistics.median(r[name][0] for r in results) for name in results[0]}
    cpu = {name: statistics.median(r[name][1] for r in results) for name in results[0]}
    return {
        "paratrain_bytes": paratrain_bytes,
        "dcp_bytes": dcp_bytes,
        "medians": medians,
        "cpu_medians": cpu,
        "ranks": world_size,
    }


def dd_write(path: Path, size: int) -> float:
    count = str(max(1, size // CHUNK))
    started = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "conv=fsync", "status=none"], check=True
    )
    return time.perf_counter() - started


def dd_read(path: Path) -> float:
    drop_from_cache([path])
    started = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "status=none"], check=True)
    return time.perf_counter() - started


def measure_disk(scratch: Path, size: int, rounds: int) -> dict[str, float]:
    path = scratch / "disk-probe"
    times: dict[str, list[float]] = {"write": [], "read": [], "dd write": [], "dd read": []}
    for _ in range(rounds):
        times["write"].append(disk_write(path, size))
        times["read"].append(disk_read(path))
        path.unlink()
        # dd writes zeros: on a compressing or deduplicating filesystem faster than the disk, not on ext4 or xfs.
        times["dd write"].append(dd_write(path, size))
        times["dd read"].append(dd_read(path))
    written = path.stat().st_size
    path.unlink()
    return {name: written / statistics.median(values) for name, values in times.items()}


def print_table(title: str, result: dict, disk: dict[str, float]) -> None:
    medians = result["medians"]
    print(
        f"\n{title}: {result['paratrain_bytes'] / 1e9:.2f} GB per paratrain checkpoint "
        f"({result['dcp_bytes'] / 1e9:.2f} GB plain DCP), {result['ranks']} process(es)"
    )
    print("| operation | median s | GB/s | x disk | x plain DCP | CPU s |")
    print("|---|---|---|---|---|---|")
    print(f"| disk: sequential write + fsync | | {disk['write'] / 1e9:.2f} | 1.00 | | |")
    print(f"| disk: cold sequential read | | {disk['read'] / 1e9:.2f} | 1.00 | | |")
    print(f"| dd: write + fsync | | {disk['dd write'] / 1e9:.2f} | | | |")
    print(f"| dd: cold read | | {disk['dd read'] / 1e9:.2f} | | | |")
    for name, seconds in medians.items():
        size = result["dcp_bytes"] if name.startswith("dcp") else result["paratrain_bytes"]
        reference = disk["read"] if "load" in name else disk["write"]
        plain = medians["dcp load"] if "load" in name else medians["dcp save"]
        rate = size / seconds
        versus_dcp = "" if "blocked" in name else f"{rate / (result['dcp_bytes'] / plain):.2f}"
        cpu = result["cpu_medians"][name]
        print(f"| {name} | {seconds:.2f} | {rate / 1e9:.2f} | {rate / reference:.2f} | {versus_dcp} | {cpu:.2f} |")


def run_fsdp(args: argparse.Namespace, scratch: Path) -> dict:
    """Starts this script under torchrun on fsdp_ranks processes; returns rank 0's result."""
    result_path = scratch / "fsdp-result.json"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.fsdp_ranks}",
        __file__, "--worker", str(result_path), "--state-gb", str(args.state_gb), "--rounds", str(args.rounds),
        "--compare-threads", ",".join(map(str, args.compare_threads)),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(argv, check=True, env=env, cwd=scratch)
    return json.loads(result_path.read_text())


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    result_path = Path(args.worker)
    result = measure(
        args.state_gb, args.rounds, result_path.parent / "fsdp", fsdp=True, compare_threads=args.compare_threads
    )
    if dist.get_rank() == 0:
        result_path.write_text(json.dumps(result))
    dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-gb", type=float, default=1.0, help="weights + AdamW moments, GB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fsdp-ranks", type=int, default=2, help="processes of the sharded case; 0 skips it")
    parser.add_argument(
        "--compare-threads",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        help="also time synchronous saves with these writer-thread counts, e.g. 1,4",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: a torchrun rank's result file
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    # As a training process does after its imports (paratrain.train.freeze_imported_objects): a garbage
    # collection then walks what the run made, not torch's modules.
    gc.freeze()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint_io-") as name:
        scratch = Path(name)
        single = measure(
            args.state_gb, args.rounds, scratch / "single", fsdp=False, compare_threads=args.compare_threads
        )
        disk = measure_disk(scratch, single["paratrain_bytes"], args.rounds)
        sharded = run_fsdp(args, scratch) if args.fsdp_ranks else None
    print(f"torch {torch.__version__}, 1 thread per process, {os.cpu_count()} CPUs; {cache_method()}")
    print_table("one process", single, disk)
    if sharded:
        print_table(f"fsdp x{args.fsdp_ranks} (torchrun, gloo)", sharded, disk)


if __name__ == "__main__":
    main()
