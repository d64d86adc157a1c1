"""A golden loss trace: the single-process run itself must not move unnoticed.

Parity compares every layout with one process, so a change that moves the one-process run too (weight
initialisation, data order, loss scaling, the schedule) passes every parity test. This trace of the tiny
GPT's first 20 losses under train.deterministic=true catches it, as torchtitan's losses/ assets do on CUDA.
After a deliberate change, rewrite it (and say why in the commit):

    .venv/bin/python -m pytest tests/unit/test_golden_losses.py --rewrite-golden
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import losses_by_step, run_cli_in_process, tiny_config, write_config

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "losses" / "tiny_gpt_cpu.txt"
STEPS = 20
# Not bit equality: CPU kernels reduce in an order that depends on the vector unit (AVX2, AVX-512), which
# moves fp32 losses in their 7th digit. Every change the trace is for moves step 1's loss by far more
# (another seed: ~1e-3; another initialisation or loss scaling: more).
RELATIVE_TOLERANCE = 1e-6


def read_trace(path: Path) -> dict[int, float]:
    rows = (line.split() for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {int(step): float(loss) for step, loss in rows}


def write_trace(path: Path, losses: dict[int, float]) -> None:
    header = "# step loss: tests/unit/test_golden_losses.py, tiny GPT, train.deterministic=true, one CPU process\n"
    path.write_text(header + "".join(f"{step} {loss!r}\n" for step, loss in sorted(losses.items())))


def tiny_gpt_losses(tmp_path: Path) -> dict[int, float]:
    output_dir = tmp_path / "golden"
    config = tiny_config(output_dir, train={"max_steps": STEPS, "deterministic": True})
    code, stderr = run_cli_in_process(["train", str(write_config(tmp_path / "golden.yaml", config))])
    assert code == 0, stderr
    return losses_by_step(output_dir)


def test_the_tiny_gpt_trains_along_its_golden_loss_trace(tmp_path, request):
    losses = tiny_gpt_losses(tmp_path)
    if request.config.getoption("--rewrite-golden"):
        write_trace(GOLDEN, losses)
        pytest.skip(f"rewrote {GOLDEN}")
    golden = read_trace(GOLDEN)
    assert sorted(losses) == sorted(golden) == list(range(1, STEPS + 1))
    moved = {
        step: (golden[step], losses[step])
        for step in golden
        if abs(losses[step] - golden[step]) > RELATIVE_TOLERANCE * abs(golden[step])
    }
    assert not moved, (
        f"the one-process run left its golden trace at steps {sorted(moved)} (golden, now: {moved}); if the change "
        f"was meant, rewrite it with `pytest {Path(__file__).relative_to(GOLDEN.parents[3])} --rewrite-golden`"
    )
