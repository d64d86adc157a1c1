"""Fault-tolerant replica groups on torchft: each rank's side of a step across groups (``ReplicaGroupSync``),
the one object the trainer calls at a few points of its loop (``NoReplicaGroups`` where groups are off).
The lighthouse they meet through is ``launch/lighthouse.py``.

Each replica group is its own torchrun job. Rank i of every group joins one torchft ``Manager`` per rank;
the managers agree at the start of every step on which groups are alive (the quorum, through the
lighthouse), average rank i's gradients over the live groups through torchft's gloo process group, and
commit the step only where every rank of a group succeeded. A group that died is left out of the quorum
until it is back; when it rejoins, torchft sends it a live peer's state (``state_dict`` below: model,
optimizer, scheduler, data position and step) over its checkpoint transport, so it reads no checkpoint.
While groups are missing, the live ones also compute the missing groups' slices of the global batch under
``batch: fixed`` (``launch/group_shares.py`` decides who computes what), or skip them under ``shrink``.

How a rank joins, building its torchft Manager, is ``launch/joining_groups.py``. torchft is an optional
dependency (``pip install 'paratrain[ft]'``): imported only when groups are on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config.schema import FaultToleranceConfig
from paratrain.engine import Engine
from paratrain.errors import LighthouseLost
from paratrain.launch import faults
from paratrain.launch.group_shares import Coverage, coverage, plan_shares, read_coverage
from paratrain.launch.heal_agreement import check_every_rank_healed_alike
from paratrain.launch.preemption import announce_stop
from paratrain.launch.quorum import RETRY_PAUSE_S, join_quorum
from paratrain.launch.stuck_vote import StuckVoteWatch
from paratrain.tensors import local_part

logger = logging.getLogger("paratrain")


@dataclass
class GroupCounts:
    """What the replica groups did, for the log: carried in the healing state, so a healed group reports
    the run's totals."""

    live: int = 0  # groups in the newest step's quorum
    missing_group_steps: int = 0  # over committed steps, the slices nobody computed: their samples were skipped

    def state_dict(self) -> dict[str, int]:
        return {"missing_group_steps": self.missing_group_steps}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.missing_group_steps = int(state_dict["missing_group_steps"])


class ReplicaGroupSync:
    """One rank's side of each step across replica groups: ``start_step`` (quorum, and healing from a
    peer), ``forward_backward`` (this group's share of the batch, averaged over the live groups),
    ``should_commit``.

    Args:
        manager: The rank's torchft Manager (``build_replica_group_sync`` makes it).
        options: The ``parallel.fault_tolerance`` section: the groups, this group, the batch mode, timeouts.
        process_group: torchft's process group across the groups: it names the newest quorum's groups, and is
            closed when an all-reduce over it fails.
        read_slice: Group h's micro-batches of the step being taken, as this rank's counterpart in h reads them.
        rank: This rank within its group; ``local_rank``: within its node.
        heal_store: The group's store for its ranks' one agreement at start-up (None for one rank).
        stuck_vote: Ends this process when a stop signal finds it in a vote that a dead rank keeps open
            (``launch/stuck_vote.py``); None where signals cannot be watched (outside the main thread).
    """

    enabled = True

    def __init__(
        self,
        manager: Any,
        *,
        options: FaultToleranceConfig,
        process_group: Any,
        read_slice: Callable[[int], list[Any]],
        counts: GroupCounts,
        rank: int = 0,
        local_rank: int = 0,
        heal_store: dist.Store | None = None,
        stuck_vote: StuckVoteWatch | None = None,
    ):
        self.manager, self.options, self.process_group, self.read_slice = manager, options, process_group, read_slice
        self.replica_groups, self.group, self.batch = options.replica_groups, options.replica_group, options.batch
        self.counts, self.rank, self.local_rank, self.heal_store = counts, rank, local_rank, heal_store
        self.stuck_vote = stuck_vote
        self.healed, self.started = False, False
        # Healed in the start-up quorum: the live groups take that quorum's step, so this group's first is in it.
        self.in_quorum_for_next_step = False
        self.coverage: Coverage | None = None  # the newest step's, None when its all-reduce failed

    def heals_instead_of_resuming(self) -> bool:
        """A started group first joins the quorum, checkpoint or not: a live peer's state (newer than any
        checkpoint) replaces the resume, and only a group that finds none (every group died, or the run is
        new) reads its own checkpoint, if it has one; then no group steps in this quorum (every one in it is
        starting): those resuming from checkpoints of different steps meet at the next, where the ones behind
        heal from the newest. A group that healed takes its first step in this quorum, as the live ones do:
        joining another would leave them waiting for its all-reduce until ``timeout_s``. Every rank of the group
        heals or none does (``launch/heal_agreement.py``): a split stops the group with IncompleteHeal."""
        healed = self.start_step()
        check_every_rank_healed_alike(healed, store=self.heal_store, rank=self.rank, group=self.group)
        self.in_quorum_for_next_step = healed
        return healed

    def forward_backward(
        self, engine: Engine, micro_batches: list[Any], parameters: Iterable[nn.Parameter]
    ) -> torch.Tensor:
        """Accumulates the gradients of this group's slices (its own, and under ``batch: fixed`` those of the
        missing groups it takes over), each through the engine as the missing group would have, then averages
        them over the live groups in place: the step equals one over the whole global batch (``fixed``) or
        over the live groups' slices (``shrink``). Returns the step's loss, averaged the same way."""
        members = self.process_group.quorum_members  # the newest quorum's groups
        shares = plan_shares(members, group=self.group, replica_groups=self.replica_groups, batch=self.batch)
        loss = engine.forward_backward(micro_batches).detach().clone().float()
        for other in shares.slices[1:]:
            loss += engine.forward_backward(self.read_slice(other)).float()
        local = [local_part(param.grad) for param in parameters if param.grad is not None]
        if shares.scale != 1.0:  # exactly 1 with every group live: nothing changes then
            for tensor in [*local, loss]:
                tensor.mul_(shares.scale)
        counts = torch.tensor(coverage(shares.slices, replica_groups=self.replica_groups), device=loss.device)
        self.average([*local, loss, counts])
        participants = self.manager.num_participants()  # what the all-reduce divided the summed vectors by
        self.coverage = None if self.manager.errored() else read_coverage((counts * participants).tolist())
        return loss

    def checkpoint_state(self) -> dict[str, Any]:
        """The groups' counts, which survive the death of every group too (a plain run's resume leaves them out)."""
        return {"replica_groups": self.counts}

    def log_fields(self, *, global_batch_size: int) -> dict[str, int]:
        """The groups in the logged step, its effective batch (the slices computed), the samples of missing
        groups the live ones computed in it, and the samples skipped so far (slices nobody computed)."""
        counts, groups = self.counts, self.replica_groups
        computed = self.coverage.computed if self.coverage is not None else counts.live
        return {
            "replica_groups_live": counts.live,
            "effective_batch": global_batch_size * computed // groups,
            "taken_over_samples": global_batch_size * (computed - counts.live) // groups,
            "skipped_samples": global_batch_size * counts.missing_group_steps // groups,
        }

    def start_step(self) -> bool:
        """Joins this step's quorum; True when this group was just healed from a live peer (the caller
        then reads data from the position it received)."""
        if self.in_quorum_for_next_step:  # healed at start-up, in the quorum the live groups are stepping in
            self.in_quorum_for_next_step = False
            return True
        self.healed = False
        self._join_quorum()
        if not self.started:
            self.started = True
            self._wait_for_every_group(first_step=True)
        elif faults.fires("wait_for_groups", step=self.manager.current_step() + 1, rank=self.rank):
            self._wait_for_every_group(first_step=False)  # a test's fixed point: a restarted peer is back first
        self.counts.live = self.manager.num_participants()
        return self.healed

    def _wait_for_every_group(self, *, first_step: bool) -> None:
        """At a run's first step every group is awaited (up to quorum_timeout_s), so that none steps alone on
        its shards while the others are still starting. A group joining a run under way (healed from a
        peer, or a quorum past step 0) waits for no one: the missing groups may be dead. (Fault injection's
        ``wait_for_groups`` waits at a later step, for tests whose timing must not depend on the machine: long enough
        for a peer whose request went to a lighthouse that died meanwhile to ask again, after quorum_timeout_s and a
        pause; it stepped alone once when it waited quorum_timeout_s.)"""
        quorum_timeout_s = self.options.quorum_timeout_s
        patience = quorum_timeout_s if first_step else 2 * quorum_timeout_s + RETRY_PAUSE_S
        deadline = time.monotonic() + patience
        while (
            self.manager.num_participants() < self.replica_groups
            and (self.manager.current_step() == 0 or not first_step)
            and not self.healed
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
            self._join_quorum()

    def _join_quorum(self) -> None:
        """The step's quorum, asked again while the lighthouse is away (``launch/quorum.py``); past
        ``lighthouse_wait_s`` the group stops as a preempted one does (exit code 75), telling its launcher."""
        options, watch = self.options, self.stuck_vote
        try:
            with watch.asking_for_quorum() if watch is not None else contextlib.nullcontext():
                join_quorum(
                    self.manager,
                    lighthouse=options.lighthouse,
                    wait_s=options.lighthouse_wait_s,
                    group=self.group,
                    step=self.manager.current_step(),
                )
        except LighthouseLost as lost:
            logger.error("%s", lost)  # said before announcing: the launcher may stop this process once it knows
            announce_stop(local_rank=self.local_rank)
            raise

    def set_step(self, step: int) -> None:
        """The step a checkpoint resumed this group at, for the quorum: groups behind the newest heal from it."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Replaces each tensor (gradients, the step's loss) in place by its mean over the live groups: one
        all-reduce per dtype over the tensors flattened, not one per tensor (each is a round trip)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        flat = {dtype: torch.cat([tensor.reshape(-1) for tensor in group]) for dtype, group in by_dtype.items()}
        for work in [self.manager.allreduce(buffer) for buffer in flat.values()]:
            work.wait()
        if self.manager.errored() is not None:
            self._close_cross_group_connections()
        for dtype, group in by_dtype.items():
            for tensor, averaged in zip(group, flat[dtype].split([tensor.numel() for tensor in group])):
                tensor.copy_(averaged.view_as(tensor))

    def _close_cross_group_connections(self) -> None:
        """A peer's death fails the all-reduce at once only for the ranks gloo connects to it; the others wait
        out ``timeout_s`` for data from ranks that already failed (every live group stalled 5 s per kill in the
        chaos benchmark). Closing this rank's connections fails theirs at once. Nothing uses the closed group
        again: a failed commit gives the next quorum a new id (torchft's lighthouse), on which every group
        configures a new one."""
        self.process_group.abort(errored=False)

    def should_commit(self) -> bool:
        """Whether every rank of the group finished the step (torchft's vote) and the live groups computed
        every slice once (``shrink``: none twice); counts the slices a committed step skipped. Every live
        group reads the same summed coverage, so a step with a slice missing or repeated commits nowhere."""
        shares = self.coverage
        if shares is not None and not shares.complete(batch=self.batch):
            self.manager.report_error(
                RuntimeError(f"slices computed twice {shares.repeated}, by nobody {shares.missing}: step not taken")
            )
        faults.maybe_kill("before_vote", step=self.manager.current_step() + 1, rank=self.rank)
        with self.stuck_vote.voting() if self.stuck_vote is not None else contextlib.nullcontext():
            committed = self.manager.should_commit()
        if committed:
            computed = shares.computed if shares is not None else self.counts.live
            self.counts.missing_group_steps += self.replica_groups - computed
        return committed

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        if self.stuck_vote is not None:
            self.stuck_vote.close()


class NoReplicaGroups:
    """A run that is not one of several replica groups: every step is its own, committed, never healed."""

    enabled = False

    def heals_instead_of_resuming(self) -> bool:
        return False

    def start_step(self) -> bool:
        return False

    def forward_backward(
        self, engine: Engine, micro_batches: list[Any], parameters: Iterable[nn.Parameter]
    ) -> torch.Tensor:
        return engine.forward_backward(micro_batches)

    def should_commit(self) -> bool:
        return True

    def set_step(self, step: int) -> None:
        pass

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def log_fields(self, *, global_batch_size: int) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
