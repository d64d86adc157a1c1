"""Options of the whole suite."""

from __future__ import annotations

import gc

import pytest
import torch

from tests import suite_budget


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


# The files that take the longest (seconds in a full `make test` before the suite's launches were cut), marked
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
    "tests/parity/test_hf_experts_match_single.py",  # ~150-330 s: 4 transformers MoE families x 5 layouts, LoRA
)


def pytest_configure(config) -> None:
    suite_budget.configure(config)
    # The pytest-xdist workers share the cores with the processes they start: an in-process run on torch's
    # default (a thread per core) oversubscribes them. One thread, as each launched worker has
    # (OMP_NUM_THREADS=1: the harness's setting, and torchrun's default for several workers).
    torch.set_num_threads(1)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with a lane for the files that mostly wait (tests/scheduling.py)."""
    if config.getoption("dist") == "loadfile":
        from tests.scheduling import WaitingLaneScheduling  # the hook runs only where xdist is installed

        return WaitingLaneScheduling(config, log)
    return None


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid.split("::")[0] in SLOW_FILES:
            item.add_marker("slow")


def pytest_collection_finish(session) -> None:
    """The objects of the imports collection made (torch, transformers: ~300k) leave the garbage collector's
    reach, as ``paratrain.train`` does before a worker trains: every in-process run's closing ``gc.collect``
    then walks only what tests made since (it took a third of a tiny run's time)."""
    gc.freeze()


_file_running: list[str] = [""]


def pytest_runtest_setup(item) -> None:
    """At each file's first test, what earlier files left alive (transformers' modules, imported since
    collection: ~130k objects) leaves the collector's reach too, after one collection frees what they left
    as garbage. Each in-process run's ``gc.collect`` (two a run) walked them all again: ~70 ms each."""
    path = item.nodeid.split("::")[0]
    if path != _file_running[0]:
        _file_running[0] = path
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def _kernel_settings_restored():
    """A run trained in this process under train.deterministic=true switches torch's deterministic algorithms on
    and its flash and memory-efficient attention off for the whole process (paratrain.cuda_settings), as a
    user's would: a later test in the same worker then computed attention another way (TRL's DPO loss moved by
    2e-4 after the golden-loss test). Each test finds torch's settings as they were before it."""
    backends = torch.backends.cuda
    sdpa = (backends.flash_sdp_enabled, backends.mem_efficient_sdp_enabled, backends.cudnn_sdp_enabled)
    saved_sdpa = [enabled() for enabled in sdpa]
    deterministic, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    benchmark = torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    for enable, enabled in zip(
        (backends.enable_flash_sdp, backends.enable_mem_efficient_sdp, backends.enable_cudnn_sdp), saved_sdpa
    ):
        enable(enabled)
