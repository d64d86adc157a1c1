"""paratrain: PyTorch-native distributed training where the layout is a config setting.

Python API::

    import paratrain
    config = paratrain.load_config("config.yaml", ["train.max_steps=100"])
    trainer = paratrain.Trainer(config, model_factory=build_model, dataset=my_dataset, loss_fn=my_loss,
                                eval_dataset=my_validation_set, callbacks=[MyCallback()])
    result = trainer.train()
    trainer.close()
"""

from paratrain.config.loading import load_config
from paratrain.config.schema import Config
from paratrain.errors import CheckpointError, ConfigError

__all__ = ["CheckpointError", "Config", "ConfigError", "TrainResult", "Trainer", "load_config"]


def __getattr__(name: str):
    # Lazy: the trainer pulls in DCP, DTensor and FSDP (a second or more of imports): load it on first
    # use, so the CLI can reject a bad config, and torchrun start, without paying for it.
    if name in ("Trainer", "TrainResult"):
        from paratrain.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
