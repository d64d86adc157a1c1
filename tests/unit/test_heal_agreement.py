"""A replica group's ranks telling each other whether they healed (paratrain.launch.heal_agreement), through a
real in-process store: one thread per rank, no process launched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from paratrain.launch.heal_agreement import healed_ranks


@pytest.mark.parametrize("healed", [(True, True, True), (False, False, False), (True, False, True)])
def test_every_rank_counts_the_same_healed_ranks(healed):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    with ThreadPoolExecutor(len(healed)) as ranks:
        counts = list(
            ranks.map(
                lambda rank: healed_ranks(healed[rank], store=store, rank=rank, ranks=len(healed)),
                range(len(healed)),
            )
        )
    assert counts == [sum(healed)] * len(healed)


def test_a_rank_that_never_answers_ends_the_wait_with_the_stores_timeout():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.5))
    with pytest.raises(dist.DistStoreError):
        healed_ranks(True, store=store, rank=0, ranks=2)
