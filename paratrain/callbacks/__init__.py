"""Callbacks: the interface (``Callback``, ``CallbackContext``) and built-ins in submodules
(``memory.MemoryMonitor``, ``throughput.ThroughputMonitor``, ``early_stopping.EarlyStopping``)."""

from paratrain.callbacks.base import Callback, CallbackContext

__all__ = ["Callback", "CallbackContext"]
