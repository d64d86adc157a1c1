"""How a rank joins its replica groups: the torchft Manager it builds (one lighthouse id per group, the address
published to the group's other ranks), what a recovering peer receives and how a healed rank applies it, and the
``ReplicaGroupSync`` the trainer then calls (``NoReplicaGroups`` where groups are off)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from paratrain.config.schema import FaultToleranceConfig
from paratrain.launch import faults
from paratrain.launch.heal_agreement import heal_store
from paratrain.launch.heal_payload import ModelShards, SameLayoutOptimizerState
from paratrain.launch.lighthouse import import_torchft
from paratrain.launch.replica_groups import GroupCounts, NoReplicaGroups, ReplicaGroupSync
from paratrain.launch.stuck_vote import StuckVoteWatch, group_ranks_on_this_host
from paratrain.launch.torchft_adapters import (
    announce_restart,
    connecting_within,
    one_lighthouse_id_per_group,
    quorum_requests_in_daemon_threads,
    recording_quorum_steps,
    remembering_quorum_members,
    weights_only_transport,
)
from paratrain.parallel.dims import ParallelDims

logger = logging.getLogger("paratrain")
# What a group restarting after a failure takes from a live peer is a resume's state without the RNG: each
# rank keeps its own seeds.
NOT_SENT_WHEN_HEALING = ("rng",)


class StepFeed(Protocol):
    """What of the run's data the replica groups use (``data.feed.DataFeed`` has it)."""

    streaming: bool

    def slice_batches(self, dp_rank: int) -> list[Any]: ...


def maybe_join_replica_groups(
    options: FaultToleranceConfig,
    *,
    dims: ParallelDims,
    device: torch.device,
    state: Callable[[], dict[str, Any]],
    feed: StepFeed,
) -> ReplicaGroupSync | NoReplicaGroups:
    """This rank's side of the replica groups when the run is one of several, else ``NoReplicaGroups``.

    Args:
        dims: The layout (``ft_enabled``: whether it has replica groups; where this rank reads in its group).
        state: Every Stateful of a resume, under the names checkpoints use: a recovering peer receives it
            (less the RNG), and a healed group loads what a live peer sent into it.
        feed: The run's data (``data.feed.DataFeed``): reader r's micro-batches of the step being taken, and whether
            it is a stream, whose position a healing group receives past the step's batch: such a group then takes
            no part in the step it healed in (``launch/taking_part.py``).
    """
    if not dims.ft_enabled:
        return NoReplicaGroups()

    sent: dict[str, Any] = {}

    def healing_state() -> dict[str, Any]:
        # The same parts at every heal: the model's shards, once read, are the weights themselves (ModelShards).
        if not sent:
            sent.update(
                (name, sent_to_a_peer(name, part))
                for name, part in state().items()
                if name not in NOT_SENT_WHEN_HEALING
            )
        return sent

    def readable_while_computing() -> bool:
        # A stream's position is read past the step's batch, so a peer reads it once the batch is drawn.
        return not feed.streaming and healing_state()["model"].reads_weights_alone()

    def heal(received: dict[str, Any]) -> None:
        for name, part in healing_state().items():
            part.load_state_dict(received[name])
        logger.info("healed from a live replica group, no checkpoint read")

    return build_replica_group_sync(
        options,
        device=device,
        state_dict=lambda: {name: part.state_dict() for name, part in healing_state().items()},
        load_state_dict=heal,
        # Rank i of a live group reads what rank i of the missing group would: the same place in its group.
        read_slice=lambda group: feed.slice_batches(group * dims.group_dp + dims.group_dp_rank),
        counts=GroupCounts(),
        healed_takes_part=not feed.streaming,
        readable_while_computing=readable_while_computing,
    )


def sent_to_a_peer(name: str, part: Any) -> Any:
    """What of the Stateful ``part`` (a checkpoint's entry ``name``) a recovering peer receives and loads: every
    group builds the same model and optimizer on the same inner layout, so they go as this rank's shards, the
    optimizer as its own state dict (``launch/heal_payload.py``)."""
    if name == "optimizer":
        return SameLayoutOptimizerState(part.optimizer)
    return ModelShards(part) if name == "model" else part


def build_replica_group_sync(
    options: FaultToleranceConfig,
    *,
    device: torch.device,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
    read_slice: Callable[[int], list[Any]],
    counts: GroupCounts,
    healed_takes_part: bool = True,
    readable_while_computing: Callable[[], bool] = lambda: False,
) -> ReplicaGroupSync:
    """This rank's Manager, joined to the group's torchrun store (MASTER_ADDR/MASTER_PORT, RANK/WORLD_SIZE).

    Args:
        state_dict: What a recovering peer receives (every Stateful of a resume).
        load_state_dict: Applies what a live peer sent, when this group heals.
        read_slice: Group h's micro-batches of the step being taken, for this rank (``batch: fixed``).
    """
    torchft = import_torchft("replica groups")
    for name in ("torchft", "torchft_quorums", "torchft_commits"):  # per-step notes that drown the log
        logging.getLogger(name).setLevel(logging.ERROR)
    timeout = timedelta(seconds=options.timeout_s)
    # gloo for CPU tensors; NCCL where the gradients live on GPUs (torchtitan's choice too).
    if device.type == "cuda":
        base = torchft.ProcessGroupNCCL
    else:
        base = connecting_within(torchft.ProcessGroupGloo, timedelta(seconds=options.rendezvous_timeout_s))
    pg = remembering_quorum_members(base)(timeout=timeout)
    sync: ReplicaGroupSync | None = None

    def load_and_mark(state: dict[str, Any]) -> None:
        # A peer's state is here, not yet applied: a kill now is a group dying while it heals.
        faults.maybe_kill("mid_heal", step=manager.current_step(), rank=sync.rank)
        load_state_dict(state)
        sync.healed = True

    rank = int(os.environ.get("RANK", 0))
    faults.maybe_late_on_restart("late_manager_on_restart", rank=rank)
    with manager_address_published(rank):
        manager = _new_manager(torchft, options, pg=pg, load_state_dict=load_and_mark, state_dict=state_dict)
    recording_quorum_steps(manager, pg)
    sync = ReplicaGroupSync(
        manager,
        options=options,
        process_group=pg,
        read_slice=read_slice,
        counts=counts,
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        heal_store=heal_store(timeout),
        stuck_vote=StuckVoteWatch.start(siblings=group_ranks_on_this_host()),
        healed_takes_part=healed_takes_part,
        readable_while_computing=readable_while_computing,
    )
    return sync


def _new_manager(
    torchft: Any,
    options: FaultToleranceConfig,
    *,
    pg: Any,
    load_state_dict: Callable[[dict[str, Any]], None],
    state_dict: Callable[[], dict[str, Any]],
) -> Any:
    timeout = timedelta(seconds=options.timeout_s)
    with one_lighthouse_id_per_group(torchft):
        manager = torchft.Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=options.min_replica_groups,
            # The quorum forms while the group computes its own slice (ReplicaGroupSync.forward_backward); a
            # group behind the newest step heals in it (who takes part in that step: launch/taking_part.py).
            use_async_quorum=True,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
            connect_timeout=timedelta(seconds=options.connect_timeout_s),
            lighthouse_addr=options.lighthouse,
            replica_id=f"paratrain_{options.replica_group}",
            checkpoint_transport=weights_only_transport(timeout),
            # Every group builds the same initial weights from train.seed: nothing to send at step 0.
            init_sync=False,
        )
    announce_restart(manager)
    quorum_requests_in_daemon_threads(manager)
    return manager


@contextlib.contextmanager
def manager_address_published(rank: int) -> Iterator[None]:
    """Holds the group's other ranks back until rank 0's Manager has written its address to the store.

    torchft's Manager publishes rank 0's server address under a fixed key of the torchrun store, and
    every other rank reads that key at once. A multi-node torchrun (static rendezvous) keeps its first
    store across ``--max-restarts``, so a restarted rank could read the failed attempt's address and
    never connect. The group's own process group is fresh per attempt (``init_distributed``), so its
    barrier orders the write before the reads.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()
