"""Expert parallel (``parallel.ep``): each ep rank holds whole experts of every mixture-of-experts layer,
and tokens travel to the ranks holding their experts and back with all-to-all.

The model declares its experts as data (``ParallelPlan.block_experts``: modules whose parameters stack
the experts along dim 0) and takes the dispatch through its ``use_expert_dispatch`` hook
(models/contract.py); a transformers family's experts take it through transformers' own experts
interface (models/hf_experts.py), so their code is not patched. ``apply_expert_parallel`` makes each such parameter a DTensor ``Shard(0)`` over
the ep mesh (rank r of ep holds experts ``r * E/ep ... (r+1) * E/ep - 1``), so checkpoints hold the whole
stacked tensor and load at any ep degree, or none. FSDP then shards each rank's experts over the ranks
holding the same ones (``ParallelDims.expert_fsdp_mesh``; paratrain.parallel.fsdp).

One layer's forward on one rank (torchtitan's and Megatron's token dispatcher, without their fused
kernels): the rank's token copies, sorted by expert, are split by destination rank and sent with
``all_to_all_single`` (variable sizes, differentiable); the counts per expert go first, so each rank
knows how many rows of each source are for each of its experts. It runs its experts over the rows it
received, grouped by expert, and sends each result back where it came from; the backward pass runs the
same exchanges in reverse. Each expert's gradient then sums the contributions of every ep rank's
tokens, so FSDP divides it by every data-parallel rank (not only the efsdp ranks it reduces over),
like the other parameters' gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from paratrain.errors import ConfigError
from paratrain.models.contract import DispatchesToExperts
from paratrain.models.hf import is_transformers_model
from paratrain.models.hf_experts import install_transformers_dispatch
from paratrain.models.plan_derivation import ParallelPlan


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, *, plan: ParallelPlan) -> None:
    """Divides every block's experts over ``ep_mesh`` (in place, on meta or real parameters) and installs
    the all-to-all dispatch.

    Raises:
        ConfigError: the model declares no experts, cannot take a dispatch, or ep does not divide them.
    """
    ep = ep_mesh.size()
    check_expert_plan(model, plan, ep=ep)
    experts = expert_modules(model, plan)
    for module in experts:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    dispatch = AllToAllDispatch(group=ep_mesh.get_group(), ep=ep)
    if isinstance(model, DispatchesToExperts):
        model.use_expert_dispatch(dispatch)
    else:
        install_transformers_dispatch(model, experts, dispatch)


def expert_modules(model: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
    """The modules holding stacked expert weights, block by block (those this rank's model has)."""
    modules = []
    for block in plan.blocks:
        for path in plan.block_experts:
            try:
                modules.append(model.get_submodule(f"{block}.{path}"))
            except AttributeError:
                continue  # a pipeline stage without this block
    return modules


def check_expert_plan(model: nn.Module, plan: ParallelPlan, *, ep: int) -> None:
    """Raises ConfigError when ``parallel.ep=ep`` cannot divide ``model``'s experts, naming the keys."""
    name = type(model).__name__
    if plan.expert_refusal:
        raise ConfigError(
            f"parallel.ep={ep}: {plan.expert_refusal}; remove parallel.ep (fsdp shards the experts like any other "
            "parameter)"
        )
    if not plan.block_experts:
        raise ConfigError(
            f"parallel.ep={ep}: model {name} declares no experts (ParallelPlan.block_experts), so there is nothing "
            "to divide over ep ranks; remove parallel.ep, or give paratrain's GPT model.args.moe_experts"
        )
    if not isinstance(model, DispatchesToExperts) and not is_transformers_model(model):
        raise ConfigError(
            f"parallel.ep={ep}: model {name} does not define use_expert_dispatch(dispatch) (see "
            "paratrain/models/contract.py), so its tokens cannot be sent to other ranks' experts; remove parallel.ep"
        )
    for key, count in plan.num_experts.items():
        if count % ep:
            raise ConfigError(
                f"parallel.ep={ep} does not divide {key}={count}: each ep rank holds whole experts, as many as the "
                f"others; set parallel.ep to a divisor of {count}"
            )


class AllToAllDispatch:
    """Sends token copies to the ep rank holding their expert, runs the local experts, sends results back.

    Args:
        group: The ep ranks' process group.
        ep: How many they are.
    """

    def __init__(self, *, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: (assignments, dim) sorted by global expert; ``counts``: (num_experts,) assignments each.
        Returns each assignment's expert output, in ``x``'s order."""
        local = counts.numel() // self.ep
        received = self._exchange_counts(counts.view(self.ep, local))  # [source rank, local expert]: rows
        send_sizes = counts.view(self.ep, local).sum(dim=1).tolist()
        recv_sizes = received.sum(dim=1).tolist()
        incoming = all_to_all_single_autograd(x, recv_sizes, send_sizes, self.group)
        by_expert = _regroup(incoming, received)  # arrived by (source, expert); the experts take (expert, source)
        pieces = by_expert.split(received.sum(dim=0).tolist())
        outputs = torch.cat([experts(piece, expert) for expert, piece in enumerate(pieces)])
        returning = _regroup(outputs, received.t())  # back to (source, expert), then home
        return all_to_all_single_autograd(returning, send_sizes, recv_sizes, self.group)

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(ep, local) counts this rank sends to each rank's experts -> (ep, local) it receives from each."""
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        return received


def _regroup(rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``rows`` in blocks ordered by (a, b), ``sizes[a, b]`` rows each -> the same blocks ordered by (b, a)."""
    blocks = rows.split(sizes.reshape(-1).tolist())
    outer, inner = sizes.shape
    return torch.cat([blocks[a * inner + b] for b in range(inner) for a in range(outer)])
