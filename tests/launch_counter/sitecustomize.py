"""Counts Python processes for the suite's budget (tests/suite_budget.py): the suite puts this directory on
the PYTHONPATH of everything its tests start, so each interpreter, as it starts, appends one line (its pid
and command) to the file PARATRAIN_TEST_LAUNCH_LOG names, which the suite points at the running test's file.
Outside the suite the variable is unset and this does nothing."""

import os
import sys

_log = os.environ.get("PARATRAIN_TEST_LAUNCH_LOG")
if _log:
    try:
        with open(_log, "a") as _file:  # one short append per process: whole lines, whatever runs beside it
            _file.write(f"{os.getpid()} {' '.join(sys.argv[:3])}\n")
    except OSError:
        pass
