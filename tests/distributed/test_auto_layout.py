"""``parallel.strategy: auto`` on the session's gloo ranks: every rank resolves the same layout, the one the
planner recommends for this world size, and trains it (in the ranks' own processes, without a launch)."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from paratrain.config.loading import validate_config
from paratrain.planner.memory_check import maybe_resolve_auto
from paratrain.train import run
from tests.harness import read_metrics, tiny_config

STEPS = 2


def train_with_auto(output_dir: str) -> dict[str, object]:
    """One rank: resolve auto for the pool's world size as `python -m paratrain.train` does, then train."""
    world = dist.get_world_size()
    env = {"RANK": dist.get_rank(), "WORLD_SIZE": world, "LOCAL_RANK": dist.get_rank(), "LOCAL_WORLD_SIZE": world}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update({name: str(value) for name, value in env.items()})
    try:
        raw = tiny_config(
            Path(output_dir),
            train={"max_steps": STEPS, "device": "cpu"},
            parallel={"strategy": "auto"},
            checkpoint={"every_steps": 0, "save_final": False},
        )
        config = maybe_resolve_auto(validate_config(raw), world_size=world, nproc_per_node=world)
        run(config)
        return config.parallel.model_dump(include={"strategy", "pp", "dp_replicate", "dp_shard", "tp"})
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_auto_resolves_the_same_layout_on_every_rank_and_trains_it(ranks, tmp_path):
    layouts = ranks.run(train_with_auto, str(tmp_path / "run"))
    assert all(layout == layouts[0] for layout in layouts), layouts
    assert layouts[0]["strategy"] != "auto"
    degrees = layouts[0]["pp"] * layouts[0]["dp_replicate"] * layouts[0]["dp_shard"] * layouts[0]["tp"]
    assert degrees == ranks.world_size
    assert [record["step"] for record in read_metrics(tmp_path / "run")] == list(range(1, STEPS + 1))
