"""Fault-tolerant replica groups on torchft: each rank's side of a step across groups (``ReplicaGroupSync``),
the one object the trainer calls at a few points of its loop (``NoReplicaGroups`` where groups are off).
The lighthouse they meet through is ``launch/lighthouse.py``.

Each replica group is its own torchrun job. Rank i of every group joins one torchft ``Manager`` per rank;
the managers agree at every step on which groups are alive (the quorum, through the lighthouse: asked as the
step starts, awaited once the group's own slice is computed), average rank i's gradients over the live groups
through torchft's gloo process group, and commit the step only where every rank of a group succeeded. A group
that died is left out of the quorum until it is back; when it rejoins, torchft sends it a live peer's state
(model, optimizer, scheduler, data position and step) over its checkpoint transport: it reads no checkpoint.
While groups are missing, the live ones compute the missing groups' slices too under ``batch: fixed``
(``launch/group_shares.py`` decides who computes what), or skip them under ``shrink``.

How a rank joins, building its torchft Manager, is ``launch/joining_groups.py``. torchft is an optional
dependency (``pip install 'paratrain[ft]'``): imported only when groups are on.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config.schema import FaultToleranceConfig
from paratrain.engine import Engine
from paratrain.launch import faults
from paratrain.launch.group_shares import Coverage, coverage, plan_shares, read_coverage
from paratrain.launch.heal_agreement import check_every_rank_healed_alike
from paratrain.launch.preemption import StopSignals, stop_vote, voted_stop
from paratrain.launch.quorum import RETRY_PAUSE_S, join_quorum_or_stop
from paratrain.launch.stuck_vote import StuckVoteWatch
from paratrain.launch.taking_part import average_over_groups, participating_groups
from paratrain.launch.torchft_adapters import apply_received_state_now, take_part_though_healed
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
        healed_takes_part: Whether a group healed at start-up takes part in that quorum's step (not for a stream).
        readable_while_computing: Whether a peer may read this rank's state while it computes (asked at start-up).
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
        healed_takes_part: bool = True,
        readable_while_computing: Callable[[], bool] = lambda: False,
    ):
        self.manager, self.options, self.process_group, self.read_slice = manager, options, process_group, read_slice
        self.replica_groups, self.group, self.batch = options.replica_groups, options.replica_group, options.batch
        self.counts, self.rank, self.local_rank, self.heal_store = counts, rank, local_rank, heal_store
        self.stuck_vote, self.healed_takes_part = stuck_vote, healed_takes_part
        self.readable_while_computing, self.state_held_while_computing = readable_while_computing, True
        # quorum_asked: the step's, not yet awaited; in_quorum_for_next_step: healed at start-up, in that step.
        self.healed, self.started, self.quorum_asked, self.in_quorum_for_next_step = False, False, False, False
        self.coverage: Coverage | None = None  # the newest step's, None when its all-reduce failed
        self.stop_signal: signal.Signals | None = None  # the groups' vote in the newest step's all-reduce

    def heals_instead_of_resuming(self) -> bool:
        """A started group first joins the quorum, checkpoint or not: a live peer's state (newer than any
        checkpoint) replaces the resume, and only a group that finds none (every group died, or the run is
        new) reads its own checkpoint, if it has one; then no group steps in this quorum (every one in it is
        starting): those resuming from checkpoints of different steps meet at the next, where the ones behind
        heal from the newest. A group that healed takes part in this quorum's step (``launch/taking_part.py``): in
        another the live ones would wait for its all-reduce until ``timeout_s``. Every rank of the group heals or none
        does (``launch/heal_agreement.py``): a split stops it with IncompleteHeal."""
        self.state_held_while_computing = not self.readable_while_computing()
        healed = self.start_step()
        check_every_rank_healed_alike(healed, store=self.heal_store, rank=self.rank, group=self.group)
        self.in_quorum_for_next_step = healed
        return healed

    def forward_backward(
        self, engine: Engine, micro_batches: list[Any], parameters: Iterable[nn.Parameter]
    ) -> torch.Tensor:
        """Accumulates the gradients of this group's slices (its own, computed while the step's quorum forms, and
        under ``batch: fixed`` those of the missing groups it takes over once the quorum is known), each through the
        engine as the missing group would have, then averages them over the live groups in place: the step equals
        one over the whole global batch (``fixed``) or over the live groups' slices (``shrink``). Returns the step's
        loss, averaged the same way."""
        try:
            loss = engine.forward_backward(micro_batches).detach().clone().float()
        finally:
            self.manager.allow_state_dict_read()
        self._await_quorum()
        pg = self.process_group
        live = participating_groups(
            self.manager, pg.quorum_members, pg.last_quorum, group=self.group, replica_groups=self.replica_groups,
            device=loss.device, on_failure=self._close_cross_group_connections,
        )  # fmt: skip
        self.counts.live = len(live)
        shares = plan_shares(live, group=self.group, replica_groups=self.replica_groups, batch=self.batch)
        for other in shares.slices[1:]:
            loss += engine.forward_backward(self.read_slice(other)).float()
        local = [local_part(param.grad) for param in parameters if param.grad is not None]
        if shares.scale != 1.0:  # exactly 1 with every group live: nothing changes then
            for tensor in [*local, loss]:
                tensor.mul_(shares.scale)
        counts = torch.tensor(coverage(shares.slices, replica_groups=self.replica_groups), device=loss.device)
        votes = stop_vote(loss.device)  # every group then stops at the same boundary
        average_over_groups(self.manager, [*local, loss, counts, votes], taking_part=len(live))
        failed = self.manager.errored() is not None  # the sums are then partial: the step commits nowhere
        if failed:
            self._close_cross_group_connections()
        self.coverage = None if failed else read_coverage((counts * len(live)).tolist())
        self.stop_signal = None if failed else voted_stop(votes.tolist())
        return loss

    def agreed_stop(self, stop: StopSignals) -> signal.Signals | None:
        """The signal every group stops on after this step (any group's vote in it); ``stop`` agrees the next vote."""
        stop.agreed_signal()
        return self.stop_signal

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
        """Asks for this step's quorum; True when this group was healed from a live peer since the last step
        started (the caller then reads data from the position it received). The run's first quorum, which heals
        a restarted group, is awaited here; later ones in ``forward_backward``, after the group's own slice."""
        if self.in_quorum_for_next_step:  # healed at start-up, in the quorum the live groups are stepping in
            self.in_quorum_for_next_step = False
            return True
        if not self.started:
            self.started = True
            self._join_quorum()
            self._wait_for_every_group(first_step=True)
            if self.healed and self.healed_takes_part:  # healed before computing anything
                take_part_though_healed(self.manager, self.process_group.last_quorum)
            return self._healed_since_asked()
        if self.state_held_while_computing:  # a peer healing in this quorum reads it once the own slice is done
            self.manager.disallow_state_dict_read()
        self.manager.start_quorum()
        self.quorum_asked = True
        return self._healed_since_asked()

    def _healed_since_asked(self) -> bool:
        healed, self.healed = self.healed, False
        return healed

    def _await_quorum(self) -> None:
        """Waits for the quorum asked as the step started (asked again while the lighthouse is away)."""
        if self.quorum_asked:
            self.quorum_asked = False
            self._join_quorum(asked=True)
            if faults.fires("wait_for_groups", step=self.manager.current_step() + 1, rank=self.rank):
                self._wait_for_every_group(first_step=False)  # a test's fixed point: a restarted peer is back first

    def _wait_for_every_group(self, *, first_step: bool) -> None:
        """At a run's first step every group is awaited (up to quorum_timeout_s), so that none steps alone on its
        shards while the others are still starting; a group joining a run under way waits for no one (the missing
        may be dead). Fault injection's ``wait_for_groups`` waits at a later step, for tests whose timing must not
        depend on the machine, for as long as a peer whose request met a dying lighthouse takes to ask again."""
        quorum_timeout_s = self.options.quorum_timeout_s
        patience = quorum_timeout_s if first_step else 2 * quorum_timeout_s + RETRY_PAUSE_S
        deadline = time.monotonic() + patience
        while (  # the quorum's members, healing or not (torchft's count leaves a healing one out)
            len(self.process_group.quorum_members) < self.replica_groups
            and (self.manager.current_step() == 0 or not first_step)
            and not self.healed
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
            self._join_quorum()

    def _join_quorum(self, *, asked: bool = False) -> None:
        """The step's quorum (``asked``: under way, only its wait left), and a peer's state applied at once."""
        join_quorum_or_stop(
            self.manager, self.options, group=self.group, local_rank=self.local_rank, watch=self.stuck_vote, asked=asked
        )
        apply_received_state_now(self.manager)

    def set_step(self, step: int) -> None:
        """The step a checkpoint resumed this group at, for the quorum: groups behind the newest heal from it."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def _close_cross_group_connections(self) -> None:
        """A peer's death fails the all-reduce at once only for the ranks gloo connects to it; the others waited out
        ``timeout_s`` (5 s a kill in the chaos benchmark). Closing this rank's connections fails theirs at once; the
        failed commit gives the next quorum a new id, for which every group configures a new process group."""
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

    def agreed_stop(self, stop: StopSignals) -> signal.Signals | None:
        return stop.agreed_signal()

    def set_step(self, step: int) -> None:
        pass

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def log_fields(self, *, global_batch_size: int) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
