"""How each rank logs: one voice on the terminal."""

from __future__ import annotations

import logging
import sys


def configure_logging(rank: int) -> None:
    """Rank 0 logs progress; other ranks only warnings, so the terminal shows one voice."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s paratrain: %(message)s"
        if rank == 0
        else f"%(asctime)s paratrain[rank {rank}]: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
