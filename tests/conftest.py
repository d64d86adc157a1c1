"""Options of the whole suite."""

from __future__ import annotations

import gc


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--rewrite-golden",
        action="store_true",
        help="rewrite tests/assets/losses/ from this run instead of comparing with it (after a deliberate change)",
    )
    parser.addoption(
        "--gpu-device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the gpu-marked tests (tests/gpu/) run: cuda (skipped below the GPUs each needs), or cpu "
        "with gloo, which checks the tests themselves and nothing of the CUDA paths",
    )


# The files that take the longest (seconds in the last full `make test` before issue 26's cuts), marked
# ``slow``: ``make test-fast`` (pytest -m "not slow") leaves them out for the inner loop; ``make test``, and
# so CI, runs them.
SLOW_FILES = (
    "tests/integration/test_documented_commands.py",  # 463 s with its second half: every docs command, real CLI
    "tests/integration/test_documented_commands_second_half.py",
    "tests/integration/test_combination_matrix.py",  # 234 s
    "tests/parity/test_resume_matrix.py",  # 132 s
    "tests/parity/test_hf_matches_single.py",  # 116 s, MoE cases included
    "tests/integration/test_resume.py",  # 94 s
    "tests/parity/test_context_parallel_matches_single.py",  # new with context parallel, with the MoE cases ~5 min
    "tests/integration/test_replica_groups.py",  # ~110 s: a lighthouse, two groups twice, a torchrun restart
)


# The suite's longest files, longest first (seconds of each file's tests summed, `--durations=0` of a full
# run beside another engineer's jobs, 2026-11-25: read them against each other). They run first: `make test`
# hands whole files to two workers (--dist loadfile) in collection order, so a long file collected last
# (tests/parity sorts after tests/integration) ran alone at the end while the other worker had run dry.
LONGEST_FIRST = (
    "tests/integration/test_documented_commands.py",  # 613 s
    "tests/integration/test_documented_commands_second_half.py",  # 475 s
    "tests/parity/test_resume_matrix.py",  # 393 s
    "tests/integration/test_combination_matrix.py",  # 335 s
    "tests/integration/test_resume.py",  # 319 s
    "tests/parity/test_context_parallel_matches_single.py",  # 282 s
    "tests/parity/test_hf_matches_single.py",  # 266 s
    "tests/parity/test_sharded_matches_single.py",  # 259 s
    "tests/parity/test_lora.py",  # 240 s
    "tests/integration/test_cli.py",  # 150 s
    "tests/parity/test_pipeline_matches_single.py",  # 143 s
    "tests/integration/test_multinode.py",  # 133 s
    "tests/integration/test_mlflow_server.py",  # 131 s
    "tests/integration/test_replica_groups.py",  # ~120 s (not in that run; 50 s in a quiet one)
    "tests/parity/test_ddp_matches_single.py",  # 113 s
    "tests/slurm/test_real_slurm.py",  # 105 s
)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _file_of(item) in SLOW_FILES:
            item.add_marker("slow")
    # Longest files first (a stable sort keeps each file's own order); every other file after them.
    items.sort(
        key=lambda item: LONGEST_FIRST.index(path) if (path := _file_of(item)) in LONGEST_FIRST else len(LONGEST_FIRST)
    )


def _file_of(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_finish(session) -> None:
    """The objects of the imports collection made (torch, transformers: ~300k) leave the garbage collector's
    reach, as ``paratrain.train`` does before a worker trains: every in-process run's closing ``gc.collect``
    then walks only what tests made since (it took a third of a tiny run's time)."""
    gc.freeze()
