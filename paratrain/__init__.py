"""paratrain: PyTorch-native distributed training where the layout is a config setting.

Python API::

    import paratrain
    config = paratrain.load_config("config.yaml", ["train.max_steps=100"])
    trainer = paratrain.Trainer(config, model_factory=build_model, dataset=my_dataset, loss_fn=my_loss)
    result = trainer.train()
    trainer.close()
"""

from paratrain.config import Config, load_config
from paratrain.errors import CheckpointError, ConfigError
from paratrain.trainer import Trainer, TrainResult

__all__ = ["CheckpointError", "Config", "ConfigError", "TrainResult", "Trainer", "load_config"]
