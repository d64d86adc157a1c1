"""Process-group set-up and tear-down, and the device and backend each rank uses.

A process started by torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) joins the
group through the store torchrun's agent hosts, under a prefix of its own per restart attempt (see
``_attempt_store``), or through ``env://`` where no agent store is shared. A lone process that still
needs a group (``ddp`` on one process) gets a one-rank group over an in-memory store, so it opens no
port.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from paratrain.errors import ConfigError
from paratrain.launch.peer_restarts import maybe_follow_peer_restarts


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: its rank, the world and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when no process group exists (a lone process that needs none)
    owns_group: bool = False  # created the process group, so destroys it when done

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size_from_env() -> int:
    """Processes in the job: torchrun's WORLD_SIZE, or 1 for a process started on its own."""
    return int(os.environ.get("WORLD_SIZE", 1))


def local_world_size_from_env() -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, or 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def pick_device(kind: Literal["auto", "cpu", "cuda"], local_rank: int) -> torch.device:
    """One device per process: ``cuda:LOCAL_RANK`` when CUDA is asked for or available, else CPU.

    Raises:
        ConfigError: CUDA was asked for but this rank has no GPU of its own.
    """
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    available = torch.cuda.device_count()
    if local_rank >= available:
        raise ConfigError(
            f"train.device={kind} needs a GPU for local rank {local_rank}, but this machine has "
            f"{available}; use train.device=cpu or start at most {available} processes per node"
        )
    return torch.device("cuda", local_rank)


def process_group_backend(device: torch.device, *, cpu_collectives: bool) -> str:
    """The backend string for ``init_process_group``: gloo on CPU, NCCL on CUDA.

    FSDP's CPU offload leaves gradients (DTensors) on the CPU, and gradient clipping's
    ``full_tensor()`` is then a collective on CPU tensors, which NCCL cannot run: such runs get
    gloo beside NCCL (``cuda:nccl,cpu:gloo``), as torchtitan does for offload.
    """
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def init_distributed(
    *,
    device_kind: Literal["auto", "cpu", "cuda"],
    needs_group: bool,
    timeout_s: float = 600.0,
    cpu_collectives: bool = False,
) -> DistContext:
    """Joins (or creates) the process group and binds this process to its device."""
    rank = int(os.environ.get("RANK", 0))
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_kind, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = process_group_backend(device, cpu_collectives=cpu_collectives)
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        # The caller's own group (a script that trains several times, or sets the group up itself):
        # join it, and leave it to the caller. Re-creating it under torchrun would reuse the
        # launcher's store keys and can connect to the previous group's peers (cf. pytorch#135712).
        return DistContext(rank, world_size, local_rank, device, dist.get_backend())
    if launched_by_torchrun():
        device_id = device if device.type == "cuda" else None
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            maybe_follow_peer_restarts(timeout)  # the agent's store outlives an attempt: a peer's restart shows there
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
            )
    elif needs_group:
        # device_id binds the one-process NCCL group to its GPU eagerly, as torchrun's path does.
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
    else:
        backend = None
    return DistContext(rank, world_size, local_rank, device, backend, owns_group=backend is not None)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The agent's store under ``paratrain/attempt_<TORCHELASTIC_RESTART_COUNT>/``, when torchrun shares one.

    torch's workers join the agent's store with no per-attempt prefix, on the promise that every
    restart gets a fresh store; the static rendezvous (multi-node) keeps its first store for the
    whole job (pytorch#135712), so a group restarted by ``--max-restarts`` read the failed attempt's
    addresses and could not connect. Under paratrain's launcher the attempt numbers agree across
    nodes: its multi-node runs use the static rendezvous, where a worker's death fails every node's
    group and each agent counts one restart. (torchrun's c10d rendezvous also restarts a healthy node
    when another node rejoins, without counting it, so there the numbers could drift apart.)
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    return attempt_store(timeout)


def attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """A client of torchrun's store (MASTER_ADDR, MASTER_PORT) under ``paratrain/attempt_<n>/``: keys of this
    attempt's own, though the store may outlive it. Its waits time out after ``timeout``."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"paratrain/attempt_{attempt}/", client)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
