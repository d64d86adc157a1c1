"""A replica group's rank that waits to ask for a quorum again stops as soon as a stop signal comes: torchrun,
stopping a group one of whose ranks died, waits for it, and every live group waits for that group."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from paratrain.launch.preemption import StopSignals
from paratrain.launch.quorum import pause_unless_stopped


def test_a_pause_before_asking_again_ends_when_a_stop_signal_comes():
    signals = StopSignals.install(torch.device("cpu"))  # paratrain's handler: it records the signal and returns
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        assert pause_unless_stopped(600.0) == "SIGTERM"
        assert time.monotonic() - started < 300  # not the 600 s pause: a handler that returns resumes time.sleep
    finally:
        signals.uninstall()


def test_a_pause_without_a_stop_signal_lasts_its_time():
    signals = StopSignals.install(torch.device("cpu"))
    try:
        started = time.monotonic()
        assert pause_unless_stopped(0.3) is None
        assert time.monotonic() - started >= 0.3
    finally:
        signals.uninstall()
