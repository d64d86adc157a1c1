"""benchmarks/mfu.py's CPU variant, as a smoke test: the script CI cannot run on a GPU still runs
paratrain end to end on both layouts and reports figures that are numbers (issue 15)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mfu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("mfu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cpu_variant_trains_fsdp_and_ddp_and_reports_finite_throughput(capsys, tmp_path):
    results = load_script().main(["--cpu", "--steps", "8", "--skip-steps", "4", "--out-dir", str(tmp_path)])
    assert [result.layout for result in results] == ["fsdp", "ddp"]
    for result in results:
        assert result.tokens_per_s > 0 and math.isfinite(result.tokens_per_s)
        assert 0 < result.mfu_matmul < 10 and result.mfu_peak is None  # no peak is known for a CPU
    printed = capsys.readouterr().out
    assert "measured torch.float32 matmul" in printed and "ddp / fsdp tokens/s" in printed
