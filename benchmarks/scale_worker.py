"""One rank of a benchmarks/scale.py run: trains a config for its steps through paratrain's Python API and
writes what its initialisation cost to RESULT_DIR/rank-<R>.json.

Measured around ``materialize`` (every layout fills its weights there): this rank's resident memory just
before it (the runtime: torch, the model on meta, the data) and its high-water mark just after (VmHWM),
the CPU seconds it took, the bytes of this rank's shard and of the largest full tensor, and how many
tensors were drawn or read (a resume should draw none). Then the wall time of the end of the first step,
against the launch time the parent passes in PARATRAIN_SCALE_LAUNCHED (seconds since the epoch).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import paratrain.models.init as model_init
from paratrain import Trainer, load_config

# The modules that call materialize, by the names they have in this tree or (--baseline) an older one.
CALLERS = ("paratrain.layout.flat", "paratrain.layout.build", "paratrain.parallel.pipeline.assembly")

measured: dict[str, float] = {}
drawn = {"tensors": 0}


def memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measuring(materialize):
    def wrapped(model, **kwargs):
        measured["runtime_mib"] = memory_kib("VmRSS") / 1024
        cpu, wall = time.process_time(), time.perf_counter()
        materialize(model, **kwargs)
        measured["init_cpu_s"] = time.process_time() - cpu
        measured["init_wall_s"] = time.perf_counter() - wall
        measured["init_peak_mib"] = memory_kib("VmHWM") / 1024
        tensors = [*model.parameters(), *model.buffers()]
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        measured["shard_mib"] = sum(t.numel() * t.element_size() for t in local) / 2**20
        measured["largest_mib"] = max(t.numel() * t.element_size() for t in tensors) / 2**20

    return wrapped


def counting(source):
    def wrapped(*args, **kwargs):
        drawn["tensors"] += 1
        return source(*args, **kwargs)

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("result")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    for caller in CALLERS:
        try:
            module = importlib.import_module(caller)
        except ImportError:
            continue
        if hasattr(module, "materialize"):
            module.materialize = measuring(model_init.materialize)
    for name in ("replay", "_init_by_name", "initialise_whole"):  # every way a tensor is drawn
        if hasattr(model_init, name):
            setattr(model_init, name, counting(getattr(model_init, name)))
    trainer = Trainer(load_config(args.config, args.overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    launched = float(os.environ["PARATRAIN_SCALE_LAUNCHED"])
    first_step = None
    if rank == 0:  # rank 0 writes the metrics; a resumed run's file also holds the steps before this launch
        lines = (Path(trainer.config.run.output_dir) / "metrics.jsonl").read_text().splitlines()
        steps = [record for record in map(json.loads, lines) if record.get("step") is not None]
        first_step = min(record["time"] for record in steps if record["time"] > launched)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {
        **measured,
        "rank": rank,
        "drawn_tensors": drawn["tensors"],
        "launch_to_first_step_s": None if first_step is None else first_step - launched,
        "cpu_to_end_s": usage.ru_utime + usage.ru_stime,
        "threads": torch.get_num_threads(),
    }
    Path(args.result).mkdir(parents=True, exist_ok=True)
    (Path(args.result) / f"rank-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    sys.exit(main())
