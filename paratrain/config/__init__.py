"""The config tree: schema (one typed tree), loading and overrides, reference docs, warnings,
preflight checks and the factories a config names.

The root :class:`Config` is seen only by the CLI, the per-rank entry and the Trainer; everything
else receives its own section.
"""

from paratrain.config.schema import Config, load_config

__all__ = ["Config", "load_config"]
