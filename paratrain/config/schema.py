"""The typed config tree: one section per concern, each field with its default and docstring (loading and
overrides are ``config/loading.py``).

Every field has a docstring; docs/reference/config.md is generated from them (and a test keeps it in step). Unknown keys are
rejected and every error is reported at once, each with its dotted path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The layouts ``parallel.strategy`` names (besides ``auto``, which the planner replaces by one of them).
Strategy = Literal["single", "dp", "model_parallel", "ddp", "fsdp", "hsdp", "tp", "pp"]
# What replica groups do with the slices of missing groups (FaultToleranceConfig.batch; launch/group_shares.py).
ReplicaBatch = Literal["fixed", "shrink"]
# Every degree a ``parallel`` section sets, in the mesh's rank order, outermost first; ep last, since it borrows
# data-parallel ranks instead of being a mesh dimension of its own (parallel/dims.py).
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are descriptions."""

    # A NaN or infinite number is never a meaningful setting (an Inf learning rate trains garbage).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True, allow_inf_nan=False)


class RunConfig(Section):
    name: str = "paratrain"
    """Run name, shown in logs and recorded in the metrics."""
    output_dir: Path = Path("runs/paratrain")
    """Directory for config.yaml, metrics.jsonl, checkpoints/ and tensorboard/."""

    @field_validator("output_dir", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        # Path("") is the current directory: an empty value would scatter a run's files there.
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty; name a directory for the run's files, e.g. runs/my-run")
        return value


class TrainConfig(Section):
    max_steps: int = Field(100, gt=0)
    """Number of optimizer steps to train for."""
    global_batch_size: int = Field(32, gt=0)
    """Samples per optimizer step, summed over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = Field(8, gt=0)
    """Samples per forward/backward on one rank. Gradient accumulation steps are
    global_batch_size / (micro_batch_size x data-parallel size)."""
    seed: int = 0
    """Seed for model initialisation, data order and every random number generator."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; null disables clipping (the norm is still logged)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device kind: auto picks CUDA (one GPU per process, NCCL) when present, else CPU (gloo)."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, attention
    on SDPA's math backend only): on a GPU, runs and resumes repeat bit for bit, at a speed cost."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose gradient norm is NaN or infinite is never applied. stop: end the run (exit code 3),
    naming the step and the last healthy checkpoint; skip: drop the step, log it and go on (fp16's
    loss scaler handles its own overflows and is not counted)."""
    nonfinite_max_skips: int = Field(5, gt=0)
    """With nonfinite=skip, this many non-finite steps in a row stop the run as nonfinite=stop would."""
    check_memory: bool = True
    """Before any parameter is allocated, compare the planner's estimate of a process's memory (parameters,
    gradients, optimizer state, activations) with its GPU's free memory, or its share of the available RAM
    on CPU, and refuse a layout that cannot fit, naming a layout that does; and the host memory a node's
    processes need (init, resume, async-save copies; on CPU their model state too) with the node's available
    RAM, once per node. false (or `paratrain train --skip-memory-check`): start anyway. Models that are not
    transformers are counted without activations."""
    host_memory: str | None = None
    """Host memory (RAM) per node the memory check counts on, e.g. 512GB or 480GiB; null: MemAvailable in
    /proc/meminfo. Set it when the run may use less than the machine has free (a Slurm --mem limit, a
    container's), or more."""


def on_off_word(value: Any) -> Any:
    """A bare on/off in YAML 1.1 reads as true/false; the user meant the words ("auto"/"on"/"off" keys)."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate (before optional scaling by data-parallel size)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, each in [0, 1)."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    momentum: float = Field(0.0, ge=0, lt=1)
    """SGD momentum, in [0, 1)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to the peak learning rate over this many steps."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate shape after warm-up: cosine decay to min_lr_ratio x lr at max_steps, or constant."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate of the cosine schedule, as a fraction of the peak."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale lr by the data-parallel size (linear) or its square root. Changes the training math:
    a run scaled this way no longer matches a single-process run."""
    fused: Literal["auto", "on", "off"] = "auto"
    """torch's fused optimizer kernel. auto: fused where the parameters are of one kind (all sharded or
    all plain) and all on GPUs or all on the CPU, foreach elsewhere; on: fused, refused where the kinds
    mix (tensor parallel alone); off: foreach. A fused optimizer also skips a step with non-finite
    gradients on the device (train.nonfinite), so the guard never waits for the GPU; others read the
    gradient norm on the host each step. Either kernel of AdamW runs on each rank's shards where the
    parameters are sharded alike (fsdp, hsdp): the same update, bit for bit, without DTensor's dispatch."""

    @field_validator("fused", mode="before")
    @classmethod
    def _yaml_booleans_mean_on_and_off(cls, value: Any) -> Any:
        return on_off_word(value)

    @field_validator("betas", mode="before")
    @classmethod
    def _two_betas(cls, betas: Any) -> Any:
        # pydantic alone reports a one-element list as "optim.betas.1: Field required", naming no fix.
        if isinstance(betas, (list, tuple)) and len(betas) != 2:
            raise ValueError(f"got {list(betas)}; give two numbers, beta1 and beta2, e.g. [0.9, 0.95]")
        return betas

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"got {list(betas)}; each beta must be in [0, 1), e.g. [0.9, 0.95]")
        return betas


class DDPConfig(Section):
    bucket_cap_mb: float | None = Field(None, gt=0)
    """Gradient bucket size in MiB for DDP's all-reduce; null keeps DDP's default (25 MiB buckets
    after a 1 MiB first one, so communication starts early in backward)."""
    static_graph: bool = False
    """Tell DDP the graph is the same every iteration (enables extra optimisations)."""
    find_unused_parameters: bool = False
    """Let DDP handle parameters that get no gradient in some steps (costs a graph traversal)."""
    gradient_as_bucket_view: bool = True
    """Gradients alias DDP's buckets, saving one copy of the gradients."""


class FSDPConfig(Section):
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (full shard, ZeRO-3-like) or keep them
    until backward (ZeRO-2-like: less communication, more memory)."""
    param_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """Dtype parameters are gathered and computed in (FSDP mixed precision); null keeps fp32 and lets
    ``precision`` autocast the compute."""
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """Dtype gradients are reduce-scattered in; null means fp32 (param_dtype's own when that is null)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (GPU runs only)."""
    prefetch_blocks: int = Field(0, ge=0)
    """Explicitly prefetch the next N blocks' parameters in forward and backward; 0 leaves FSDP's
    implicit one-block prefetch."""
    grad_sync: Literal["every_micro_batch", "last_micro_batch"] = "last_micro_batch"
    """Under gradient accumulation: reduce-scatter gradients after every micro-batch (least memory) or
    only after the last one (least communication; unsharded gradients are kept in between)."""

    def resolved_reduce_dtype(self) -> str | None:
        """The dtype gradients are reduced in: as set, else fp32 when parameters compute in bf16/fp16.

        Left unset, FSDP reduces in param_dtype, so a bf16 run would sum and accumulate gradients in
        bf16 across ranks and micro-batches; fp32 reduction is the standard mixed-precision recipe.
        (Here, not in parallel/fsdp.py, so the planner reads it without loading torch.distributed.fsdp.)
        """
        if self.reduce_dtype:
            return self.reduce_dtype
        return "fp32" if self.param_dtype in ("bf16", "fp16") else None


class FaultToleranceConfig(Section):
    replica_groups: int = Field(1, ge=1)
    """Replica groups under torchft (pip install 'paratrain[ft]'): the outermost data-parallel degree made
    of independent groups, each its own torchrun job with any inner layout, whose gradients are averaged
    across the groups alive at each step; a group that dies is left out until it restarts and heals from
    a live peer (no checkpoint read). 1: off. Each group is started with `paratrain train CONFIG
    --replica-group I --replica-groups N` (see docs/layouts.md)."""
    replica_group: int | None = None
    """This group's id, 0..replica_groups-1 (`--replica-group I` sets it). Required when replica_groups > 1."""
    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the quorum server every group joins (`paratrain lighthouse --bind HOST:PORT` runs it)."""
    batch: ReplicaBatch = "fixed"
    """What a step with groups missing trains on. fixed: the live groups also compute the missing groups'
    slices of the global batch (more accumulation steps, shared out in a fixed order), so every step is over
    the whole train.global_batch_size and a run with failures trains as one without (the same losses up to
    reduction order), only slower while groups are missing. shrink: the step is over the live groups' slices
    alone, an effective batch of global_batch_size x live / replica_groups at the same learning rate; the
    missing slices are skipped (skipped_samples) and a step takes no longer than usual."""
    min_replica_groups: int = Field(1, ge=1)
    """Groups that must be alive for a step to commit; fewer and the live groups wait (quorum_timeout_s)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long start-up waits for the lighthouse to answer before refusing, naming its address."""
    timeout_s: float = Field(10.0, gt=0)
    """Timeout of the cross-group collectives: a group that stops answering for longer is left out of the
    step (the others' step is not committed and is retried in the next quorum)."""
    rendezvous_timeout_s: float = Field(2.0, gt=0)
    """How long the groups of a new quorum have to connect their cross-group process group on CPU (gloo). Every
    member connects as soon as the lighthouse answers them all at once, within milliseconds; one that has not
    connected by then died after joining the quorum, and the live groups retake the step in a new quorum instead
    of waiting out timeout_s. (NCCL connects at the first all-reduce, under timeout_s.)"""
    quorum_timeout_s: float = Field(120.0, gt=0)
    """How long a step waits for a quorum of min_replica_groups groups. Keep it above the lighthouse's
    --join-timeout-ms (60 s by default): the lighthouse waits that long for a live group that is slow to ask
    for the quorum before forming it without that group, and a step that gave up first would ask again
    (up to lighthouse_wait_s) instead of stepping on."""
    lighthouse_wait_s: float = Field(600.0, gt=0)
    """How long a group keeps asking for a quorum that failed (the lighthouse killed or restarted, or
    unreachable) before it stops with exit code 75, naming the lighthouse. A lighthouse started again at the
    same address within it and the groups carry on from the step they were at, nothing lost; the first
    failed request itself takes up to quorum_timeout_s to give up."""

    @property
    def enabled(self) -> bool:
        return self.replica_groups > 1 or self.replica_group is not None


class Float8Config(Section):
    """float8 training through torchao (pip install 'paratrain[float8]'; see docs/gpus.md)."""

    enabled: bool = False
    """Compute the matrix multiplications of the Linear layers inside the model's blocks (attention and
    MLP projections whose in and out features are multiples of 16) in float8, through torchao's
    convert_to_float8_training: each matmul casts its input, weight and output gradient to float8 with
    scales computed from the tensors themselves. Weights keep their fp32 master copy, and everything
    else (embedding, norms, attention, output head) computes in `precision`'s dtype. Needs a CUDA GPU of
    compute capability 8.9 or newer (H100, H200, L4, L40S, RTX 4090) and torchao; faster than bf16 only
    with parallel.compile, which fuses the casts."""
    scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    """How the float8 scales are chosen. tensorwise: one scale per tensor (the fastest; under FSDP its
    weights can be gathered in float8, fsdp_float8_all_gather). rowwise: one per row of each operand,
    which follows outliers more closely (a loss nearer bf16's, a little slower); its matmul writes bf16,
    so it needs precision=bf16 or parallel.fsdp.param_dtype=bf16."""
    fsdp_float8_all_gather: bool = True
    """With scaling=tensorwise under FSDP (fsdp, hsdp): gather the converted layers' weights already
    cast to float8, 1 byte per element instead of param_dtype's 2 (bf16) or 4: half the all-gather
    traffic and gathered memory of bf16. No effect with rowwise, without FSDP, or beside tensor parallel
    (whose shards torchao would scale one by one, changing the numbers with the tp degree)."""
    emulate: bool = False
    """Cast and scale exactly as on a GPU, but multiply in the compute dtype (torchao's emulation): the
    same numerics at no speed-up, for checking a float8 layout on the CPU or on an older GPU (tests)."""


class ParallelConfig(Section):
    strategy: Literal["auto", Strategy] | None = None
    """Optional shorthand; the degrees below decide the layout and this only fills those left unset
    (explicit degrees win). null: one process trains alone, several run DDP over all of them unless
    degrees say otherwise. single: one process. dp: torch.nn.DataParallel over the local GPUs of one
    process. model_parallel: one process, consecutive pipeline stages on the devices in
    pipeline.devices. ddp: replicate over the ranks left (dp_replicate=-1). fsdp: shard over the ranks
    left (dp_shard=-1). hsdp: shard within a node, replicate across nodes. tp: tensor parallel over the
    ranks left. pp: pipeline parallel over the ranks left. A name whose own degree is set to 1
    (tp with parallel.tp=1) is refused. auto: `paratrain train` trains the layout `paratrain plan`
    recommends for its world size (ranked against each process's total GPU memory, or its share of
    the machine's RAM on CPU) and logs it at start; no degree may be set beside it."""
    dp_replicate: int | None = None
    """Data-parallel replicas: copies of the model (or of each shard group) that read different data.
    null: the strategy's default (DDP over all ranks when nothing else is set); -1: fill the world size."""
    dp_shard: int | None = None
    """Ranks that shard each replica's parameters with FSDP (> 1 makes the layout fsdp, or hsdp with
    dp_replicate > 1). null: the strategy's default (hsdp: processes per node); -1: fill the world size."""
    tp: int | None = None
    """Tensor-parallel degree; must divide the model's attention heads and hidden sizes. With data-parallel
    ranks beside it, those shard (or replicate) through FSDP. null: the strategy's default; -1: fill."""
    pp: int | None = None
    """Pipeline-parallel degree: ranks that each hold consecutive stages of the model (see pipeline.*).
    null: the strategy's default (pp: all ranks; others: 1); -1: fill the world size."""
    cp: int | None = None
    """Context-parallel degree: ranks that split every sample's sequence between them (each holds an
    early and a late chunk, so causal attention's work is even), for sequences whose activations do
    not fit one rank. cp x 2 must divide the sequence length, and cp x tp the attention (and key/value)
    heads. Parameters are sharded over dp_shard x cp (FSDP). null: 1; -1: fill the world size."""
    ep: int | None = None
    """Expert-parallel degree: ranks that divide each mixture-of-experts layer's experts between them
    (whole experts, num_experts / ep each) and send every token to the ranks holding its experts with
    all-to-all. It borrows the data-parallel ranks FSDP shards over (ep divides dp_shard x cp): the
    experts are FSDP-sharded over the dp_shard x cp / ep ranks holding the same ones, the other
    parameters over dp_shard x cp as without ep. For paratrain's GPT with model.args.moe_experts (ep
    must divide it). null: 1; -1: all of dp_shard x cp."""
    cp_attention: Literal["auto", "all_to_all", "ring"] = "auto"
    """How context-parallel ranks exchange attention. all_to_all (DeepSpeed Ulysses): heads for tokens
    before attention and back after it, with any attention kernel (CPU included). ring: torch's
    context_parallel ring attention over SDPA's CUDA kernels, which paratrain does not drive yet (refused
    with cp > 1, naming all_to_all). auto: all_to_all."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """Timeout of the process group's collectives (init_process_group's timeout): a collective that
    waits longer fails the run with torch's error instead of waiting for ever."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """What each block keeps for backward. none: every activation its backward reads. full: only the
    block's input; backward recomputes the whole block's forward first (least memory, about one more
    forward of compute). selective: the outputs of its matrix multiplications and attention, whose
    recomputation costs the most; the norms, activation functions and residual adds between them are
    recomputed (memory between none and full, little compute: torch's selective checkpointing). true and
    false, from older configs, mean full and none."""
    activation_checkpointing_every: int = Field(1, gt=0)
    """With activation_checkpointing full or selective: checkpoint one block in every k, the k-th, 2k-th,
    ... of the blocks a rank holds (of a pipeline stage's, under pp); the others keep every activation.
    1: every block. A second dial between none and full (torchtitan's selective layer option)."""
    compile: bool = False
    """torch.compile each block (opt-in: compiling takes time up front)."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile's backend with parallel.compile: inductor generates fused kernels (the fast one);
    aot_eager traces forward and backward as inductor does but runs them with eager kernels: seconds
    instead of minutes to start, for checking that a layout compiles and for debugging."""
    sequence_parallel: bool = False
    """With tp: also shard norms and residual activations along the sequence dimension."""
    ddp: DDPConfig = DDPConfig()
    """DistributedDataParallel options (layouts that resolve to ddp only)."""
    fsdp: FSDPConfig = FSDPConfig()
    """fully_shard options (layouts that resolve to fsdp or hsdp)."""
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    """Fault-tolerant replica groups on torchft (see docs/layouts.md)."""
    float8: Float8Config = Float8Config()
    """float8 matmuls in the model's blocks through torchao, on top of precision's dtype (see docs/gpus.md)."""

    def degrees(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in DEGREES}

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _booleans_mean_full_and_none(cls, value: Any) -> Any:
        # Before selective existed the key was a bool; old configs and checkpoints' manifests still say so.
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


class PipelineConfig(Section):
    schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """torch.distributed.pipelining schedule (torch's names). GPipe and 1F1B run one stage per rank;
    the others several (ZBVZeroBubble and DualPipeV exactly 2). See `paratrain pipeline show`."""
    microbatches: int | None = Field(None, gt=0)
    """Micro-batches per step through the pipeline. null: global_batch_size / (micro_batch_size x
    data-parallel size). When set, it decides the micro-batch size instead of train.micro_batch_size."""
    stages_per_rank: int | None = Field(None, gt=0)
    """Stages each pipeline rank holds. null: 1 for GPipe/1F1B, 2 for the multi-stage schedules."""
    split_points: list[str] = []
    """Module paths that end a stage (like split_spec {"blocks.3": "end"}), one fewer than the stages,
    from the model's pipeline sequence. Empty: cut automatically (pipeline.balance)."""
    balance: Literal["params", "time"] = "params"
    """Automatic cuts balance each stage's parameter count, or its forward+backward time measured on
    one micro-batch before training."""
    devices: list[str] = []
    """strategy model_parallel: the device of each stage, in order (e.g. [cuda:0, cuda:1]). Empty:
    every visible GPU, or the CPU alone (then all stages run there, and the log says so)."""
    record_timeline: bool | None = None
    """Record when each forward and backward ran on each rank into
    output_dir/pipeline/timeline-rank<R>.json, for the measured bubble in `paratrain pipeline show`.
    null: on for CPU runs, off on GPUs (it synchronises the GPU after every action, which removes
    the overlap of compute and communication)."""


class CheckpointConfig(Section):
    every_steps: int | Literal["auto"] = 0
    """Save a checkpoint every N steps into output_dir/checkpoints/step-<N>/; 0 saves only at the end. auto:
    the interval that loses least time, Young/Daly sqrt(2 x save cost x MTBF), from the measured time this run's
    saves block training and checkpoint.mtbf_hours over the run's nodes; the first save follows the first step,
    to measure one, and the interval is planned again when the measured cost or step time drifts (see
    docs/checkpoints.md)."""
    mtbf_hours: float | None = Field(None, gt=0)
    """Mean time between failures of one node, in hours, for every_steps: auto (a run on N nodes fails N times
    as often). Refined by the failures this run directory has recorded (output_dir/attempts.jsonl): the value
    counts as one failure-free MTBF already seen, pooled with the node-hours and failures recorded."""
    keep_last: int | None = Field(3, gt=0)
    """Keep this many complete checkpoints (older ones are deleted); null keeps all."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint in output_dir, if any. never: start fresh
    (refused if output_dir already has checkpoints). Anything else: path of a checkpoint to load."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    save_final_hf: bool = False
    """Once a run ends, `paratrain train` also writes its last checkpoint as a Hugging Face model directory,
    output_dir/hf (config.json, safetensors shards and their index, streamed as `paratrain export --hf`
    does), for a transformers model. Needs save_final. Runs started by torchrun directly: run
    `paratrain export CKPT --hf DIR` yourself."""
    async_save: bool = False
    """Write periodic checkpoints in the background (DCP async_save): training continues once the state
    is copied to CPU memory, which costs one more copy of model and optimizer state in host RAM. One
    save at a time; a checkpoint counts (for resume) only once every rank finished writing it. The
    last save of a run, and a save on SIGTERM/SIGUSR1, are written before going on."""
    allow_config_change: bool = False
    """Resume from a checkpoint trained with a config that changes what is trained (model, data, loss,
    optimizer, seed, global batch, grad clipping, or max_steps under the cosine schedule). Without it
    such a resume is refused, listing each change; layout, precision, micro-batch, logging and
    checkpoint changes are always allowed and logged."""

    @field_validator("every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        # pydantic alone lists both union members' errors for a negative number or another word.
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"got {value}; give a number of steps (0: only at the end), or auto")
        if isinstance(value, str) and value != "auto" and not value.strip().isdigit():
            raise ValueError(f"got {value!r}; give a number of steps (0: only at the end), or auto")
        return value

    @model_validator(mode="after")
    def _auto_needs_a_failure_rate(self) -> CheckpointConfig:
        if self.every_steps == "auto" and self.mtbf_hours is None:
            raise ValueError(
                "checkpoint.every_steps=auto chooses the interval from how often the run fails, and "
                "checkpoint.mtbf_hours is not set; set it to one node's mean time between failures in hours "
                "(e.g. checkpoint.mtbf_hours=24), or give checkpoint.every_steps a number of steps"
            )
        return self


class LogConfig(Section):
    every_steps: int = Field(10, gt=0)
    """Reduce metrics across ranks and log them every N steps (and at the first and last step)."""
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = ["jsonl"]
    """Where rank 0 reports the resolved config and every metrics record: jsonl (output_dir/metrics.jsonl,
    read by paratrain report), tensorboard (output_dir/tensorboard/), wandb (pip install 'paratrain[wandb]';
    WANDB_MODE and WANDB_PROJECT apply; needs `wandb login`, WANDB_API_KEY or WANDB_MODE=offline), mlflow
    (pip install 'paratrain[mlflow]'; MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME apply; unset, it logs
    to output_dir/mlflow.db)."""
    tensorboard: bool = False
    """Shorthand for adding tensorboard to log.trackers."""
    progress_bar: Literal["auto", "on", "off"] = "auto"
    """auto shows a progress bar when rank 0's stderr is a terminal; otherwise plain lines."""

    def tracker_names(self) -> list[str]:
        """log.trackers, with tensorboard added when log.tensorboard is set, each once."""
        names = [*self.trackers, *(["tensorboard"] if self.tensorboard else [])]
        return list(dict.fromkeys(names))

    @field_validator("progress_bar", mode="before")
    @classmethod
    def _yaml_booleans_mean_on_and_off(cls, value: Any) -> Any:
        return on_off_word(value)


class FactoryConfig(Section):
    factory: str
    """Import path 'package.module:callable' of the factory."""
    args: dict[str, Any] = {}
    """Keyword arguments for the factory; checked against its signature before training."""


HF_CAUSAL_LM = "paratrain.models.hf:causal_lm"


class LoraConfig(Section):
    """Low-rank adapters (LoRA, through peft) on a transformers model: the base weights are frozen and only
    the adapters train (see docs/fine-tuning.md)."""

    r: int = Field(gt=0)
    """Rank of each adapter (the update is B @ A with A of r rows)."""
    alpha: float = Field(16.0, gt=0)
    """Scale of the update: it is multiplied by alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on each adapter's input."""
    target_modules: list[str] | str = "all-linear"
    """Names (or name suffixes) of the Linear modules that get adapters, e.g. [q_proj, v_proj]; a string is
    a regular expression over full names; 'all-linear': every Linear but the output head."""
    target_parameters: list[str] = []
    """Name suffixes of parameters that get adapters themselves (peft's target_parameters), e.g. the stacked
    experts of transformers' MoE families: [mlp.experts.gate_up_proj, mlp.experts.down_proj], one adapter of
    rank r per expert. Not under parallel.ep (each rank holds some of the experts, the adapter all)."""


class ModelConfig(FactoryConfig):
    factory: str = "paratrain.models.gpt:build_gpt"
    """Import path of a callable returning an nn.Module."""
    pretrained: str | None = None
    """Directory of pretrained weights to start from (config.json + safetensors, single or sharded with
    model.safetensors.index.json: what save_pretrained or 'paratrain export --hf' write). The model is
    built on meta and each rank reads only its shards. Without model.factory, or with
    paratrain.models.hf:causal_lm, the model is built from the directory's config.json (args override
    its fields)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of the whole model (transformers models; ddp, fsdp and hsdp layouts);
    null: full fine-tune."""

    @model_validator(mode="before")
    @classmethod
    def _pretrained_defaults_to_hf(cls, data: Any) -> Any:
        if not (isinstance(data, dict) and data.get("pretrained")):
            return data
        factory = data.get("factory", HF_CAUSAL_LM)
        args = dict(data.get("args") or {})
        # The transformers factory builds a pretrained model from its own config.json, whether the factory
        # was left out or named (examples/hf_llama.yaml says "replace model.args by pretrained: DIR").
        if factory == HF_CAUSAL_LM and "model_type" not in args:
            args.setdefault("config_dir", data["pretrained"])
        return {**data, "factory": factory, "args": args}


class DataConfig(FactoryConfig):
    factory: str = "paratrain.data.text:build_char_dataset"
    """Import path of a callable returning a map-style Dataset of (inputs, targets) pairs, or the stream of
    paratrain.data.lm:streamed_text (read in order; see docs/data.md)."""
    shuffle: bool = True
    """Shuffle the sample order each epoch (seeded by train.seed and the epoch only)."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes per rank. A resume stays exact with workers: the position saved is the
    sampler's (global batches consumed), and the loader restarts from it; workers hold no state of their own."""
    prefetch_factor: int | None = Field(None, gt=0)
    """Micro-batches each worker loads ahead; null: PyTorch's default (2). Needs num_workers > 0."""
    persistent_workers: bool = False
    """Keep the workers alive for the life of the run's loader instead of ending them when it is exhausted.
    The training loader never is (epochs follow each other in one iteration), so this saves little; it is
    passed to the DataLoader as given. Needs num_workers > 0."""

    @model_validator(mode="after")
    def _worker_options_need_workers(self) -> DataConfig:
        # torch's DataLoader refuses both without workers; paratrain would otherwise drop them unseen.
        given = [f"data.prefetch_factor={self.prefetch_factor}"] * (self.prefetch_factor is not None)
        given += ["data.persistent_workers=true"] * self.persistent_workers
        if self.num_workers == 0 and given:
            raise ValueError(
                f"{' and '.join(given)} need worker processes, and data.num_workers=0 reads in the training "
                f"process; set data.num_workers to 1 or more, or leave {' and '.join(g.split('=')[0] for g in given)} out"
            )
        return self


class LossConfig(FactoryConfig):
    factory: str = "paratrain.losses:cross_entropy"
    """Import path of a callable returning loss_fn(outputs, targets) -> scalar mean loss."""


class DebugConfig(Section):
    dump_initial_weights: bool = False
    """Write the full initial parameters and buffers (gathered from shards) to
    output_dir/initial-weights.safetensors before training, to check that two layouts start alike."""
    dump_gradients_at_steps: list[int] = []
    """Write the full gradients (gathered from shards, before clipping) of these steps to
    output_dir/gradients/step-<N>.safetensors, to compare layouts tensor by tensor."""
    step_timeout_s: float | None = Field(None, gt=0)
    """If a step (with its checkpoint save and logging) takes longer, every rank writes its Python stacks
    and the collective it waits in to output_dir/hang/rank<R>.txt, rank 0 prints where each rank is,
    and the job exits 124 instead of hanging. null: no watchdog. Keep it below
    parallel.collective_timeout_s, and above the first step's time (which may compile)."""


class CallbackConfig(FactoryConfig):
    factory: str
    """Import path of a Callback class (or a factory returning one), e.g.
    'paratrain.callbacks.memory:MemoryMonitor'."""


class EvalConfig(Section):
    factory: str | None = None
    """Import path of a callable returning the validation Dataset of (inputs, targets) pairs, like data.factory;
    null: no evaluation."""
    args: dict[str, Any] = {}
    """Keyword arguments for eval.factory; checked against its signature before training."""
    every_steps: int = Field(0, ge=0)
    """Evaluate every N steps (such a step is also logged) and after the last step; 0 evaluates only after
    the last step."""
    max_batches: int | None = Field(None, gt=0)
    """Evaluate at most this many batches of eval.batch_size samples per data-parallel rank; null: the whole
    validation set."""
    batch_size: int | None = Field(None, gt=0)
    """Samples per forward on one rank while evaluating; null: train.micro_batch_size."""


class ProfileConfig(Section):
    enabled: bool = False
    """Profile a window of steps with torch.profiler and write a Chrome trace per rank to
    output_dir/profile/trace-rank<R>.json (open it in Perfetto or chrome://tracing)."""
    wait: int = Field(1, ge=0)
    """Steps to skip before the window (the first steps pay one-time costs)."""
    warmup: int = Field(1, ge=0)
    """Steps the profiler runs but discards, so its own start-up cost stays out of the trace."""
    active: int = Field(2, gt=0)
    """Steps recorded in the trace. wait + warmup + active must fit in train.max_steps."""
    record_shapes: bool = False
    """Record the input shapes of each operator (larger trace)."""
    memory_snapshot: bool = False
    """On GPU, also record the CUDA caching allocator's history from the start of training to the end of
    the window and dump it to output_dir/profile/memory-rank<R>.pickle (view it at pytorch.org/memory_viz).
    Skipped on CPU."""


class Config(Section):
    """Root of the config tree. Only the CLI, the worker entry and the Trainer see all of it."""

    run: RunConfig = RunConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    """Pipeline stages and schedule (strategy pp, parallel.pp > 1, or model_parallel)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: bf16/fp16 autocast (fp16 adds a gradient scaler); weights stay fp32."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    loss: LossConfig = LossConfig()
    debug: DebugConfig = DebugConfig()
    callbacks: list[CallbackConfig] = []
    """Callbacks called at train start and end, after each step, checkpoint and evaluation, in this order
    on every rank: a list of {factory: 'package.module:Class', args: {...}}. Built-ins:
    paratrain.callbacks.memory:MemoryMonitor, paratrain.callbacks.throughput:ThroughputMonitor,
    paratrain.callbacks.early_stopping:EarlyStopping (see docs/callbacks.md)."""
    eval: EvalConfig = EvalConfig()
    """Evaluation on a validation dataset, its loss averaged over the data-parallel ranks."""
    profile: ProfileConfig = ProfileConfig()
    """torch.profiler window and optional CUDA memory snapshot."""

    @model_validator(mode="after")
    def _profile_window_fits_the_run(self) -> Config:
        window = self.profile.wait + self.profile.warmup + self.profile.active
        if self.profile.enabled and window > self.train.max_steps:
            raise ValueError(
                f"the profiler window profile.wait={self.profile.wait} + profile.warmup={self.profile.warmup} + "
                f"profile.active={self.profile.active} = {window} steps is longer than train.max_steps="
                f"{self.train.max_steps}; shorten the window or train longer"
            )
        return self

    @model_validator(mode="after")
    def _micro_batch_fits_global_batch(self) -> Config:
        if self.train.global_batch_size % self.train.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} is not divisible by "
                f"train.micro_batch_size={self.train.micro_batch_size}; pick sizes where it is"
            )
        return self
