"""The session's pool of gloo ranks for layer tests (see rank_pool.py)."""

from __future__ import annotations

import pytest

from tests.distributed.rank_pool import RankPool

POOL_WORLD_SIZE = 4  # enough for a 2 x 2 mesh (data parallel x tensor parallel) on two cores


@pytest.fixture(scope="session")
def _live_pools():
    pools: list[RankPool] = []
    yield pools
    for pool in pools:
        if not pool.broken:
            pool.close()


@pytest.fixture
def ranks(_live_pools) -> RankPool:
    """Four gloo ranks shared by every test of the session; a fresh set after a test broke the last."""
    if not _live_pools or _live_pools[-1].broken:
        _live_pools.append(RankPool(POOL_WORLD_SIZE))
    return _live_pools[-1]
