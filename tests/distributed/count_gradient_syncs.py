"""Run under torchrun: trains through the Python API with a user model, dataset and loss, once per
micro-batch size given (one after the other in the same processes), counting DDP's gradient
all-reduces with a comm hook. Writes {micro_batch_size: {"syncs": N, "steps": S}} from rank 0."""

import sys

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import paratrain
from tests.distributed.one_launch import count_each


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def counting_allreduce(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state["syncs"] += 1
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def count(micro_batch_size: int, output_dir: str) -> dict:
    config = paratrain.load_config(
        None,
        [
            "parallel.strategy=ddp",
            "train.max_steps=3",
            "train.global_batch_size=16",
            f"train.micro_batch_size={micro_batch_size}",
            f"run.output_dir={output_dir}",
            "checkpoint.save_final=false",
            "parallel.ddp.bucket_cap_mb=0.0001",
        ],
    )
    features = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(features, features.sum(dim=1, keepdim=True))
    trainer = paratrain.Trainer(
        config, model_factory=build_model, dataset=dataset, loss_fn=torch.nn.functional.mse_loss
    )
    state = {"syncs": 0}
    trainer.model.register_comm_hook(state, counting_allreduce)
    result = trainer.train()
    counts = {"syncs": state["syncs"], "steps": result.steps, "loss": result.final_loss}
    trainer.close()
    return counts


def main(out_path: str, output_root: str, micro_batch_sizes: list[int]) -> None:
    count_each(lambda size: count(size, f"{output_root}/run-{size}"), micro_batch_sizes, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(size) for size in sys.argv[3:]])
