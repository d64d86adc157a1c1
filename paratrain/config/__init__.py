"""The config tree: schema (one typed tree), loading and overrides, reference docs and the factories a
config names. It imports only leaves (``errors``); the checks that read the whole config against the
packages it configures live above them, in ``paratrain.checks``.

The root :class:`Config` is seen only by the CLI, the per-rank entry, the Trainer and the checks; everything
else receives its own section.
"""

from paratrain.config.loading import load_config
from paratrain.config.schema import Config

__all__ = ["Config", "load_config"]
