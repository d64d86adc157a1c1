"""The README is part of the product: its commands and its config reference must stay true."""

from __future__ import annotations

from paratrain.config.docs import BEGIN, END, render_reference
from tests.harness import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def test_readme_config_reference_matches_the_schema():
    block = README.split(BEGIN)[1].split(END)[0].strip()
    assert block == render_reference(), "run: python -m paratrain.config.docs README.md"


def test_readme_opens_with_the_demo_and_test_commands_that_ci_runs():
    opening = README.split("```")[1].splitlines()
    commands = [line.split("#")[0].strip() for line in opening[1:] if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (REPO_ROOT / ".ci/run").read_text()
