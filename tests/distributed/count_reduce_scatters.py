"""Run under torchrun: trains fsdp through the Python API under each grad_sync policy given, one after
the other in the same processes, counting FSDP2's gradient reduce-scatters through its public
set_custom_reduce_scatter hook. Writes {policy: {"reduce_scatters": N, ...}} from rank 0."""

import sys

from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

import paratrain
from tests.distributed.one_launch import count_each
from tests.harness import TINY_GPT, TINY_TEXT


class CountingReduceScatter(DefaultReduceScatter):
    def __init__(self, counter: dict):
        super().__init__()
        self.counter = counter

    def __call__(self, *args, **kwargs):
        self.counter["calls"] += 1
        return super().__call__(*args, **kwargs)


def count(policy: str, output_dir: str) -> dict:
    config = paratrain.load_config(
        None,
        [
            "parallel.strategy=fsdp",
            "train.max_steps=3",
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
            f"parallel.fsdp.grad_sync={policy}",
            f"run.output_dir={output_dir}",
            "checkpoint.save_final=false",
            f"model.factory={TINY_GPT['factory']}",
            f"data.factory={TINY_TEXT['factory']}",
            "model.args={block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}",
            "data.args={block_size: 16, max_chars: 40000}",
        ],
    )
    trainer = paratrain.Trainer(config)
    units = [module for module in trainer.bare_model.modules() if isinstance(module, FSDPModule)]
    counter = {"calls": 0}
    for unit in units:
        unit.set_custom_reduce_scatter(CountingReduceScatter(counter))
    result = trainer.train()
    counts = {
        "reduce_scatters": counter["calls"],
        "steps": result.steps,
        "units": len(units),
        "accumulation": trainer.feed.sampler.accumulation_steps,
    }
    trainer.close()
    return counts


def main(out_path: str, output_root: str, policies: list[str]) -> None:
    count_each(lambda policy: count(policy, f"{output_root}/{policy}"), policies, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
