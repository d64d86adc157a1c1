"""benchmarks/mfu.py's CPU variant, as a smoke test: the script CI cannot run on a GPU still runs
paratrain end to end on both layouts and reports figures that are numbers."""

from __future__ import annotations

import math

from tests.tools.benchmark_scripts import load_benchmark


def test_cpu_variant_trains_fsdp_and_ddp_and_reports_finite_throughput(capsys, tmp_path):
    results = load_benchmark("mfu").main(["--cpu", "--steps", "8", "--skip-steps", "4", "--out-dir", str(tmp_path)])
    assert [result.layout for result in results] == ["fsdp", "ddp"]
    for result in results:
        assert result.tokens_per_s > 0 and math.isfinite(result.tokens_per_s)
        assert 0 < result.mfu_matmul < 10 and result.mfu_peak is None  # no peak is known for a CPU
    printed = capsys.readouterr().out
    assert "measured torch.float32 matmul" in printed and "ddp / fsdp tokens/s" in printed
