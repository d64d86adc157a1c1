"""Run under torchrun with 4 processes: trains one step under each layout named on the command line (one
after the other, in the same processes) and writes every rank's parameter, gradient and optimizer-state
bytes per layout from rank 0, counted as benchmarks/fsdp_memory_worker.py counts them (local shards of
DTensors, each .grad, every optimizer state tensor). {layout: [per rank {"params": B, ...}]}."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import paratrain
from tests.distributed.one_launch import count_each

# The benchmark's own counting (benchmarks/ is a folder of scripts, not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fsdp_memory_worker import model_state_bytes  # noqa: E402

# Layout name -> overrides; shared with tests/tools/test_plan.py, which estimates the same layouts.
LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp"],
    "fsdp2": ["parallel.strategy=hsdp", "parallel.dp_shard=2", "parallel.dp_replicate=2"],
    "tp": ["parallel.strategy=tp"],
}
MODEL_ARGS = "{block_size: 16, n_layer: 2, n_head: 4, n_embd: 64}"


def layout_config(layout: str, output_dir: str) -> paratrain.Config:
    return paratrain.load_config(
        None,
        [
            *LAYOUTS[layout],
            f"run.output_dir={output_dir}",
            "train.max_steps=1",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "checkpoint.save_final=false",
            "optim.name=adamw",
            f"model.args={MODEL_ARGS}",
        ],
    )


def random_tokens() -> TensorDataset:
    """Next-token pairs of random ids: bytes held do not depend on the data, and nothing is read from disk."""
    tokens = torch.randint(0, 128, (16, 17), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def count(layout: str, output_dir: str) -> list[dict]:
    trainer = paratrain.Trainer(layout_config(layout, output_dir), dataset=random_tokens())
    trainer.train_step(next(trainer.feed.step_batches()))  # train_step clears gradients at its start: still held
    counted = model_state_bytes(trainer)
    mine = {
        "params": counted["params"]["logical"],
        "grads": counted["grads"]["logical"],
        "optimizer": counted["optim_moments"]["logical"] + counted["optim_steps"]["logical"],
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    trainer.close()
    return everyone


if __name__ == "__main__":
    out_path, output_root, *layouts = sys.argv[1:]
    count_each(lambda layout: count(layout, f"{output_root}/{layout}"), layouts, out_path)
