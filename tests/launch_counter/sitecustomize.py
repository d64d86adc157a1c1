"""Counts Python processes for the suite's budget (tests/suite_budget.py): the suite puts this directory on
the PYTHONPATH of everything its tests start, so each interpreter, as it starts, appends one line (its pid
and command) to the file PARATRAIN_TEST_LAUNCH_LOG names, which the suite points at the running test's file.
Outside the suite the variable is unset and this does nothing.

multiprocessing's resource tracker, which the launcher's forkserver starts beside itself, is not counted: it
imports no torch, and torch's imports are the cost the budget stands for (the forkserver, which imports
paratrain.train for every worker it forks, is)."""

import os
import sys

_log = os.environ.get("PARATRAIN_TEST_LAUNCH_LOG")
_resource_tracker = any("multiprocessing.resource_tracker" in arg for arg in getattr(sys, "orig_argv", ()))
if _log and not _resource_tracker:
    try:
        with open(_log, "a") as _file:  # one short append per process: whole lines, whatever runs beside it
            _file.write(f"{os.getpid()} {' '.join(sys.argv[:3])}\n")
    except OSError:
        pass
