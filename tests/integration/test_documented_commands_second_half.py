"""The other half of the docs' recipes (see test_documented_commands.py, which also checks that every
documented command has an entry): a file of its own, so pytest-xdist's --dist loadfile runs the two halves
on different workers."""

from __future__ import annotations

import pytest

from tests.integration.test_documented_commands import SECOND_HALF, run_recipe, slug


@pytest.mark.parametrize("recipe", SECOND_HALF, ids=slug)
def test_documented_command_runs_as_written(recipe, tmp_path):
    run_recipe(recipe, tmp_path)
