"""The docs' commands are tests: each runs as a user would type it (see documented_commands.py).

A user who copies a command from README.md, docs/ or an example's header gets what the docs promise; a
command changed, added or broken in the docs without its entry here fails the suite.

The recipes are split over this file and test_documented_commands_second_half.py (every other recipe):
``make test`` runs each file whole on one pytest-xdist worker (--dist loadfile), and all 25 recipes in one
file (7-8 minutes) kept one worker busy long after the other had run out of files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import suite_budget, warm_python
from tests.harness import REPO_ROOT, in_private_network, private_network_unavailable
from tests.integration.documented_commands import COMMANDS, Elsewhere, Run, argv_of, commands_in_docs

# Commands of one recipe in order; a command without a recipe is a recipe of its own.
RECIPES: dict[str, list[str]] = {}
for _command, _entry in COMMANDS.items():
    if isinstance(_entry, Run):
        RECIPES.setdefault(_entry.recipe or _command, []).append(_command)


def test_every_documented_command_has_an_entry_and_every_entry_is_documented():
    documented = commands_in_docs()
    registered = {argv_of(command): command for command in COMMANDS}
    unlisted = [
        f"{' '.join(argv)}   (in {', '.join(where)})" for argv, where in documented.items() if argv not in registered
    ]
    assert not unlisted, "documented commands the suite does not run; add each to COMMANDS in " + (
        "tests/integration/documented_commands.py:\n" + "\n".join(unlisted)
    )
    stale = [command for argv, command in registered.items() if argv not in documented]
    assert not stale, f"COMMANDS entries no doc shows any more (remove them): {stale}"


def test_every_scale_down_says_why_and_every_command_not_run_names_its_test():
    for command, entry in COMMANDS.items():
        if isinstance(entry, Run):
            assert bool(entry.scale_down) == bool(entry.why), command
        else:
            assert isinstance(entry, Elsewhere) and entry.why and entry.test, command


def slug(recipe: str) -> str:
    """A test id without spaces or '=' (which -k cannot take): paratrain-train-quickstart-parallel.tp-2-..."""
    return re.sub(r"[^\w.]+", "-", recipe.replace("examples/", "").replace(".yaml", "")).strip("-")


# Every other recipe, in COMMANDS' order, so that each half holds a like mix of one- and multi-process runs.
FIRST_HALF, SECOND_HALF = list(RECIPES)[::2], list(RECIPES)[1::2]


@pytest.mark.parametrize("recipe", FIRST_HALF, ids=slug)
def test_documented_command_runs_as_written(recipe, tmp_path):
    run_recipe(recipe, tmp_path)


# The docs' first recipe starts each command as the user's shell does: the console script in a new
# interpreter, importing everything cold. The others' `paratrain ...`, `python -m ...` and `python -c ...`
# commands run in a fork of the suite's warm interpreter (tests/warm_python.py): the same argv, directory and
# environment, without importing torch again (two CPU-seconds a command, most of a scaled-down command's cost).
STARTED_COLD = list(RECIPES)[0]


def run_recipe(recipe: str, tmp_path: Path) -> None:
    """The recipe's commands in order, as written plus their scale-downs, in a copy of examples/."""
    shutil.copytree(REPO_ROOT / "examples", tmp_path / "examples")  # the docs' paths are relative to the repo
    env = users_environment()
    for command in RECIPES[recipe]:
        entry = COMMANDS[command]
        argv = [*argv_of(command), *entry.scale_down]
        if entry.private_network:
            if reason := private_network_unavailable():
                pytest.skip(reason)
            argv = in_private_network(argv)
        warm = None if recipe == STARTED_COLD else in_warm_interpreter(argv)
        if warm:
            done = warm_python.run(warm, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        else:
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{output[-4000:]}"
        assert entry.output is None or entry.output in output, (
            f"{entry.output!r} not in the output of {command!r}:\n{output[-4000:]}"
        )


def in_warm_interpreter(argv: list[str]) -> list[str] | None:
    """``paratrain ARGS`` (the console script runs ``paratrain.cli``'s main), ``python -m MODULE ARGS`` or
    ``python -c CODE`` as the warm interpreter takes them; None for any other command (torchrun), run as written."""
    if argv[0] == "paratrain":
        return [sys.executable, "-m", "paratrain.cli", *argv[1:]]
    if argv[0] == "python" and argv[1:2] in (["-m"], ["-c"]):
        return [sys.executable, *argv[1:]]
    return None


def users_environment() -> dict[str, str]:
    """The environment of a user who activated the venv: its bin first on PATH (python, paratrain, torchrun),
    and none of the variables paratrain, trackers or the suite's fixtures read. The suite's launch counter
    (tests/suite_budget.py) stays: it counts processes and changes nothing they do."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PARATRAIN_", "MLFLOW_", "WANDB_")) or name in suite_budget.COUNTER_VARIABLES
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env
