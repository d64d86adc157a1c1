"""``paratrain plan CONFIG --gpus N --gpu-memory 80GB [--nodes K] [--host-memory 2TB] [--mtbf-hours H]``: read the
model, estimate every layout and the checkpoint interval, print."""

from __future__ import annotations

import torch

from paratrain.config.factories import call_factory
from paratrain.config.schema import Config, DataConfig
from paratrain.errors import ConfigError
from paratrain.planner.activations import measure_saved_bytes
from paratrain.planner.cadence import interval_lines
from paratrain.planner.host_memory import meminfo
from paratrain.planner.inputs import plan_inputs
from paratrain.planner.layouts import Cluster
from paratrain.planner.model_facts import ModelFacts, read_model_facts
from paratrain.planner.presentation import format_plan
from paratrain.planner.ranking import Plan, rank_layouts
from paratrain.planner.units import parse_memory


def plan_layouts(
    config: Config,
    *,
    gpus: int,
    gpu_memory: str,
    nodes: int = 1,
    host_memory: str | None = None,
    read_data_sample: bool = True,
) -> tuple[Plan, ModelFacts, str]:
    """Ranks the layouts for ``config``'s model on the cluster.

    Args:
        gpu_memory: Memory per GPU as the user wrote it ("80GB", "80GiB").
        host_memory: Host memory per node as the user wrote it ("2TB"); None: layouts are not judged by it.
        read_data_sample: For a model that is not a transformer, read one sample of the dataset to measure its
            activations (otherwise they are left out).

    Returns:
        The plan, the model facts, and a phrase saying where the activation estimate comes from.

    Raises:
        ConfigError: unparsable memory, a cluster that does not divide, or a model with no size information.
    """
    host = parse_memory(host_memory, argument="--host-memory") if host_memory is not None else None
    cluster = Cluster(gpus, nodes, parse_memory(gpu_memory, argument="--gpu-memory"), host)
    cluster.check()
    inputs = plan_inputs(config)
    facts = read_model_facts(inputs.model, seq_len=inputs.seq_len)
    measured, source = activation_source(facts, inputs.data, read_data_sample=read_data_sample)
    return rank_layouts(facts, inputs, cluster, measured_per_sample=measured), facts, source


def activation_source(facts: ModelFacts, data: DataConfig, *, read_data_sample: bool) -> tuple[float | None, str]:
    """Bytes per sample measured on the meta device for models the formula does not cover, and how it was found."""
    sizes = facts.transformer
    if sizes is not None:
        return None, (
            f"transformer formula (layers {sizes.num_layers}, hidden {sizes.hidden}, heads {sizes.heads}, "
            f"sequence {sizes.seq_len}, vocab {sizes.vocab})"
        )
    if not read_data_sample:
        return None, "not estimated (the model is not GPT-like; `paratrain plan` measures them from one data sample)"
    inputs = call_factory(data, key="data")[0][0]
    if not isinstance(inputs, torch.Tensor):
        raise ConfigError(
            f"data.factory={data.factory!r}: the planner measures activations of models that are "
            f"not GPT-like from one sample, which must be a tensor (got {type(inputs).__name__})"
        )
    try:
        per_sample = measure_saved_bytes(facts.model, inputs.unsqueeze(0).to("meta"))
    except Exception as error:  # noqa: BLE001 - a forward may need tensor values, which meta tensors lack
        first_line = (str(error).strip().splitlines() or [""])[0]
        return None, f"not estimated (one forward on the meta device failed: {type(error).__name__}: {first_line})"
    return float(per_sample), "measured: tensors autograd saves in one forward on the meta device, per sample"


def plan_command_text(
    config: Config,
    *,
    config_path: str,
    gpus: int,
    gpu_memory: str,
    nodes: int,
    host_memory: str | None = None,
    mtbf_hours: float | None = None,
    save_bandwidth: str = "1GB",
) -> tuple[str, int]:
    """The report, and the exit code: 0 when a layout fits, 1 when none does.

    Args:
        host_memory: RAM per node as the user wrote it; None: this machine's (MemTotal).
        mtbf_hours: One node's MTBF for the checkpoint interval; None: ``checkpoint.mtbf_hours``.
        save_bandwidth: What a node writes to checkpoint storage per second, as the user wrote it.
    """
    if host_memory is None:
        host_memory, host_source = f"{meminfo('MemTotal')}B", "this machine's MemTotal; --host-memory SIZE for others"
    else:
        host_source = "--host-memory"
    plan, facts, source = plan_layouts(config, gpus=gpus, gpu_memory=gpu_memory, nodes=nodes, host_memory=host_memory)
    text = format_plan(
        plan, facts, plan_inputs(config), config_path=config_path, activation_source=source, host_source=host_source
    )
    interval = interval_lines(
        facts,
        config.optim,
        nodes=nodes,
        mtbf_hours=config.checkpoint.mtbf_hours if mtbf_hours is None else mtbf_hours,
        save_bandwidth=save_bandwidth,
    )
    return "\n".join([text, "", *interval]), 0 if plan.recommended else 1
