"""Process groups for tensor, context, pipeline, data, model and expert parallelism, ranks laid
out tp (fastest) -> cp -> dp -> pp (docs/design.md, contracts 6 and 7); the expert grid ETP x EP x
EDP folds over each stage's ranks (docs/moe.md). Gradients are reduced, and ZeRO shards, over
DP x CP; the DP group alone says which samples a rank reads. The sizes given here are those
``ParallelConfig.validate`` accepted for the world size.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from functools import partial
from typing import List, Optional

import torch
import torch.distributed as dist

from megalite import collectives as C
from megalite.config import ConfigError
from megalite.memory import cuda_peak_bytes


# Device and backend: the only place megalite asks whether CUDA exists (docs/design.md, contract 1).
def resolve_device(device_type: Optional[str], local_rank: int = 0) -> torch.device:
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was given but no CUDA device is available; "
                              "use --device cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")  # (ParallelConfig's choices: cpu or cuda)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (timers need it on GPU; a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on the device since start-up; on CPU, the process's peak RSS."""
    if device.type == "cuda":
        return cuda_peak_bytes(device)
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # pragma: no cover - non-POSIX
        return 0


@dataclass
class ParallelState:
    """Who this rank is in each parallel dimension, and the groups to talk to the others."""

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    cp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    cp_comm_type: str = "p2p"  # --cp-comm-type: how attention crosses the CP group
    tp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None  # the samples: the data loader's group
    cp_group: Optional[dist.ProcessGroup] = None  # one sequence's ranks (context parallelism)
    cp_dp_group: Optional[dist.ProcessGroup] = None  # dp x cp, built where cp > 1
    mp_group: Optional[dist.ProcessGroup] = None  # tp x pp: all but data and context parallelism
    embedding_group: Optional[dist.ProcessGroup] = None  # first + last pipeline stage
    tp_ranks: List[int] = field(default_factory=lambda: [0])
    pp_ranks: List[int] = field(default_factory=lambda: [0])
    dp_ranks: List[int] = field(default_factory=lambda: [0])
    cp_ranks: List[int] = field(default_factory=lambda: [0])
    cp_dp_ranks: List[int] = field(default_factory=lambda: [0])
    embedding_ranks: List[int] = field(default_factory=lambda: [0])
    # HSDP (--num-distributed-optimizer-instances): DP x CP cut into instances of consecutive
    # ranks; the ZeRO state is sharded inside one (shard group), replicated across (replicate).
    instances: int = 1
    shard_group: Optional[dist.ProcessGroup] = None
    shard_ranks: List[int] = field(default_factory=lambda: [0])
    replicate_group: Optional[dist.ProcessGroup] = None
    replicate_ranks: List[int] = field(default_factory=lambda: [0])
    # The expert grid (MoE): ETP x EP x EDP over each stage's ranks; groups of one are None.
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None  # the ranks that share out a layer's experts
    ep_ranks: List[int] = field(default_factory=lambda: [0])
    etp_size: int = 1
    etp_rank: int = 0
    etp_group: Optional[dist.ProcessGroup] = None  # the ranks that split one expert's weights
    etp_ranks: List[int] = field(default_factory=lambda: [0])
    edp_size: int = 1
    edp_rank: int = 0
    edp_group: Optional[dist.ProcessGroup] = None  # expert gradients are reduced over it
    edp_ranks: List[int] = field(default_factory=lambda: [0])
    etp_ep_group: Optional[dist.ProcessGroup] = None  # ETP x EP: the allgather dispatcher's
    etp_ep_ranks: List[int] = field(default_factory=lambda: [0])
    # Virtual pipeline (interleaved) bookkeeping, set by the pipeline code.
    vpp_size: Optional[int] = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: Optional[str] = None

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks

    @property
    def experts_apart(self) -> bool:
        """Whether expert weights take their own path (any of EP, ETP, TP above 1): gradients
        reduced and ZeRO-sharded over EDP, norm summed over ETP x EP, the grid in ZeRO files."""
        return max(self.ep_size, self.etp_size, self.tp_size) > 1

    # Gradients and ZeRO shards: DP x CP, which is the DP group itself when CP is 1 (also in a
    # state built by hand with only a DP group).
    @property
    def dp_cp_group(self) -> Optional[dist.ProcessGroup]:
        return self.dp_group if self.cp_size == 1 else self.cp_dp_group

    @property
    def dp_cp_ranks(self) -> List[int]:
        return self.dp_ranks if self.cp_size == 1 else self.cp_dp_ranks

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_cp_ranks.index(self.rank) if self.cp_size > 1 else self.dp_rank

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    # The ZeRO shards' group: DP x CP, or one instance of it under HSDP.
    @property
    def zero_group(self) -> Optional[dist.ProcessGroup]:
        return self.shard_group if self.instances > 1 else self.dp_cp_group

    @property
    def zero_size(self) -> int:
        return self.dp_cp_size // self.instances

    @property
    def zero_rank(self) -> int:
        return self.dp_cp_rank % self.zero_size

    def describe(self) -> str:
        cp = f"cp {self.cp_rank}/{self.cp_size} " if self.cp_size > 1 else ""
        expert = (f" | etp {self.etp_rank}/{self.etp_size} ep {self.ep_rank}/{self.ep_size} "
                  f"edp {self.edp_rank}/{self.edp_size}"
                  if self.ep_size > 1 or self.etp_size != self.tp_size else "")
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size} "
                f"{cp}dp {self.dp_rank}/{self.dp_size} pp {self.pp_rank}/{self.pp_size}{expert}")


_DEFAULT = ParallelState()


def get_parallel_state() -> ParallelState:
    """The module-level default (a single-process state until initialize_model_parallel runs)."""
    return _DEFAULT


def set_parallel_state(state: ParallelState) -> None:
    global _DEFAULT
    _DEFAULT = state


def grid_groups(grid: torch.Tensor, axes: str, of: str) -> List[List[int]]:
    """The rank lists of the groups spanning the axes ``of`` of ``grid`` (``axes`` names its axes,
    one letter each), in the grid's order: the order every rank creates them in."""
    inner = [axes.index(a) for a in of]
    outer = [i for i in range(grid.dim()) if i not in inner]
    size = math.prod(grid.shape[i] for i in inner)
    return grid.permute(*outer, *inner).reshape(-1, size).tolist()


def rank_grid(world_size: int, tp: int, pp: int, cp: int = 1):
    """The rank lists of every TP, DP, PP, model-parallel (TP x PP), CP and DP x CP group, in the
    tp -> cp -> dp -> pp order (pure function)."""
    dp = world_size // (tp * cp * pp)
    # axes slowest first, so rank = ((p * dp + d) * cp + c) * tp + t (design.md, contract 6)
    groups = partial(grid_groups, torch.arange(world_size).view(pp, dp, cp, tp), "pdct")
    return dp, groups("t"), groups("d"), groups("p"), groups("pt"), groups("c"), groups("dc")


def instance_groups(dp_cp_groups: List[List[int]], dp: int, instances: int, span: int,
                    node_size: Optional[int]):
    """HSDP's (shard groups, replicate groups) (pure function): each DP x CP group cut into
    ``instances`` runs of consecutive ranks, and the ranks of one shard index across them. An
    instance covers ``span`` consecutive ranks (TP peers included): whole nodes, or inside one."""
    flag = f"--num-distributed-optimizer-instances {instances}"
    if dp % instances:
        raise ConfigError(f"{flag} must divide the data-parallel size ({dp}): an instance holds "
                          f"DP/R whole data-parallel ranks")
    if node_size and span % node_size and node_size % span:
        raise ConfigError(f"{flag}: an instance spans {span} ranks (TP x CP x DP/R), which "
                          f"straddles the nodes of {node_size} ranks (LOCAL_WORLD_SIZE); choose "
                          f"R so that an instance is whole nodes or fits in one")
    size = len(dp_cp_groups[0]) // instances
    shard = [g[i:i + size] for g in dp_cp_groups for i in range(0, len(g), size)]
    replicate = [g[j::size] for g in dp_cp_groups for j in range(size)]
    return shard, replicate


def expert_rank_grid(world_size: int, etp: int, ep: int, pp: int):
    """The expert grid over the same ranks (pure function): expert-tensor (ETP, fastest) ->
    expert (EP) -> expert-data (EDP) -> pp. Returns (edp, etp_groups, ep_groups, edp_groups,
    pp_groups); the pipeline groups are the dense grid's."""
    edp = world_size // (etp * ep * pp)
    groups = partial(grid_groups, torch.arange(world_size).view(pp, edp, ep, etp), "pdet")
    return edp, groups("t"), groups("e"), groups("d"), groups("p")


def _init_world(backend: str, rank: int, world_size: int, timeout, init_method, dev):
    """The world group (unless one exists); returns (rank, world size). With NCCL it also gets
    gloo for CPU tensors: the host path of megalite.collectives (run id, error agreement) is legal
    there; every other group is NCCL-only, so a CPU tensor on it fails (and strict mode says so
    on any machine)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    kwargs = dict(backend=world_backend, rank=rank, world_size=world_size, timeout=timeout)
    if init_method is not None:
        kwargs["init_method"] = init_method
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    dist.init_process_group(**kwargs)
    return rank, world_size


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    context_parallel_size: int = 1,
    cp_comm_type: str = "p2p",
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    distributed_optimizer_instances: int = 1,
    backend: Optional[str] = None,
    device: Optional[str] = None,
    timeout_minutes: float = 10.0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    init_method: Optional[str] = None,
    set_default: bool = True,
) -> ParallelState:
    """Initialise torch.distributed (if needed) and build every process group. Rank and world
    size come from torchrun's environment unless given (tests); world size 1 needs no
    ``torch.distributed``. ``expert_tensor_parallel_size`` None means the TP size (as Megatron)."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    cp = context_parallel_size
    dp, tp_groups, dp_groups, pp_groups, mp_groups, cp_groups, dp_cp_groups = rank_grid(
        world_size, tp, pp, cp)
    instances = distributed_optimizer_instances
    shard_groups, replicate_groups = instance_groups(
        dp_cp_groups, dp, instances, world_size // (pp * instances),
        int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size or tp
    edp, etp_groups, ep_groups, edp_groups, _ = expert_rank_grid(world_size, etp, ep, pp)

    dev = resolve_device(device, local_rank)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError("--distributed-backend nccl needs --device cuda; use gloo on CPU")

    if world_size == 1 and not dist.is_initialized():
        state = ParallelState(device=dev, backend=None)
        if set_default:
            set_parallel_state(state)
        return state

    dev = C.configure(dev)
    timeout = datetime.timedelta(minutes=timeout_minutes)  # subgroups default to 30 min otherwise
    rank, world_size = _init_world(backend, rank, world_size, timeout, init_method, dev)

    state = ParallelState(rank=rank, world_size=world_size, tp_size=tp, pp_size=pp, dp_size=dp,
                          cp_size=cp, cp_comm_type=cp_comm_type, device=dev, backend=backend,
                          ep_size=ep, etp_size=etp, edp_size=edp, instances=instances)

    # Every rank must create every group, in the same order (a torch.distributed rule). An expert
    # group with the ranks of a group made before (ETP = TP, and EDP = DP x CP by default; ETP x
    # EP = EP at ETP 1) is that group, not a second communicator, so a dense run creates exactly
    # the groups it did before MoE.
    made = {}

    def make(groups, attr_group, attr_ranks, expert=False):
        for ranks in groups:
            group = made.get(tuple(ranks)) if expert else None
            if group is None and len(ranks) > 1:
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                made.setdefault(tuple(ranks), group)
            if rank in ranks:
                setattr(state, attr_group, group)
                setattr(state, attr_ranks, list(ranks))

    make(tp_groups, "tp_group", "tp_ranks")
    make(dp_groups, "dp_group", "dp_ranks")
    make(pp_groups, "pp_group", "pp_ranks")
    make(mp_groups, "mp_group", "_mp_ranks")
    make(cp_groups, "cp_group", "cp_ranks")
    if cp > 1:  # (at cp 1 the same ranks as dp: one group, not two communicators)
        make(dp_cp_groups, "cp_dp_group", "cp_dp_ranks")
    if instances > 1:
        make(shard_groups, "shard_group", "shard_ranks")
        make(replicate_groups, "replicate_group", "replicate_ranks")
    # Embedding group: first and last stage of each pipeline (tied input/output embeddings).
    embedding_groups = [sorted({g[0], g[-1]}) for g in pp_groups]
    make(embedding_groups, "embedding_group", "embedding_ranks")
    make(etp_groups, "etp_group", "etp_ranks", expert=True)
    make(ep_groups, "ep_group", "ep_ranks", expert=True)
    make(edp_groups, "edp_group", "edp_ranks", expert=True)
    # ETP x EP: all of a layer's experts, the allgather dispatcher's tokens
    etp_ep_groups = grid_groups(torch.arange(world_size).view(pp, edp, ep, etp), "pdet", "et")
    make(etp_ep_groups, "etp_ep_group", "etp_ep_ranks", expert=True)

    for dim in ("tp", "dp", "pp", "cp", "etp", "ep", "edp"):
        setattr(state, f"{dim}_rank", getattr(state, f"{dim}_ranks").index(rank))
    if set_default:
        set_parallel_state(state)
    return state


def destroy_model_parallel() -> None:
    set_parallel_state(ParallelState())
    if dist.is_initialized():
        dist.destroy_process_group()
