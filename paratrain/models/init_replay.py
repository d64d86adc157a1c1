"""Drawing one rank's slice of a tensor from its recorded initialisation (``models.init_recording``), so a
rank draws what it holds and nothing else, and every layout gets the same values.

A random operation's values depend only on (seed, the tensor's name, the operation's place, the block):
the tensor, viewed as rows along its first dimension, is cut into blocks of whole rows of about
``BLOCK_ELEMENTS`` numbers, and block ``k`` is drawn from a generator seeded by those four. A rank whose
slice is rows ``[a, b)`` (FSDP's and tensor parallel's ``Shard(0)``) draws only the blocks that meet them;
a column slice (``Shard(1)``) draws the blocks of its rows and keeps its columns. Elementwise operations
(``zero_``, ``fill_``, the scaling of a truncated normal) run on the slice as they are. An operation on part of
the tensor (a padding row set to zero) is applied to the elements of that part the slice holds.

A slice that is not one box of the full tensor (strided shards, when two meshes shard the same dimension)
is drawn whole and cut afterwards: the same values, one full tensor of memory.

Blocks are independent (a generator each, a part of the output each), so a tensor's blocks are drawn on
several threads (``draw_threads``): a CPU generator draws one number at a time, about 5 ns each, which
made a 1.5B model's init 12 s of one core in a one-GPU run; the values do not depend on the thread count.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

# Private in torch 2.13, and what DTensor itself uses to place a shard (torchtitan's loaders use it too).
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from paratrain.models.init_recording import InitOp, RecordedInit, View

# A container's CPU quota is not in its affinity mask: a host's 200 CPUs would otherwise mean 200 threads.
MAX_DRAW_THREADS = 32
BLOCK_ELEMENTS = (
    1 << 18
)  # 1 MiB of fp32 per block: small enough that 64 ranks of a 4096 x 4096 weight draw their own rows


@dataclass(frozen=True)
class Box:
    """The part of a full tensor one rank holds: ``offsets[d]`` to ``offsets[d] + lengths[d]`` on every dimension."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, start + length) for start, length in zip(self.offsets, self.lengths, strict=True))


def box_of(tensor: torch.Tensor) -> Box | None:
    """The part of the full tensor this rank's ``tensor`` holds; None when it is not one box (drawn whole)."""
    if not isinstance(tensor, DTensor):
        return Box.whole(tuple(tensor.shape))
    if not all(type(placement) in (Shard, Replicate) for placement in tensor.placements):
        return None  # strided or partial placements: cut from the whole tensor instead
    lengths, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(lengths) != tuple(tensor.to_local().shape):
        return None
    return Box(tuple(offsets), tuple(lengths))


def replay(
    record: RecordedInit | None,
    *,
    name: str,
    seed: int,
    shape: tuple[int, ...],
    box: Box,
    dtype: torch.dtype | None = None,
    base: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The values of ``box`` of the tensor ``name`` (full ``shape``) that ``record``'s operations give.

    Args:
        dtype: The tensor's dtype (``base``'s when given).
        base: The full tensor's values before the operations (its constructor's), when they do not start by
            setting all of it; zeros otherwise.
        out: Where to write them (this rank's own part of the parameter, shaped as the box): no copy of the
            shard is made. A new CPU tensor otherwise.
    """
    if out is None:
        out = base[box.slices()].clone() if base is not None else torch.zeros(box.lengths, dtype=dtype)
    for position, op in record.effective() if record is not None else []:
        key = f"{seed}:{name}:{position}"
        if op.view is not None:
            _apply_on_view(out, op, key=key, shape=shape, box=box)
        elif op.random:
            _draw_rows(out, op, key=key, shape=shape, box=box)
        else:
            getattr(out, op.method)(*op.args, **dict(op.kwargs))
    return out


def block_seed(key: str, block: int) -> int:
    """A generator seed from a key and a block number, the same on every rank and in every process."""
    digest = hashlib.blake2b(f"{key}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _draw_rows(out: torch.Tensor, op: InitOp, *, key: str, shape: tuple[int, ...], box: Box) -> None:
    """Fills ``out`` (the box) with a random op's values, drawing only the blocks of rows that meet the box."""
    if not shape:  # a 0-d tensor: one number
        out.copy_(_draw(op, (), key=key, block=0, dtype=out.dtype))
        return
    first, whole_rows = box.offsets[0], box.lengths[1:] == tuple(shape[1:])

    def draw_block(block: int, start: int, stop: int) -> None:
        lo, hi = max(start, first), min(stop, first + box.lengths[0])
        target = out[lo - first : hi - first]
        if whole_rows and (lo, hi) == (start, stop) and target.is_contiguous() and target.dtype == torch.float32:
            _fill_block(target, op, key=key, block=block)  # the box holds the whole block: drawn in place
            return
        rows = _draw(op, (stop - start, *shape[1:]), key=key, block=block, dtype=out.dtype)
        target.copy_(rows[(slice(lo - start, hi - start), *box.slices()[1:])])

    blocks = blocks_meeting(shape, box)
    if len(blocks) == 1 or draw_threads() == 1:
        for block in blocks:
            draw_block(*block)
        return
    # Each block writes its own rows of out, from its own generator: any order, any thread, the same values.
    # Grad mode is per thread: the caller's (no_grad, filling a parameter in place) goes with each block.
    grad_enabled = torch.is_grad_enabled()

    def draw_in_callers_mode(block: tuple[int, int, int]) -> None:
        with torch.set_grad_enabled(grad_enabled):
            draw_block(*block)

    list(_block_pool(draw_threads()).map(draw_in_callers_mode, blocks))


def draw_threads() -> int:
    """Threads that draw blocks: this process's share of the CPUs it may run on (torchrun's
    ``LOCAL_WORLD_SIZE`` processes share them), at least one and at most ``MAX_DRAW_THREADS``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return min(MAX_DRAW_THREADS, max(1, share))


_POOLS: dict[int, ThreadPoolExecutor] = {}  # by thread count; kept across the tensors of one init


def _block_pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="paratrain-init")
    return _POOLS[threads]


@contextlib.contextmanager
def drawing_threads() -> Iterator[None]:
    """Keeps the drawing threads for the tensors of one init, and ends them with it: none outlives it into the
    forks that follow (data loader workers), where a copied pool would wait for threads the child does not have."""
    try:
        yield
    finally:
        while _POOLS:
            _POOLS.popitem()[1].shutdown(wait=True)


def blocks_meeting(shape: tuple[int, ...], box: Box) -> list[tuple[int, int, int]]:
    """(block, first row, end row) of every block of whole rows that the box's rows meet."""
    rows_per_block = max(1, BLOCK_ELEMENTS // max(math.prod(shape[1:]), 1))
    first, end = box.offsets[0], box.offsets[0] + box.lengths[0]
    if end <= first:
        return []  # this rank holds none of the rows
    return [
        (block, block * rows_per_block, min((block + 1) * rows_per_block, shape[0]))
        for block in range(first // rows_per_block, (end - 1) // rows_per_block + 1)
    ]


def rows_drawn(shape: tuple[int, ...], box: Box) -> int:
    """How many rows a rank holding ``box`` draws for a random op on a tensor of ``shape``."""
    return sum(stop - start for _, start, stop in blocks_meeting(shape, box)) if shape else 1


def _fill_block(target: torch.Tensor, op: InitOp, *, key: str, block: int) -> None:
    """A whole fp32 block drawn straight into its place: the same numbers as ``_draw`` of its shape gives."""
    generator = torch.Generator(device=target.device).manual_seed(block_seed(key, block))
    getattr(target, op.method)(*op.args, **dict(op.kwargs), generator=generator)


def _draw(op: InitOp, shape: tuple[int, ...], *, key: str, block: int, dtype: torch.dtype) -> torch.Tensor:
    """A random op's values for ``shape``, drawn in fp32 for floating tensors (the same numbers whatever a
    layout's dtype), from the block's own generator."""
    generator = torch.Generator().manual_seed(block_seed(key, block))
    draw_dtype = torch.float32 if dtype.is_floating_point else dtype
    values = torch.empty(shape, dtype=draw_dtype)
    getattr(values, op.method)(*op.args, **dict(op.kwargs), generator=generator)
    return values.to(dtype)


def _apply_on_view(out: torch.Tensor, op: InitOp, *, key: str, shape: tuple[int, ...], box: Box) -> None:
    """An op on part of the tensor (``op.view``), applied to the elements of that part inside the box. A random
    op draws the whole part (it is small: a row, a column) from one generator."""
    view = op.view
    flat = _view_indices(view)
    indices = torch.unravel_index(flat.reshape(-1), shape) if shape else ()
    inside = torch.ones(flat.numel(), dtype=torch.bool)
    for index, start, length in zip(indices, box.offsets, box.lengths, strict=True):
        inside &= (index >= start) & (index < start + length)
    local = tuple(index[inside] - start for index, start in zip(indices, box.offsets, strict=True))
    if op.random:
        values = _draw(op, tuple(view.size), key=key, block=0, dtype=out.dtype).reshape(-1)[inside]
    else:
        values = out[local].clone()
        getattr(values, op.method)(*op.args, **dict(op.kwargs))
    out[local] = values


def _view_indices(view: View) -> torch.Tensor:
    """The flat indices into the full contiguous tensor of every element of ``view``, in the view's order."""
    flat = torch.full(view.size, view.offset, dtype=torch.int64)
    for dim, (length, stride) in enumerate(zip(view.size, view.stride, strict=True)):
        steps = torch.arange(length, dtype=torch.int64) * stride
        flat += steps.view([length if d == dim else 1 for d in range(len(view.size))])
    return flat
