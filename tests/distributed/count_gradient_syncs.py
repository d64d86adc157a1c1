"""Run under torchrun: trains through the Python API with a user model, dataset and loss, counting
DDP's gradient all-reduces with a comm hook. Writes {"syncs": N, "steps": S} from rank 0 to argv[1]."""


import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import paratrain


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def counting_allreduce(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state["syncs"] += 1
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def main(out_path: str, micro_batch_size: int, output_dir: str) -> None:
    config = paratrain.load_config(None, [
        "parallel.strategy=ddp", "train.max_steps=3", "train.global_batch_size=16",
        f"train.micro_batch_size={micro_batch_size}", f"run.output_dir={output_dir}",
        "checkpoint.save_final=false", "parallel.ddp.bucket_cap_mb=0.0001",
    ])
    features = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(features, features.sum(dim=1, keepdim=True))
    trainer = paratrain.Trainer(config, model_factory=build_model, dataset=dataset, loss_fn=torch.nn.functional.mse_loss)
    state = {"syncs": 0}
    trainer.model.register_comm_hook(state, counting_allreduce)
    result = trainer.train()
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump({"syncs": state["syncs"], "steps": result.steps, "loss": result.final_loss}, handle)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
