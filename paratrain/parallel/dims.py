"""The degrees of parallelism, how a config's ``parallel`` section resolves to them, and the named
DeviceMesh over them with one sub-mesh per role.

Ranks are laid out as ``torch.arange(world_size).view(pp, dp_replicate, dp_shard, cp, tp)`` (torchtitan's
order): tensor parallel innermost (neighbouring ranks share the fastest links), then context parallel,
pipeline outermost. Rank 5 of 8 with ``pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2`` sits at
(1, 0, 0, 0, 1): the second pipeline stage, the first shard, the second tensor-parallel half. Other code asks for a role (``dims.fsdp_mesh``,
``dims.batch_mesh``, ``dims.dp_rank``) instead of computing ranks or comparing layout names.

Degrees decide the layout; ``parallel.strategy`` is an optional shorthand that fills only the degrees
left unset (explicit degrees always win), and one degree may be -1 to take what the world size leaves:

============  ====================================================
strategy      degrees it fills when they are unset
============  ====================================================
(none)        one process: single; several: dp_replicate = -1 (DDP)
single, dp,   all 1 (one process)
model_parallel
ddp           dp_replicate = -1
fsdp          dp_shard = -1
hsdp          dp_shard = processes per node, dp_replicate = -1
              (with one of the two set, the other is -1)
tp            tp = -1
pp            pp = -1
============  ====================================================

The resolved degrees then choose how data-parallel ranks synchronise: FSDP (``fully_shard``) over
(dp_replicate, dp_shard x cp) when anything is sharded across them (dp_shard > 1, cp > 1, or tensor
parallel with replicas, since DDP cannot wrap DTensor parameters); DDP over dp_replicate otherwise.

Context-parallel ranks (cp) read the same samples and each computes a slice of every sequence
(paratrain.parallel.sequence_sharding); their gradients add up to the whole sequence's, so FSDP shards and
averages over them as over dp_shard (torchtitan's dp_shard_cp), and no cp rank holds whole parameters.

Expert parallel (ep) is not a dimension of its own: as in torchtitan, it borrows ranks from the
data-parallel ones that FSDP shards over. The dp_shard x cp ranks (flattened, cp inner) are viewed as
``(efsdp, ep)`` = ``(dp_shard x cp / ep, ep)``: each group of ep consecutive ones holds the experts
between them (whole experts, ``num_experts / ep`` each) and trades tokens with all-to-all, and FSDP
shards each rank's experts over the efsdp ranks holding the same ones (with dp_replicate's replicas),
while the other parameters stay sharded over dp_shard x cp as without ep. With dp_shard=4, ep=2: ranks
{0, 1} and {2, 3} are the ep groups, {0, 2} and {1, 3} shard the same experts.

Fault-tolerant replica groups (``parallel.fault_tolerance``, torchft) are the outermost data-parallel
degree, ``replica_groups``, and lie outside the mesh: each group is its own torchrun job whose ranks are
laid out as above, and rank i of every group averages its gradients with rank i of the others through
torchft's process group (paratrain.launch.replica_groups). Data is read as if the mesh were
``(replica_groups, pp, dp_replicate, dp_shard, cp, tp)``: ``dp`` counts every group's readers and
``dp_rank`` is ``replica_group x group_dp + the rank's place in its group``. Pipeline parallel inside a
group is refused for now (a group's stages would have to heal together; untested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.config.schema import DEGREES, FaultToleranceConfig, ParallelConfig, PipelineConfig, Strategy, TrainConfig
from paratrain.errors import ConfigError

MESH_DIMS = tuple(name for name in DEGREES if name != "ep")  # ep borrows dp_shard x cp's ranks (see above)

_ONE_PROCESS = ("single", "dp", "model_parallel")
_SHARDED = ("fsdp", "hsdp")
# Each multi-process name, and the degree it is about: setting that degree to 1 contradicts the name.
_OWN_DEGREE = {"tp": "tp", "fsdp": "dp_shard", "pp": "pp"}


def resolve_parallel_dims(options: ParallelConfig, *, world_size: int, local_world_size: int = 1) -> ParallelDims:
    """The one place a ``parallel`` section becomes degrees: every command and the trainer call this.

    ``strategy: auto`` is chosen before this by ``paratrain train`` (planner/memory_check.py), which
    replaces it with the recommended layout's strategy and degrees.

    Raises:
        ConfigError: naming the keys, the resolved degrees and the fix.
    """
    if options.strategy == "auto":
        raise ConfigError(
            "parallel.strategy=auto is chosen by `paratrain train` (and `paratrain train --dry-run`) for its "
            "world size; this command needs a layout: name a strategy, or run `paratrain plan` to choose one"
        )
    dims = ParallelDims.resolve(
        options.strategy, world_size=world_size, local_world_size=local_world_size, degrees=options.degrees()
    )
    return with_replica_groups(dims, options.fault_tolerance)


def with_replica_groups(dims: ParallelDims, options: FaultToleranceConfig) -> ParallelDims:
    """``dims`` as one of ``options.replica_groups`` fault-tolerant groups (unchanged when that is off).

    Raises:
        ConfigError: naming the key and the fix, for a group id out of range, one group, a quorum that
            can never form, or a layout whose outer degree inside a group is not replicas (pp).
    """
    if not options.enabled:
        return dims
    groups, group = options.replica_groups, options.replica_group
    key = "parallel.fault_tolerance"
    if groups < 2:
        raise ConfigError(
            f"{key}.replica_groups={groups} with {key}.replica_group={group}: fault tolerance needs at least 2 "
            f"replica groups (one group has no live peer to heal from); start each group with --replica-group I "
            f"--replica-groups N (N >= 2), or drop --replica-group to train without replica groups"
        )
    if group is None or not 0 <= group < groups:
        raise ConfigError(
            f"{key}.replica_group={group} is not a group of {key}.replica_groups={groups}: give each group's "
            f"`paratrain train` its own --replica-group between 0 and {groups - 1}"
        )
    if options.min_replica_groups > groups:
        raise ConfigError(
            f"{key}.min_replica_groups={options.min_replica_groups} is more than {key}.replica_groups={groups}: "
            f"no step could ever commit; set it to at most {groups} (1 keeps training while any group lives)"
        )
    if dims.pp_enabled:
        raise ConfigError(
            f"parallel.pp={dims.pp} with {key}.replica_groups={groups}: replica groups must be the outermost "
            f"degree over whole replicas, and a group's pipeline stages would have to heal together, which "
            f"paratrain does not do yet; use fsdp, ddp or tp inside each group (parallel.pp=1)"
        )
    return replace(dims, replica_groups=groups, replica_group=group)


def micro_batch_size(train: TrainConfig, pipeline: PipelineConfig, *, dims: ParallelDims) -> int:
    """Samples per forward on one rank: train.micro_batch_size, unless a pipeline's micro-batch
    count (pipeline.microbatches) decides it."""
    if dims.pp_enabled and pipeline.microbatches:
        return train.global_batch_size // (dims.dp * pipeline.microbatches)
    return train.micro_batch_size


def runs_in_one_process(options: ParallelConfig) -> bool:
    """Whether the section names a one-process layout (single, dp, model_parallel)."""
    return options.strategy in _ONE_PROCESS


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis (their product is the world size), the resolved layout's name and,
    once ``with_mesh`` has built it, the named mesh.

    ``strategy`` is the layout that runs, derived from the degrees (``hsdp`` for dp_replicate=2 x
    dp_shard=2 whatever name the config used); only the one-process names are kept as given.
    """

    strategy: Strategy
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    # Fault-tolerant replica groups (torchft): the outermost data-parallel degree, outside this job's mesh.
    replica_groups: int = 1
    replica_group: int = 0  # this job's group, 0..replica_groups-1
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    # The flattened role meshes, kept as _flatten returns them: torch deprecates slicing them back out
    # of the root mesh (UserWarning in torch 2.13: "Users need to bookkeep the flattened mesh directly").
    flattened: dict[str, DeviceMesh] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def resolve(
        cls,
        strategy: Strategy | None,
        *,
        world_size: int,
        local_world_size: int = 1,
        degrees: dict[str, int | None] | None = None,
    ) -> ParallelDims:
        """Fills the degrees left unset from the strategy's shorthand, resolves -1 and checks the product.

        Args:
            strategy: The shorthand the user named; None lets the degrees (and the world size) decide.
            degrees: Degrees the user set (``parallel.dp_shard`` etc.); None means not set.

        Raises:
            ConfigError: naming the degrees and the world size when they do not fit.
        """
        given = _given(degrees)
        ep = given.pop("ep", 1)  # borrows data-parallel ranks: not a factor of the world size
        _check_one_process(strategy, given | ({"ep": ep} if ep != 1 else {}), world_size)
        _check_no_contradiction(strategy, given, world_size=world_size, local_world_size=local_world_size)
        shorthand = strategy or ("single" if world_size == 1 else "ddp")
        filled = _fill({**_unset_defaults(shorthand, local_world_size, given), **given}, world_size)
        ep = _expert_degree(ep, filled)
        return cls(_layout_name(strategy or shorthand, filled, named=strategy is not None), **filled, ep=ep)

    # Sizes and switches -------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different slices of each global batch are read at once (in every
        replica group)."""
        return self.replica_groups * self.group_dp

    @property
    def group_dp(self) -> int:
        """Data-parallel ranks of this job (one replica group): dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def ft_enabled(self) -> bool:
        """Whether this job is one of several fault-tolerant replica groups (torchft)."""
        return self.replica_groups > 1

    @property
    def world_size(self) -> int:
        """Processes of this job (of one replica group, under fault tolerance)."""
        return self.pp * self.group_dp * self.cp * self.tp

    @property
    def loss_ranks(self) -> int:
        """Ranks of this job whose losses average to a step's loss: every data-parallel rank's, and within each
        the cp ranks' (each a mean over an equal slice of the same samples). Replica groups average theirs
        through torchft first."""
        return self.group_dp * self.cp

    @property
    def needs_process_group(self) -> bool:
        return self.strategy not in _ONE_PROCESS

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are fully_shard-ed over ``fsdp_mesh`` (fsdp and hsdp layouts)."""
        return self.strategy in _SHARDED

    @property
    def ddp_enabled(self) -> bool:
        """Whole replicas, gradients averaged by DistributedDataParallel over ``ddp_mesh``."""
        return self.strategy == "ddp"

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        """Each sample's sequence is split over ``cp`` ranks (context parallel)."""
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        """Experts are divided over ``ep`` ranks, which trade tokens with all-to-all (expert parallel)."""
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them between them (dp_shard x cp / ep)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def dataparallel_enabled(self) -> bool:
        """One process driving torch.nn.DataParallel over its local GPUs (strategy dp)."""
        return self.strategy == "dp"

    @property
    def model_parallel_enabled(self) -> bool:
        """One process running consecutive parts of the model on several devices (strategy model_parallel)."""
        return self.strategy == "model_parallel"

    @property
    def is_sharded(self) -> bool:
        """Whether parameters (and so gradients) are split across ranks."""
        return self.tp_enabled or self.fsdp_enabled

    @property
    def fsdp_size(self) -> int:
        """Ranks each parameter is sharded over (dp_shard x cp; 1 without FSDP)."""
        return self.dp_shard * self.cp if self.fsdp_enabled else 1

    # The mesh and its roles ---------------------------------------------------------------------

    def with_mesh(self, device_type: str) -> ParallelDims:
        """These degrees with the named 5-D mesh over all ranks built (none for one-process layouts),
        plus the flattened dimensions: ``dp`` (dp_replicate x dp_shard), ``loss`` (pp x dp x cp) and
        ``dp_shard_cp`` (dp_shard x cp, what FSDP shards over)."""
        if not self.needs_process_group:
            return self
        shape = tuple(getattr(self, name) for name in MESH_DIMS)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        flattened = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "loss": mesh["pp", "dp_replicate", "dp_shard", "cp"]._flatten("loss"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
        }
        if self.ep_enabled:
            # The same ranks seen as (efsdp, ep), ep inner: meshes of the one root, which FSDP requires of
            # the mesh it shards DTensor experts over and theirs.
            experts = flattened["dp_shard_cp"]._unflatten(0, (self.efsdp, self.ep), ("efsdp", "ep"))
            flattened |= {"efsdp": experts["efsdp"], "ep": experts["ep"]}
        return replace(self, mesh=mesh, flattened=flattened)

    @property
    def batch_mesh(self) -> DeviceMesh | None:
        """The ranks that read different slices of a global batch (dp_replicate x dp_shard, flattened)."""
        return self.flattened.get("dp")

    @property
    def loss_mesh(self) -> DeviceMesh | None:
        """What a step's loss is summed over: the data-parallel and context-parallel ranks of every pipeline
        stage (stages without the loss add zero; tensor-parallel ranks hold copies and are left out).
        Divide by ``loss_ranks``."""
        return self.flattened.get("loss")

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """What fully_shard shards over: dp_shard x cp, or (dp_replicate, dp_shard x cp) for hsdp's replicas."""
        if not self.fsdp_enabled or self.mesh is None:
            return None
        if not self.cp_enabled:
            return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]
        shards = self.flattened["dp_shard_cp"]
        # Concatenated rather than sliced: torch deprecates slicing a flattened dimension out of the root.
        return DeviceMesh._concatenate([self.mesh["dp_replicate"], shards]) if self.dp_replicate > 1 else shards

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The ranks that divide each MoE layer's experts between them and trade tokens (expert parallel)."""
        return self.flattened.get("ep")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """What fully_shard shards experts over under expert parallel: the efsdp ranks holding the same
        experts, with dp_replicate's replicas in front for hsdp."""
        if not self.ep_enabled or self.mesh is None:
            return None
        efsdp = self.flattened["efsdp"]
        return DeviceMesh._concatenate([self.mesh["dp_replicate"], efsdp]) if self.dp_replicate > 1 else efsdp

    @property
    def ddp_mesh(self) -> DeviceMesh | None:
        return self.mesh["dp_replicate"] if self.ddp_enabled and self.mesh is not None else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if self.mesh is not None else None

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self.mesh["pp"] if self.mesh is not None else None

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The ranks that split each sample's sequence between them."""
        return self.mesh["cp"] if self.mesh is not None else None

    @property
    def dp_rank(self) -> int:
        """This rank's position among the data-parallel ranks of every replica group: which slice of each
        global batch it reads."""
        return self.replica_group * self.group_dp + self.group_dp_rank

    @property
    def group_dp_rank(self) -> int:
        """This rank's position among its own job's data-parallel ranks."""
        return self.batch_mesh.get_local_rank() if self.mesh is not None else 0

    @property
    def pp_rank(self) -> int:
        return self.pp_mesh.get_local_rank() if self.mesh is not None else 0

    @property
    def cp_rank(self) -> int:
        """This rank's slice of each sequence (paratrain.parallel.sequence_sharding says which tokens it holds)."""
        return self.cp_mesh.get_local_rank() if self.mesh is not None else 0

    # Words --------------------------------------------------------------------------------------

    def describe(self) -> str:
        """Every degree: ``pp=1 x dp_replicate=2 x dp_shard=2 x cp=1 x tp=1`` (``, ep=2`` with experts
        divided: ep borrows dp_shard x cp's ranks, so it is no factor of the product)."""
        return " x ".join(f"{name}={getattr(self, name)}" for name in MESH_DIMS) + self._describe_ep()

    def describe_layout(self) -> str:
        """The layout as the start-up log names it: ``hsdp: dp_replicate=2 x dp_shard=2``."""
        used = [f"{name}={getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        groups = f", replica group {self.replica_group} of {self.replica_groups} (torchft)" if self.ft_enabled else ""
        return f"{self.strategy}: {' x '.join(used) or 'one process'}{self._describe_ep()}{groups}"

    def _describe_ep(self) -> str:
        return f", ep={self.ep} (experts over ep ranks of dp_shard x cp)" if self.ep_enabled else ""


def _given(degrees: dict[str, int | None] | None) -> dict[str, int]:
    given = {name: value for name, value in (degrees or {}).items() if value is not None}
    for name, value in given.items():
        if value == 0 or value < -1:
            raise ConfigError(f"parallel.{name}={value}: a degree is a positive number, or -1 to fill the world size")
    return given


def _expert_degree(ep: int, degrees: dict[str, int]) -> int:
    """ep as given, -1 resolved to all of dp_shard x cp; checked to divide dp_shard x cp."""
    shards = degrees["dp_shard"] * degrees["cp"]
    if ep == -1:
        return shards
    if shards % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide parallel.dp_shard={degrees['dp_shard']} x parallel.cp={degrees['cp']} "
            f"= {shards}: expert parallel borrows the ranks FSDP shards over (each group of ep of them divides the "
            f"experts); set parallel.ep to a divisor of {shards}, or raise parallel.dp_shard"
        )
    return ep


def _check_one_process(strategy: Strategy | None, given: dict[str, int], world_size: int) -> None:
    more_than_one = sorted(name for name, value in given.items() if value != 1)
    if strategy in _ONE_PROCESS and (world_size != 1 or more_than_one):
        also = f" and {', '.join(f'parallel.{n}' for n in more_than_one)} set" if more_than_one else ""
        raise ConfigError(
            f"parallel.strategy={strategy} runs in one process, but {world_size} were started{also}; "
            f"remove parallel.strategy (the degrees and process count then decide: DDP by default), or start one"
        )


def _check_no_contradiction(
    strategy: Strategy | None, given: dict[str, int], *, world_size: int, local_world_size: int
) -> None:
    """A name whose own degree the user set to 1 (strategy=tp with tp=1) says two opposite things."""
    own = _OWN_DEGREE.get(strategy or "")
    if own is None or given.get(own) != 1:
        return
    if own == "dp_shard" and given.get("cp", 1) > 1:
        return  # fsdp shards over dp_shard x cp: cp ranks alone are a sharded layout
    try:
        without_name = ParallelDims.resolve(
            None, world_size=world_size, local_world_size=local_world_size, degrees=given
        ).describe_layout()
    except ConfigError as error:
        without_name = f"no layout ({error})"
    raise ConfigError(
        f"parallel.strategy={strategy} contradicts parallel.{own}=1 at world size {world_size}: the name asks for "
        f"{own} > 1; without the name the degrees resolve to {without_name}. Remove parallel.strategy, or set "
        f"parallel.{own} to more than 1 (or -1)"
    )


def _unset_defaults(strategy: Strategy, local_world_size: int, given: dict[str, int]) -> dict[str, int]:
    """The shorthand's degrees for those the user left unset; its -1 gives way to a -1 the user set."""
    if strategy == "hsdp" and not ({"dp_replicate", "dp_shard"} & given.keys()):
        defaults = {"dp_shard": local_world_size, "dp_replicate": -1}  # shard within a node
    else:
        defaults = {
            "ddp": {"dp_replicate": -1},
            "fsdp": {"dp_shard": -1},
            "hsdp": {"dp_replicate": -1, "dp_shard": -1},
            "tp": {"tp": -1},
            "pp": {"pp": -1},
        }.get(strategy, {})
    defaults = {name: value for name, value in defaults.items() if name not in given}
    if -1 in given.values():
        defaults = {name: value for name, value in defaults.items() if value != -1}
    return defaults


def _layout_name(shorthand: Strategy, degrees: dict[str, int], *, named: bool) -> Strategy:
    """The layout the resolved degrees run (see the module docstring). A name the user gave decides only
    where the degrees leave it open (a group of one process)."""
    if shorthand in _ONE_PROCESS:
        return shorthand
    replicas, shards = degrees["dp_replicate"] > 1, degrees["dp_shard"] > 1 or degrees["cp"] > 1
    if shorthand in _SHARDED or shards or (replicas and degrees["tp"] > 1):
        return "hsdp" if replicas else "fsdp"
    if replicas:
        return "ddp"
    if degrees["tp"] > 1:
        return "tp"
    if degrees["pp"] > 1:
        return "pp"
    return shorthand if named else "ddp"


def _fill(chosen: dict[str, int], world_size: int) -> dict[str, int]:
    """Replaces the one -1 degree by what the world size leaves; checks the product."""
    degrees = {name: chosen.get(name, 1) for name in MESH_DIMS}
    to_fill = [name for name, value in degrees.items() if value == -1]
    if len(to_fill) > 1:
        raise ConfigError(f"only one degree may be -1, but {', '.join('parallel.' + n for n in to_fill)} are")
    known = math.prod(value for value in degrees.values() if value != -1)
    if to_fill:
        if world_size % known:
            raise ConfigError(_product_message(degrees, world_size, f"the other degrees ({known}) do not divide it"))
        degrees[to_fill[0]] = world_size // known
    elif known != world_size:
        raise ConfigError(_product_message(degrees, world_size, f"their product is {known}"))
    return degrees


def _product_message(degrees: dict[str, int], world_size: int, problem: str) -> str:
    shown = " x ".join(f"parallel.{name}={value}" for name, value in degrees.items())
    return (
        f"{shown} does not fit the world size {world_size}: {problem}; set degrees whose product is "
        f"{world_size}, or one of them to -1"
    )
