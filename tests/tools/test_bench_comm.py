"""paratrain bench comm: bandwidths as nccl-tests defines them, consistent with the bytes it timed."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from paratrain.tools.bench_comm import bus_factor, operation_bytes, parse_size
from tests.harness import run_cli

FACTORS_AT_2 = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}


def test_bench_comm_on_two_processes_reports_bandwidths_consistent_with_the_timed_bytes(tmp_path):
    result = run_cli(
        [
            "bench",
            "comm",
            "--nproc-per-node",
            "2",
            "--sizes",
            "1KB",
            "3KB",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]

    bench = json.loads((tmp_path / "comm.json").read_text())
    assert (bench["backend"], bench["world_size"], bench["iters"], bench["warmup"]) == ("gloo", 2, 3, 1)
    rows = bench["results"]
    assert [(r["operation"], r["size_bytes"]) for r in rows] == [
        (op, size) for op in FACTORS_AT_2 for size in (1024, 3072)
    ]
    for row in rows:
        assert row["time_s"] > 0
        assert row["algbw_gbps"] * 1e9 * row["time_s"] == pytest.approx(row["size_bytes"], rel=1e-12)
        assert row["busbw_gbps"] / row["algbw_gbps"] == pytest.approx(FACTORS_AT_2[row["operation"]], rel=1e-12)
        printed = (
            f"{row['size_bytes']:>12}{row['time_s'] * 1e6:>12.1f}{row['algbw_gbps']:>14.4f}{row['busbw_gbps']:>14.4f}"
        )
        assert f"{row['operation']:<15}{printed}" in result.stdout.splitlines()
    with Image.open(tmp_path / "comm.png") as image:
        assert image.format == "PNG" and image.width >= 800


def test_bus_factors_are_nccl_tests_corrections():
    assert [bus_factor(op, 4) for op in FACTORS_AT_2] == [1.5, 0.75, 0.75, 1.0]
    assert [bus_factor(op, 2) for op in FACTORS_AT_2] == list(FACTORS_AT_2.values())


def test_sizes_are_binary_units_rounded_to_elements_that_split_over_the_ranks():
    assert [parse_size(text) for text in ("512", "64B", "1KB", "1k", "1.5MB", "2GiB")] == [
        512,
        64,
        1024,
        1024,
        1572864,
        2 * 1024**3,
    ]
    assert operation_bytes(1000, 3) == 996  # 83 float32 per rank
    assert operation_bytes(1, 2) == 8  # at least one element per rank
