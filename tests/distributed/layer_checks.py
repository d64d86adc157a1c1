"""Functions the layer tests run on every rank of the pool (rank_pool.py): each lays out a small GPT
piece with paratrain's own parallel code, runs the same input through an unsharded copy, and returns
the largest differences so the test (in the parent) decides.

Module level so the ranks can import them by name.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from paratrain import optim
from paratrain.checkpoint.state import ModelState
from paratrain.config.schema import FSDPConfig, ParallelConfig
from paratrain.gradients import clip_grad_norm
from paratrain.launch.heal_payload import ModelShards, SameLayoutOptimizerState, as_one_buffer, from_one_buffer
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.plan_derivation import plan_of
from paratrain.optim import ShardLocalAdamW
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.fsdp import apply_fsdp
from paratrain.parallel.parallelize import parallelize
from paratrain.parallel.tensor import apply_tensor_parallel
from paratrain.tensors import local_part

# Sizes tp=2 divides (heads, hidden, the feed-forward's 4x) and a sequence tp=2 splits under sequence parallel.
SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, SEQ = 8, 8


def tensor_parallel_block(sequence_parallel: bool, plan_changes: dict | None = None) -> dict[str, float]:
    """Block 0 of a GPT under tensor parallel (tp=2, two replicas) against the unsharded block: largest
    absolute difference of the output and of each parameter's gradient. ``plan_changes`` replaces
    fields of the model's ParallelPlan (to check that a wrong plan is caught)."""
    dims = _dims_with_mesh(dp_replicate=2, tp=2)
    # One block: it is both the first (sequence parallel splits its input) and the last (gathers its output).
    model, reference = _model_and_copy(dataclasses.replace(SMALL, n_layer=1))
    plan = dataclasses.replace(model.parallel_plan(), **(plan_changes or {}))
    apply_tensor_parallel(model, dims.tp_mesh, plan=plan, sequence_parallel=sequence_parallel)
    block, reference_block = model.blocks[0], reference.blocks[0]
    x = torch.randn(BATCH, SEQ, SMALL.n_embd, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(BATCH, SEQ, SMALL.n_embd, generator=torch.Generator().manual_seed(2))
    output, expected = block(x), reference_block(x)
    (output * weights).sum().backward()
    (expected * weights).sum().backward()
    return {"output": _difference(output, expected), **_gradient_differences(block, reference_block)}


def tensor_parallel_block_or_error(sequence_parallel: bool, plan_changes: dict) -> dict[str, float | str]:
    """``tensor_parallel_block``, with a DTensor error (raised alike on every rank, before any collective
    waits on a partner) returned as ``{"raised": message}`` so the pool lives on."""
    try:
        return tensor_parallel_block(sequence_parallel, plan_changes)
    except RuntimeError as error:
        return {"raised": str(error).splitlines()[-1]}


def parallelized_gpt(degrees: dict[str, int], options: dict | None = None) -> dict[str, float]:
    """A whole small GPT through ``parallelize`` (the path every layout takes) against the unsharded model
    on the same global batch, each data-parallel rank taking its slice: largest difference of the loss
    (averaged over data-parallel ranks) and of each parameter's gradient."""
    dims = _dims_with_mesh(**degrees)
    model, reference = _model_and_copy()
    parallelize(model, dims, plan=model.parallel_plan(), options=ParallelConfig(**(options or {})))
    tokens = torch.randint(0, SMALL.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    per_rank = BATCH // dims.dp
    mine = tokens[dims.dp_rank * per_rank : (dims.dp_rank + 1) * per_rank]
    loss, expected = _lm_loss(model, mine), _lm_loss(reference, tokens)
    loss.backward()
    expected.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=dims.batch_mesh.get_group())
    return {"loss": _difference(mean_loss / dims.dp, expected), **_gradient_differences(model, reference)}


def clipped_gpt_gradients(degrees: dict[str, int], max_norm: float) -> dict[str, float]:
    """The same model and batch as ``parallelized_gpt``, its gradients clipped by paratrain's
    ``clip_grad_norm`` (sharded, plain or mixed) and the reference's by torch's ``clip_grad_norm_``:
    largest difference of the norm and of each clipped gradient, and the reference's norm (which must
    exceed max_norm for the check to clip at all)."""
    dims = _dims_with_mesh(**degrees)
    model, reference = _model_and_copy()
    parallelize(model, dims, plan=model.parallel_plan(), options=ParallelConfig())
    tokens = torch.randint(0, SMALL.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    per_rank = BATCH // dims.dp
    _lm_loss(model, tokens[dims.dp_rank * per_rank : (dims.dp_rank + 1) * per_rank]).backward()
    _lm_loss(reference, tokens).backward()
    norm = clip_grad_norm(list(model.parameters()), max_norm)
    expected = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), max_norm)
    return {
        "norm": _difference(norm, expected),
        "reference_norm": expected.item(),
        **_gradient_differences(model, reference),
    }


def adamw_on_shards_against_dtensors(degrees: dict[str, int], kernel: dict[str, bool]) -> dict[str, object]:
    """Two copies of the small GPT through ``parallelize``, three AdamW steps on the same batches: one by torch's
    AdamW on the DTensors, one by paratrain's ShardLocalAdamW. Returns how many of this rank's parts of the
    parameters and moments differ at all (0: bit for bit), how many group steps ran on the shards, and whether every moment is still a
    DTensor (what checkpoints and a healing peer read)."""
    dims = _dims_with_mesh(**degrees)
    models = _model_and_copy()
    for model in models:
        parallelize(model, dims, plan=model.parallel_plan(), options=ParallelConfig())
    reference = torch.optim.AdamW(_decayed_or_not(models[0]), lr=0.01, **kernel)
    on_shards = ShardLocalAdamW(_decayed_or_not(models[1]), lr=0.01, **kernel)
    taken = []
    original = optim.laid_out_like_their_parameters
    optim.laid_out_like_their_parameters = lambda lists: taken.append(original(lists)) or taken[-1]
    try:
        for step in range(3):
            tokens = torch.randint(0, SMALL.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
            for model, optimizer in zip(models, (reference, on_shards)):
                optimizer.zero_grad()
                _lm_loss(model, tokens).backward()
                optimizer.step()
    finally:
        optim.laid_out_like_their_parameters = original
    pairs = list(zip(models[0].parameters(), models[1].parameters()))
    tensors = [(a, b) for a, b in pairs] + [
        (reference.state[a][key], on_shards.state[b][key]) for a, b in pairs for key in ("exp_avg", "exp_avg_sq")
    ]
    return {
        "unequal": sum(not torch.equal(local_part(a), local_part(b)) for a, b in tensors),
        "on_shards": sum(taken),
        "moments_are_dtensors": all(isinstance(b, DTensor) for _, b in tensors),
    }


def healed_from_a_peers_shards(degrees: dict[str, int]) -> dict[str, object]:
    """A replica group's heal on one inner layout: a trained copy's model and optimizer, as sent to a healing peer
    (``launch/heal_payload.py``), through bytes read with weights_only=True into a fresh copy whose weights
    differ; then both take a step on the same batch. The live model's shards are read once before it trains, as a
    replica group reads them at start-up, and sent from the weights themselves after. Returns how many of this
    rank's parts of the parameters and moments differ (0: bit for bit), how many DTensors the bytes held, whether
    every healed parameter and moment is a DTensor again, and whether the shards were the weights themselves."""
    dims = _dims_with_mesh(**degrees)
    live, healing = _model_and_copy()
    with torch.no_grad():
        for parameter in healing.parameters():
            parameter.add_(1.0)  # a heal that did not load would show
    optimizers = []
    for model in (live, healing):
        parallelize(model, dims, plan=model.parallel_plan(), options=ParallelConfig())
        optimizers.append(ShardLocalAdamW(_decayed_or_not(model), lr=0.01))
    sent = {"model": ModelShards(ModelState(live)), "optimizer": SameLayoutOptimizerState(optimizers[0])}
    weights_alone = sent["model"].reads_weights_alone()
    tokens = [
        torch.randint(0, SMALL.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(s))
        for s in range(3)
    ]
    for batch in tokens[:2]:
        optimizers[0].zero_grad()
        _lm_loss(live, batch).backward()
        optimizers[0].step()
    stream = io.BytesIO()  # as the transport sends it: one safetensors buffer, read with weights_only
    torch.save(as_one_buffer({name: part.state_dict() for name, part in sent.items()}), stream)
    received = from_one_buffer(torch.load(io.BytesIO(stream.getvalue()), weights_only=True))
    ModelShards(ModelState(healing)).load_state_dict(received["model"])
    SameLayoutOptimizerState(optimizers[1]).load_state_dict(received["optimizer"])
    for model, optimizer in zip((live, healing), optimizers):
        optimizer.zero_grad()
        _lm_loss(model, tokens[2]).backward()
        optimizer.step()
    pairs = list(zip(live.parameters(), healing.parameters()))
    states = [
        (optimizers[0].state[a][key], optimizers[1].state[b][key])
        for a, b in pairs
        for key in ("exp_avg", "exp_avg_sq")
    ]
    return {
        "unequal": sum(not torch.equal(local_part(a), local_part(b)) for a, b in pairs + states),
        "dtensors_sent": sum(isinstance(leaf, DTensor) for leaf in tree_flatten(received)[0]),
        "healed_are_dtensors": all(isinstance(b, DTensor) and b.placements == a.placements for a, b in pairs + states),
        "weights_alone": weights_alone,
    }


def _decayed_or_not(model: torch.nn.Module) -> list[dict]:
    """build_optimizer's two groups: matrices decayed, the rest not."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def fsdp_units_of_a_model_without_blocks() -> dict[str, object]:
    """apply_fsdp on a model whose plan declares no blocks: how many FSDP units it made and whether every
    parameter is sharded."""
    dims = _dims_with_mesh(dp_shard=dist.get_world_size())
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    apply_fsdp(model, dims.fsdp_mesh, plan=plan_of(model), options=FSDPConfig())
    return {
        "units": sum(isinstance(module, FSDPModule) for module in model.modules()),
        "root_is_unit": isinstance(model, FSDPModule),
        "all_sharded": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def role_mesh_groups(degrees: dict[str, int]) -> dict[str, object]:
    """This rank's view of the role meshes ParallelDims builds: the global ranks in each of its groups."""
    dims = _dims_with_mesh(**degrees)
    roles = {"tp": dims.tp_mesh, "pp": dims.pp_mesh, "batch": dims.batch_mesh, "loss": dims.loss_mesh}
    groups = {role: dist.get_process_group_ranks(mesh.get_group()) for role, mesh in roles.items()}
    fsdp = dims.fsdp_mesh
    groups["fsdp"] = sorted(fsdp.mesh.flatten().tolist()) if fsdp is not None else None
    return {"groups": groups, "dp_rank": dims.dp_rank, "pp_rank": dims.pp_rank, "layout": dims.strategy}


def _dims_with_mesh(**degrees: int) -> ParallelDims:
    return ParallelDims.resolve(None, world_size=dist.get_world_size(), degrees=degrees).with_mesh("cpu")


def _model_and_copy(config: GPTConfig = SMALL) -> tuple[GPT, GPT]:
    torch.manual_seed(0)  # the same weights on every rank, as the trainer's seeded build gives
    model = GPT(config)
    return model, copy.deepcopy(model)


def _lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _gradient_differences(model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, float]:
    expected = dict(reference.named_parameters())
    differences = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            raise AssertionError(f"{name} got no gradient")
        differences[f"grad {name}"] = _difference(parameter.grad, expected[name].grad)
    return differences


def _difference(value: torch.Tensor, expected: torch.Tensor) -> float:
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return (full.detach() - expected.detach()).abs().max().item()
