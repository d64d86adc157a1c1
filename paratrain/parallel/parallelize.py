"""The one place the layout's transforms are applied, in one fixed order.

``parallelize`` runs on a model that may still be on the meta device: float8, then tensor parallel, then
activation checkpointing, then compile, then FSDP. Whole-replica wrappers (DDP, DataParallel) need real
parameters, so ``maybe_wrap_replicas`` applies them after materialising. The flat layout
(``layout.flat.build_model``), every pipeline stage (``pipeline.assembly.lay_out_stages``) and the dry run
call these two functions and nothing else, so a new transform, or a new model family's plan, is added
once. torchtitan's ``parallelize_llama`` is the model (its pipelining function applies the same
function to each stage).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from paratrain.config.schema import ParallelConfig
from paratrain.models.attention_hooks import install_sequence_functions
from paratrain.models.hf import is_transformers_model, use_whole_sequence_aux_loss
from paratrain.models.plan_derivation import ParallelPlan
from paratrain.parallel.activation import apply_activation_checkpointing, apply_compile
from paratrain.parallel.data_parallel import apply_data_parallel
from paratrain.parallel.ddp import apply_ddp
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.expert import apply_expert_parallel, expert_modules
from paratrain.parallel.float8 import apply_float8_training
from paratrain.parallel.fsdp import apply_fsdp, apply_fsdp_to_experts
from paratrain.parallel.sequence_sharding import SequenceSharding
from paratrain.parallel.tensor import apply_tensor_parallel, check_tensor_parallel_plan

logger = logging.getLogger("paratrain")


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    plan: ParallelPlan,
    options: ParallelConfig,
    roots: Callable[[nn.Module], list[nn.Module]] | None = None,
    sequence: SequenceSharding | None = None,
) -> list[nn.Module]:
    """Applies this rank's layout to ``model`` in place and returns it.

    Order: float8 (the blocks' Linear layers become torchao's Float8Linear, which every later step then
    wraps) -> the sequence functions (context parallel, document masking) -> tensor parallel (over
    ``dims.tp_mesh``) -> expert parallel (over ``dims.ep_mesh``) -> activation checkpointing -> compile ->
    FSDP (the experts over ``dims.expert_fsdp_mesh``, then the rest over ``dims.fsdp_mesh``). Each step
    does nothing where the layout does not use it.

    Args:
        model: The model, or the part of it this rank keeps, typically still on the meta device.
        dims: The resolved degrees, with their mesh built (``ParallelDims.with_mesh``).
        plan: The model's parallel plan (blocks, tensor-parallel styles); a pipeline stage passes the
            plan of the blocks it kept.
        options: The ``parallel`` config section (float8, sequence_parallel, activation_checkpointing,
            compile, fsdp options).
        roots: Called after the block transforms (which may replace blocks by wrappers) and before
            FSDP; returns the modules to shard as roots after the blocks (a pipeline rank's stage
            modules, built over the wrapped blocks). None: the model itself.
        sequence: This rank's cut of each sequence, whose attention and positions the model takes
            (``parallel.sequence``); None: the model's own.

    Returns:
        The roots: what runs forward (``[model]`` unless ``roots`` was given).
    """
    if options.float8.enabled:
        apply_float8_training(
            model, plan=plan, options=options.float8, fsdp=dims.fsdp_enabled, tp=dims.tp, compile=options.compile
        )
    if sequence is not None:
        install_sequence_functions(model, attention=sequence.attention, positions=sequence.positions)
        if dims.cp_enabled and is_transformers_model(model):
            use_whole_sequence_aux_loss(model, sequence.sum_over_sequence)
    if dims.tp_enabled:
        check_tensor_parallel_plan(plan, dims.tp, sequence_parallel=options.sequence_parallel)
        apply_tensor_parallel(model, dims.tp_mesh, plan=plan, sequence_parallel=options.sequence_parallel)
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.ep_mesh, plan=plan)
    if options.activation_checkpointing != "none":
        apply_activation_checkpointing(
            model, plan=plan, mode=options.activation_checkpointing, every=options.activation_checkpointing_every
        )
    if options.compile:
        apply_compile(model, plan=plan, backend=options.compile_backend, checkpointing=options.activation_checkpointing)
    modules = roots(model) if roots is not None else [model]
    if dims.fsdp_enabled and dims.ep_enabled:
        experts = expert_modules(model, plan)
        apply_fsdp_to_experts(
            experts, dims.expert_fsdp_mesh, options=options.fsdp, data_parallel_ranks=dims.fsdp_mesh.size()
        )
    if dims.fsdp_enabled:
        apply_fsdp(model, dims.fsdp_mesh, plan=plan, options=options.fsdp, roots=modules)
    return modules


def maybe_wrap_replicas(
    module: nn.Module,
    dims: ParallelDims,
    *,
    options: ParallelConfig,
    device: torch.device,
    in_pipeline: bool = False,
) -> nn.Module:
    """DDP (or DataParallel) around a materialised module when the layout replicates whole models;
    the module unchanged otherwise.

    Args:
        in_pipeline: The module is one pipeline stage. The pipeline runtime prepares DDP's reducer for
            the last micro-batch's backward itself; with DDP's default bucket rebuilding, the first step
            then records every parameter twice and the second step's forward fails an internal assert
            in reducer.cpp (torch 2.13). find_unused_parameters=True turns bucket rebuilding off (and
            costs one graph walk per step). static_graph=True runs but averages gradients wrongly, so
            preflight refuses it.
    """
    if dims.ddp_enabled:
        ddp = options.ddp
        return apply_ddp(
            module,
            dims.ddp_mesh,
            device=device,
            bucket_cap_mb=ddp.bucket_cap_mb,
            static_graph=ddp.static_graph and not in_pipeline,
            find_unused_parameters=ddp.find_unused_parameters or in_pipeline,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        )
    if dims.dataparallel_enabled:
        return apply_data_parallel(module, device=device)
    return module
