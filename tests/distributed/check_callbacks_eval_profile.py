"""Run under torchrun: trains an MLP with evaluation, the profiler, the built-in callbacks and a
recording callback, once per layout given (one after the other in the same processes). Each rank writes
OUTPUT_ROOT/<layout>/events-rank<R>.json; the test reads them and the runs' output directories.

Early stopping watches a ``probe`` field that rank 1 stops improving after step 2 while rank 0 keeps
improving: all ranks must stop at rank 1's step."""

import sys
from pathlib import Path

import torch.distributed as dist

import paratrain
from paratrain.callbacks.early_stopping import EarlyStopping
from paratrain.data.regression import build_regression_dataset
from paratrain.losses import mse
from paratrain.models.mlp import build_mlp
from tests.distributed.one_launch import count_each
from tests.distributed.recording_callback import RecordingCallback

MODEL_ARGS = {"in_features": 4, "hidden_features": 8, "num_hidden_layers": 2}
# 33 samples in global eval batches of 4 x 2 ranks: the last holds one sample, so rank 1 has none in it.
VALIDATION = {"size": 33, "in_features": 4, "seed": 99}


def overrides(strategy: str, output_dir: Path) -> list[str]:
    return [
        f"parallel.strategy={strategy}",
        f"run.output_dir={output_dir}",
        "checkpoint.resume=never",
        "train.max_steps=8",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "log.every_steps=4",
        "checkpoint.every_steps=4",
        "model.factory=paratrain.models.mlp:build_mlp",
        f"model.args={MODEL_ARGS}",
        "data.factory=paratrain.data.regression:build_regression_dataset",
        "data.args={size: 64, in_features: 4}",
        "loss.factory=paratrain.losses:mse",
        "eval.factory=paratrain.data.regression:build_regression_dataset",
        f"eval.args={VALIDATION}",
        "eval.every_steps=2",
        "eval.batch_size=4",
        "profile.enabled=true",
        "profile.wait=1",
        "profile.warmup=1",
        "profile.active=2",
        "callbacks=[{factory: 'paratrain.callbacks.memory:MemoryMonitor'}, "
        "{factory: 'paratrain.callbacks.throughput:ThroughputMonitor'}]",
    ]


def run(strategy: str, output_root: Path) -> dict:
    rank = dist.get_rank()
    recorder = RecordingCallback(
        model_factory=lambda: build_mlp(**MODEL_ARGS),
        validation=build_regression_dataset(**VALIDATION),
        loss_fn=mse(),
        events_path=output_root / strategy / f"events-rank{rank}.json",
        probe=lambda step: -step if rank == 0 else -min(step, 2),
    )
    config = paratrain.load_config(None, overrides(strategy, output_root / strategy))
    # The config's callbacks, then these: the recorder adds the probe before EarlyStopping reads it.
    trainer = paratrain.Trainer(config, callbacks=[recorder, EarlyStopping(monitor="probe", patience=2)])
    result = trainer.train()
    trainer.close()
    return {"steps": result.steps}


def main(out_path: str, output_root: str, strategies: list[str]) -> None:
    count_each(lambda strategy: run(strategy, Path(output_root)), strategies, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
