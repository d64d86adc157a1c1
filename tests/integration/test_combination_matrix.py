"""Every layout x every training option either trains or is refused before training.

Each combination of a layout (the resume matrix's) with one option (activation checkpointing, compile,
both, bf16, fp16, async checkpoints, evaluation, gradient accumulation) runs 3 steps: every loss
finite and the step-3 checkpoint written. Or preflight refuses it, before any process starts, with a
message that says what to use instead. No combination may crash mid-step. The table in
docs/layouts.md is this module's result.

Compile uses ``parallel.compile_backend=aot_eager``: dynamo traces forward and backward over the
layout's DTensors and hooks exactly as with inductor (where layouts used to break), without spending
10-15 s per run generating CPU kernels.

Launches: one-process runs train in the test process; the 2- and 4-process runs each in one launch
(tests/train_many.py).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from paratrain.checks.preflight import preflight
from paratrain.config.loading import load_config
from paratrain.errors import ConfigError
from tests.harness import read_metrics, tiny_config, train_in_this_process, train_many_in_one_launch, write_config
from tests.parity.test_resume_matrix import LAYOUTS as RESUME_LAYOUTS

STEPS = 3
LAYOUTS = {name: layout for name, layout in RESUME_LAYOUTS.items() if "async" not in name}
AC, COMPILE = "parallel.activation_checkpointing=true", ["parallel.compile=true", "parallel.compile_backend=aot_eager"]
OPTIONS: dict[str, list[str]] = {
    "activation checkpointing": [AC],
    "compile": COMPILE,
    "checkpointing + compile": [AC, *COMPILE],
    "bf16": ["precision=bf16"],
    "fp16": ["precision=fp16"],
    "async checkpoints": ["checkpoint.async_save=true"],
    "evaluation": [
        "eval.factory=paratrain.data.text:build_char_dataset",
        "eval.args={block_size: 16, max_chars: 4000}",
        "eval.max_batches=2",
    ],
    "accumulation 4": ["train.micro_batch_size=1"],  # global batch 8 over 2 data-parallel ranks at most
}
COMBINATIONS = [(layout, option) for layout in LAYOUTS for option in OPTIONS]

pytestmark = pytest.mark.timeout(900)  # the module's runs are trained by its fixture, within the first test


def _name(layout: str, option: str) -> str:
    return f"{layout}--{option}".replace(" ", "_").replace("+", "_")


class Matrix:
    """Preflight of every combination, then training of those it lets through."""

    def __init__(self, root: Path):
        self.root = root
        self.config = write_config(
            root / "base.yaml",
            tiny_config(root / "unused", train={"max_steps": STEPS}, checkpoint={"every_steps": STEPS}),
        )
        self.refusals: dict[tuple[str, str], str] = {}

    def overrides(self, layout: str, option: str) -> list[str]:
        return [*LAYOUTS[layout][0], *OPTIONS[option], f"run.output_dir={self.dir(layout, option)}"]

    def dir(self, layout: str, option: str) -> Path:
        return self.root / _name(layout, option)

    def run_all(self) -> None:
        accepted: dict[int, list[tuple[str, str]]] = {}
        for layout, option in COMBINATIONS:
            nproc = LAYOUTS[layout][1]
            try:
                preflight(
                    load_config(self.config, self.overrides(layout, option)), world_size=nproc, nproc_per_node=nproc
                )
            except ConfigError as refused:
                self.refusals[layout, option] = str(refused)
                continue
            accepted.setdefault(nproc, []).append((layout, option))
        for nproc, combinations in sorted(accepted.items(), reverse=True):
            if nproc == 1:
                for layout, option in combinations:
                    train_in_this_process(load_config(self.config, self.overrides(layout, option)))
            else:
                self._in_one_launch(combinations, nproc)

    def _in_one_launch(self, combinations: list[tuple[str, str]], nproc: int) -> None:
        runs = [(self.config, self.overrides(layout, option)) for layout, option in combinations]
        train_many_in_one_launch(runs, nproc, self.root / f"launch-{nproc}.json", timeout=800)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Matrix:
    matrix = Matrix(tmp_path_factory.mktemp("combinations"))
    matrix.run_all()
    return matrix


@pytest.mark.parametrize("layout,option", COMBINATIONS)
def test_combination_trains_three_steps_or_is_refused_naming_the_alternative(matrix, layout, option):
    refusal = matrix.refusals.get((layout, option))
    if refusal is not None:
        assert "not supported" in refusal and ("use " in refusal or "remove " in refusal), refusal
        return
    run = matrix.dir(layout, option)
    losses = [record["loss"] for record in read_metrics(run) if "loss" in record]
    assert len(losses) == STEPS and all(loss is not None and math.isfinite(loss) for loss in losses), losses
    assert (run / f"checkpoints/step-{STEPS}/paratrain-manifest.json").is_file()
    if option == "evaluation":
        assert any("eval_loss" in record for record in read_metrics(run))


def documented_table() -> dict[tuple[str, str], str]:
    """docs/layouts.md's combination table: (layout, option) -> its cell."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "layouts.md").read_text()
    section = text.split("## Combination matrix", 1)[1].splitlines()
    # The section's first table only: later sections have tables of their own.
    start = next(i for i, line in enumerate(section) if line.startswith("| "))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), section[start:]))
    rows = [row for row in rows if row.startswith("| ")]
    options = [cell.strip() for cell in rows[0].strip("|").split("|")[1:]]
    table = {}
    for row in rows[1:]:
        layout, *cells = (cell.strip() for cell in row.strip("|").split("|"))
        table.update({(layout, option): cell for option, cell in zip(options, cells, strict=True)})
    return table


def test_docs_table_shows_what_trains_and_what_is_refused(matrix):
    """docs/layouts.md lists every combination; a change to what preflight refuses must change it."""
    table = documented_table()
    assert set(table) == set(COMBINATIONS)
    documented_refusals = {combination for combination, cell in table.items() if cell.startswith("refused")}
    assert documented_refusals == set(matrix.refusals)
