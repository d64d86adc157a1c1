"""Which slices of a step's global batch each replica group computes when groups are missing
(``parallel.fault_tolerance.batch``), and the check that a step covered every slice once. Plain values in,
decisions out: ``ReplicaGroupSync`` acts on them.

The global batch is cut into one slice per replica group (group I's data-parallel ranks read slices
``I x group_dp ..``). Without failures each group computes its own slice and torchft's all-reduce averages
the groups' gradients: ``(1/N) sum_h g_h`` over the N groups. With only L groups live:

- ``shrink`` averages the live groups' slices alone, ``(1/L) sum_{h live} g_h``: a batch of ``B x L / N``.
- ``fixed`` shares the missing groups' slices out among the live ones, round robin over both sorted lists
  (missing group ``m_j`` goes to live group ``l_{j mod L}``), so every rank of every group can tell who
  computes what from the quorum alone. A live group sums the mean gradients of its slices and scales the
  sum by ``L / N``; the all-reduce's division by L then leaves ``(1/N) sum_h g_h``, the gradient of the
  whole global batch, as if no group were missing. With every group live the scale is exactly 1 and
  nothing changes.

Each group also all-reduces a coverage vector (1 at every slice it computed) with its gradients: a step
commits only when no slice was computed twice and, under ``fixed``, none was left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from paratrain.config.schema import ReplicaBatch


@dataclass(frozen=True)
class GroupShares:
    """One group's part of one step.

    Attributes:
        slices: The groups whose slices this group computes: its own first, then those it takes over.
        scale: What this group's summed gradients are multiplied by before the average over the live groups.
        live: How many groups the step's quorum holds.
    """

    slices: tuple[int, ...]
    scale: float
    live: int


def plan_shares(live: Iterable[int], *, group: int, replica_groups: int, batch: ReplicaBatch) -> GroupShares:
    """The slices ``group`` computes in a step taken by the groups ``live`` (``launch/taking_part.py``). A group
    not among them is healing in the step's quorum: torchft sends zeros for it, and it computes its own slice alone,
    for nothing (it was computed before the quorum was known)."""
    members = sorted(set(live))
    if group not in members:
        return GroupShares((group,), 1.0, len(members))
    missing = [other for other in range(replica_groups) if other not in members]
    if batch == "shrink" or not missing:
        return GroupShares((group,), 1.0, len(members))
    taken = tuple(other for index, other in enumerate(missing) if members[index % len(members)] == group)
    return GroupShares((group, *taken), len(members) / replica_groups, len(members))


def coverage(slices: Iterable[int], *, replica_groups: int) -> list[float]:
    """One number per slice of the global batch: how many times this group computed it (0 or 1)."""
    counts = [0.0] * replica_groups
    for index in slices:
        counts[index] += 1.0
    return counts


@dataclass(frozen=True)
class Coverage:
    """How the step's slices were computed across the live groups, read from the summed coverage vectors."""

    computed: int  # slices computed at least once
    repeated: tuple[int, ...]  # slices computed more than once
    missing: tuple[int, ...]  # slices nobody computed

    def complete(self, *, batch: ReplicaBatch) -> bool:
        """Whether the step may commit: no slice twice, and under ``fixed`` none left out."""
        return not self.repeated and (batch == "shrink" or not self.missing)


def read_coverage(summed: Iterable[float]) -> Coverage:
    """``summed``: every live group's coverage vector added up (rounded: it travelled as floats)."""
    counts = [round(value) for value in summed]
    return Coverage(
        computed=sum(count > 0 for count in counts),
        repeated=tuple(index for index, count in enumerate(counts) if count > 1),
        missing=tuple(index for index, count in enumerate(counts) if count == 0),
    )
