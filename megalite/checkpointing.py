"""Sharded, atomic, resumable checkpoints (docs/checkpoints.md).

Layout (Megatron-LM's, so its habits carry over):

    DIR/latest_checkpointed_iteration.txt          "1000"  (written last, atomically)
    DIR/tokenizer/                                 the run's tokenizer (save_pretrained), once
    DIR/iter_0001000/args.json                     the MegaliteConfig of the run that saved
    DIR/iter_0001000/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt
    DIR/iter_0001000/mp_rank_{tp:02d}_{pp:03d}/distrib_optim_dp{d:03d}.pt   (ZeRO, see below)

``model_optim_rng.pt`` holds only tensors and primitive containers, loaded with
``torch.load(weights_only=True)`` (docs/design.md, contract 9): the model chunk(s) under ``"model"``
(or ``"model0"``, ``"model1"``, ... with virtual pipeline stages), ``"optimizer"`` and
``"opt_param_scheduler"`` (unless --no-save-optim), ``"rng_state"``, ``"iteration"``,
``"consumed_samples"`` and the layout it was saved with.

Atomicity: every rank writes into ``DIR/iter_X.tmp-<run id>/``; after a barrier rank 0 renames it
to ``iter_X`` and only then replaces ``latest_checkpointed_iteration.txt`` (temp file +
os.replace). A process killed mid-save leaves a ``.tmp-`` directory that nothing reads, and the
tracker still names the previous, complete checkpoint (docs/design.md, contract 8).

ZeRO seam: an optimizer whose ``sharded_state_dict_per_dp_rank`` is true has its
``state_dict()`` saved by *every* DP rank to ``distrib_optim_dp{d:03d}.pt`` next to the model file
(and loaded back from the same name; at another DP size every rank's file is merged and
re-split); otherwise DP rank 0 saves it inside model_optim_rng.pt. ZeRO-3 model chunks
(``zero_stage == 3``) are consolidated for the model file by a DP collective, so the model file
of every stage has the same full per-(tp, pp) format (docs/zero3.md, "Checkpoints").

Asynchronous saves (``--async-save``): the same plan (``_plan_save``: the collective part) and
the same writer (``_write_plan``), with the plan's objects first copied byte for byte into host
buffers (megalite/host_snapshot.py) and written by a daemon thread; the training thread agrees
on the outcome and publishes at the next log line, save or end (``PendingSave.settle``;
docs/checkpoints.md, "Asynchronous saves").

Experts: a layer whose experts are split over EP ranks is saved by global expert index, its
[E_local, ...] tensors (weights; with the plain optimizer its moments and fp32 masters)
all-gathered over the EP group into the [E, ...] tensors an EP-1 run saves, so the model file does
not depend on the EP size; a load keeps this rank's [offset, offset + E_local) of them. ZeRO 1-3
files stay per DP rank, their expert shards marked with the rank's place in the expert grid; at
another layout the stage's files are merged, experts by global index
(``optimizer.merge_shard_state_dicts``), and the same slice is kept (docs/checkpoints.md,
"Experts").
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from dataclasses import replace
from itertools import chain
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megalite import collectives as C
from megalite.config import (
    CHECKPOINT_ARGS_FIELDS,
    ConfigError,
    MegaliteConfig,
    config_from_dict,
    config_to_json,
    V_SCHEDULES,
    model_shape_differences,
)
from megalite.host_snapshot import HostBuffers, snapshot
from megalite.memory import theoretical_model_state_bytes
from megalite.moe.layer import MoELayer
from megalite.optimizer.optimizer import FULL_FORMAT, merge_shard_state_dicts
from megalite.param_meta import ParamMeta, param_meta
from megalite.tensor_parallel.random import (
    get_all_rng_states,
    model_parallel_seed,
    set_all_rng_states,
)
from megalite.tensor_parallel.utils import shard_tensor, unshard_tensors

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 1
RESHARD_HINT = ("reshard it to this layout first with "
                "`python tools/checkpoint/convert.py reshard` (docs/checkpoints.md)")
# A loader of this rank's files at another layout, chosen by the caller (training.py passes
# convert.checkpoint_tools.load_resharded, which lives above this module):
# (load_dir, iteration, cfg, ps, with_optim) -> (model file dict, optimizer state or None).
Resharder = Callable[[str, int, MegaliteConfig, object, bool], Tuple[dict, Optional[dict]]]

# Test seam: called as hook(stage, path) at points of a save ("write_file" before each file of a
# rank, "shard_written" after them, "before_rename", ...; with --async-save the first two on the
# background writer); a fault-injection test sets it to raise or os._exit() to prove saves are
# atomic and failures reach every rank.
fault_hook: Optional[Callable[[str, str], None]] = None


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked; the message says which file and why."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _loadable_iteration_dir(root: str, iteration: int) -> str:
    """``iter_X``, or while a re-save of X swaps it (or after a crash there), the old copy."""
    final = iteration_dir(root, iteration)
    if not os.path.isdir(final):
        import glob

        olds = sorted(glob.glob(f"{final}.old-*"), key=os.path.getmtime)
        if olds:
            return olds[-1]
    return final


def shard_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def distrib_optim_name(dp_rank: int) -> str:
    return f"distrib_optim_dp{dp_rank:03d}.pt"


def _barrier(ps) -> None:
    if ps.world_size > 1:
        C.barrier()


def new_run_id(ps) -> int:
    """An id shared by all ranks of this run (names the temp directories of its saves).

    A control message: a CPU tensor on the host path (gloo), legal on GPU runs too.
    """
    t = torch.tensor([int.from_bytes(os.urandom(4), "little") if ps.rank == 0 else 0],
                     dtype=torch.int64)
    if ps.world_size > 1:
        C.broadcast(t, src=0, group=C.world_group(), tag="checkpoint_run_id", host=True)
    return int(t.item())


def _chunk_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


# ------------------------------------------------------------------------------------------------
# Save
# ------------------------------------------------------------------------------------------------
class _SavePlan(NamedTuple):
    """What one rank writes for one save: every file and its content, in order."""
    save_dir: str
    iteration: int
    final: str
    tmp: str
    shard: str  # this rank's mp_rank_* directory (fsynced once its files are written)
    files: list  # [(path, object for torch.save)]
    args_json: Optional[bytes]  # rank 0: args.json
    run_id: int


def save_checkpoint(save_dir: str, iteration: int, model_chunks, optimizer, scheduler,
                    consumed_samples: int, cfg: MegaliteConfig, ps, run_id: int) -> str:
    """Write iteration ``iteration`` atomically and durably; returns the final directory.

    Collective. A rank whose write fails (no space, no permission) makes every rank raise a
    CheckpointError naming it and the file at the next agreement point, not at the distributed
    timeout; the partial ``.tmp-`` directory is removed and the tracker still names the previous
    checkpoint.
    """
    plan = _plan_save(save_dir, iteration, model_chunks, optimizer, scheduler, consumed_samples,
                      cfg, ps, run_id)
    # (on a GPU the device tensors go to plain host memory one file at a time: the same bytes as
    # an asynchronous save's host snapshot, whose storages say "cpu")
    on_host = (lambda obj: obj) if ps.device.type == "cpu" else \
        (lambda obj: snapshot(obj, copy_host=False))
    error = _attempt(lambda: _write_plan(plan, ps, on_host))
    _agree_on_save(ps, error, iteration, plan.tmp)  # every shard is durable before it is visible
    _publish_agreed(plan, ps)
    return plan.final


def _plan_save(save_dir: str, iteration: int, model_chunks, optimizer, scheduler,
               consumed_samples: int, cfg: MegaliteConfig, ps, run_id: int) -> _SavePlan:
    """The collective part of a save: the temp directory (agreed), ZeRO-3 and expert gathers,
    and the objects this rank's files hold (still the live tensors: a synchronous save writes
    them now, an asynchronous one copies them first)."""
    final = iteration_dir(save_dir, iteration)
    tmp = f"{final}.tmp-{run_id:08x}"
    shard = os.path.join(tmp, shard_dir_name(ps.tp_rank, ps.pp_rank))
    save_optim = not cfg.checkpoint.no_save_optim
    per_dp = bool(getattr(optimizer, "sharded_state_dict_per_dp_rank", False))

    error = None
    if ps.rank == 0:
        error = _attempt(lambda: os.makedirs(tmp, exist_ok=True))
    _agree_on_save(ps, error, iteration, tmp)
    full = _gather_zero3_models(model_chunks, ps, iteration, tmp)
    experts = _gather_experts(model_chunks, optimizer, save_optim and not per_dp, ps, iteration,
                              tmp)
    files = []
    if ps.dp_cp_rank == 0:  # CP peers hold the same model: one writer
        state = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": int(iteration),
            "consumed_samples": int(consumed_samples),
            "tensor_model_parallel_size": ps.tp_size,
            "pipeline_model_parallel_size": ps.pp_size,
            "num_model_chunks": len(model_chunks),
            "rng_state": get_all_rng_states(ps.device),
        }
        for i, chunk in enumerate(model_chunks):
            sd = full[i] if full[i] is not None else chunk.state_dict()
            for (_, c, key), t in experts.get("model", {}).items():
                if c == i:
                    sd[key] = t
            state[_chunk_key(i, len(model_chunks))] = sd
        if save_optim:
            state["opt_param_scheduler"] = scheduler.state_dict()
            if not per_dp:
                state["optimizer"] = _with_full_experts(optimizer.state_dict(), experts)
        files.append((os.path.join(shard, MODEL_FILE), state))
    if save_optim and per_dp:
        files.append((os.path.join(shard, distrib_optim_name(ps.dp_cp_rank)),
                      optimizer.state_dict()))
    args_json = config_to_json(cfg).encode() if ps.rank == 0 else None
    return _SavePlan(save_dir, iteration, final, tmp, shard, files, args_json, run_id)


def _write_plan(plan: _SavePlan, ps, prepare=lambda obj: obj) -> None:
    """Write one rank's files of a save through the one fsynced writer; no collective (it runs
    on the background writer of an asynchronous save too). ``prepare``: the object a file is
    written from (a synchronous save copies device tensors to the host one file at a time, so
    both kinds of save write the same bytes). A failure names the file."""
    for path, obj in plan.files:
        try:
            if fault_hook is not None:
                fault_hook("write_file", path)
            os.makedirs(plan.shard, exist_ok=True)
            save_file(path, prepare(obj))
        except Exception as e:
            raise CheckpointError(f"writing {path}: {C.one_line(e)}") from e
    if fault_hook is not None:
        fault_hook("shard_written", plan.tmp)
    if plan.args_json is not None:
        path = os.path.join(plan.tmp, "args.json")
        try:
            _write(path, lambda f: f.write(plan.args_json))
        except Exception as e:
            raise CheckpointError(f"writing {path}: {C.one_line(e)}") from e
    if os.path.isdir(plan.shard):
        _fsync_dir(plan.shard)


def _publish_agreed(plan: _SavePlan, ps) -> None:
    """Once every rank agreed its files are durable: rank 0 makes the save visible."""
    error = None
    if ps.rank == 0:
        error = _attempt(lambda: _publish(plan.save_dir, plan.final, plan.tmp, plan.iteration,
                                          plan.run_id))
    _agree_on_save(ps, error, plan.iteration, plan.tmp)


def snapshot_share_bytes(cfg: MegaliteConfig, ps) -> int:
    """Host bytes of one snapshot of this rank's share, from the model state (docs/theory.md's
    per-rank formula): the model file's weights (a writer's: the whole (TP, PP) shard, ZeRO-3's
    consolidated too) plus this rank's fp32 masters and Adam moments (1/DP of them under ZeRO)."""
    psi = cfg.model.num_parameters() / (ps.tp_size * ps.pp_size)
    st = theoretical_model_state_bytes(int(psi), ps.dp_cp_size, cfg.optimizer.zero_stage,
                                       cfg.model.params_dtype)
    weights = st["params_bytes"] * (ps.dp_cp_size if cfg.optimizer.zero_stage >= 3 else 1)
    optim = 0 if cfg.checkpoint.no_save_optim else (st["master_params_bytes"]
                                                    + st["optimizer_states_bytes"])
    return int(weights + optim)


def host_memory_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_async_save_memory(cfg: MegaliteConfig, ps) -> int:
    """--async-save keeps one host copy of the rank's share while it is written: refuse at
    start-up, on every rank alike, a run whose ranks on this host cannot hold theirs together
    (rather than swap or be killed mid-run). Returns this rank's estimate."""
    need = snapshot_share_bytes(cfg, ps)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = host_memory_available()
    bad = torch.tensor([1.0 if avail is not None and need * local > avail else 0.0])  # host path
    if ps.world_size > 1:
        C.all_reduce(bad, group=C.world_group(), op=C.ReduceOp.MAX, tag="async_save_memory",
                     host=True)
    if bad.item() > 0:
        gib = 2.0 ** 30
        have = "another rank's host" if avail is None or need * local <= avail else \
            f"{avail / gib:.1f} GiB available (/proc/meminfo MemAvailable)"
        raise CheckpointError(
            f"--async-save: one host copy of each rank's checkpoint share is ~{need / gib:.1f} GiB "
            f"x {local} rank(s) on this host, more than {have}; drop --async-save to save "
            f"synchronously, or spread the model over more hosts")
    return need


def _yield_cpu() -> None:
    """Run the calling thread at a low CPU priority (nice 10; Linux nice is per thread): where every
    core is busy, the training thread keeps its share and the write, bound by the disk, takes
    longer instead (docs/checkpoints.md, "Thread, not process")."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
        pass


class PendingSave:
    """An asynchronous save in flight: this rank's snapshot, written by a daemon thread through
    the synchronous save's writer (``_write_plan``); published by :meth:`settle` once every rank
    agrees its files are durable. The thread makes no collective: every agreement is made by the
    training thread, at a point every rank reaches (a log line, the next save, the end)."""

    def __init__(self, plan: _SavePlan, buffers: HostBuffers, ps):
        self.plan, self.ps, self.buffers = plan, ps, buffers
        self.error: Optional[BaseException] = None
        self.started = time.perf_counter()
        self.write_s: Optional[float] = None
        self.cpu_s: Optional[float] = None
        self.thread = threading.Thread(target=self._run, name="megalite-checkpoint-writer",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cpu = time.thread_time()
        try:
            _yield_cpu()
            self.buffers.ready()
            _write_plan(self.plan, self.ps)
        except BaseException as e:  # reported by settle, on every rank
            self.error = e
        self.cpu_s = time.thread_time() - cpu  # what the write took from training's cores
        self.write_s = time.perf_counter() - self.started

    def join(self) -> None:
        """Wait for this rank's writer (no collective: also on the way out of a failed run)."""
        self.thread.join()

    def settle(self, wait: bool) -> bool:
        """Collective. True once the save is published; False while some rank still writes
        (``wait`` False only). A failure on any rank raises CheckpointError on every rank, naming
        the rank and its file, after every rank's writer stopped; the temp directory is removed
        and the tracker keeps naming the previous checkpoint."""
        ps, plan = self.ps, self.plan
        if wait:
            self.join()
        flags = torch.tensor([0.0 if not self.thread.is_alive() else 1.0,
                              1.0 if self.error is not None else 0.0])  # host path
        if ps.world_size > 1:
            C.all_reduce(flags, group=C.world_group(), op=C.ReduceOp.MAX,
                         tag="checkpoint_async_flags", host=True)
        if flags[1] > 0:
            self.join()
            _agree_on_save(ps, self.error, plan.iteration, plan.tmp)
        if flags[0] > 0:
            return False
        _publish_agreed(plan, ps)
        return True


def start_async_save(save_dir: str, iteration: int, model_chunks, optimizer, scheduler,
                     consumed_samples: int, cfg: MegaliteConfig, ps, run_id: int,
                     buffers: HostBuffers) -> PendingSave:
    """--async-save: the collective part of a save, then a host snapshot of exactly what a
    synchronous save writes (into ``buffers``, reused across saves), then a background writer.
    Collective; the caller has settled any earlier save (at most one in flight)."""
    plan = _plan_save(save_dir, iteration, model_chunks, optimizer, scheduler, consumed_samples,
                      cfg, ps, run_id)
    buffers.begin()
    files = [(path, snapshot(obj, buffers)) for path, obj in plan.files]
    buffers.end(ps.device)
    return PendingSave(plan._replace(files=files), buffers, ps)


def _gather_zero3_models(model_chunks, ps, iteration: int, tmp: str) -> list:
    """ZeRO-3 chunks hold 1/N of every parameter: the consolidated model (same keys and shapes as
    a stage-0 checkpoint, so --finetune, --no-load-optim and the conversion tools read it) is
    all-gathered unit by unit, a collective every DP rank joins; only DP rank 0 keeps it.

    Pre-checked, so a rank that cannot gather (out of memory, say) stops every rank with its own
    error instead of leaving its peers in the gather: every rank first allocates what the gather
    allocates (the largest unit's flat buffer; on DP rank 0 also the kept model), frees it (the
    caching allocator hands it back to the gather) and the ranks agree before any gather starts.
    """
    units = [u for c in model_chunks if getattr(c, "zero_stage", 0) == 3 for u in c.units]
    if not units:
        return [None] * len(model_chunks)

    def precheck():
        if fault_hook is not None:
            fault_hook("before_zero3_gather", tmp)
        probe = [torch.empty(max(u.padded for u in units), dtype=units[0].main.dtype,
                             device=units[0].device)]
        if ps.dp_cp_rank == 0:
            probe.append(torch.empty(sum(u.numel for u in units), device=units[0].device,
                                     dtype=model_chunks[0].compute_dtype))
        del probe

    _agree_on_save(ps, _attempt(precheck), iteration, tmp)
    return [chunk.full_state_dict(keep=ps.dp_cp_rank == 0)
            if getattr(chunk, "zero_stage", 0) == 3 else None for chunk in model_chunks]


class _Expert(NamedTuple):
    """One expert tensor of a MoE layer."""
    chunk: int
    key: str  # in the chunk's state_dict
    param: torch.nn.Parameter
    shape: Tuple[int, ...]  # this rank's [E_local, ...] (a ZeRO-3 parameter's data is a stand-in)
    first: int  # global index of its first expert
    total: int  # E
    group: object  # the EP group that holds the other E - E_local


def _experts_of(model_chunks) -> list:
    """Every expert tensor of every MoE layer on this rank."""
    out = []
    for i, chunk in enumerate(model_chunks):
        module = getattr(chunk, "module", chunk)  # a DDP / ZeRO-3 wrapper's keys are its module's
        shapes = {n: tuple(s) for u in getattr(chunk, "units", ()) for n, s in zip(u.names,
                                                                                  u.shapes)}
        for prefix, m in module.named_modules():
            if not isinstance(m, MoELayer):
                continue
            for name, p in m.named_parameters(recurse=False):
                if param_meta(p).expert:
                    key = f"{prefix}.{name}" if prefix else name
                    out.append(_Expert(i, key, p, shapes.get(key, tuple(p.shape)),
                                       m.local_expert_offset, m.num_experts, m.ep_group))
    return out


def _split_experts(model_chunks) -> list:
    """The expert tensors this rank holds a part of: split over EP ranks (E_local < E) or, under
    ETP > 1, sliced over the ETP group (their metadata's ``tp_split``)."""
    return [e for e in _experts_of(model_chunks)
            if e.shape[0] != e.total or param_meta(e.param).tp_split]


def _whole_shape(e: "_Expert", ps) -> Tuple[int, ...]:
    """[E, ...] of one whole expert tensor: E_local x EP experts, each with its ETP slices."""
    shape, m = [e.total, *e.shape[1:]], param_meta(e.param)
    if m.tp_split:
        shape[m.partition_dim] *= ps.etp_size
    return tuple(shape)


def _gather_whole(t: torch.Tensor, e: "_Expert", ps) -> torch.Tensor:
    """This rank's part of an expert tensor -> the whole [E, ...] one: the ETP slices joined
    along the parameter's partition dim, then the EP ranks' experts along dim 0."""
    m = param_meta(e.param)
    if m.tp_split and ps.etp_size > 1:
        parts = t.new_empty((ps.etp_size,) + tuple(t.shape))
        C.all_gather_into_tensor(parts.view(-1, *t.shape[1:]), t, group=ps.etp_group,
                                 tag="checkpoint_experts")
        t = unshard_tensors(list(parts.unbind(0)), m.partition_dim, m.partition_stride)
    if C.group_size(e.group) > 1:
        full = t.new_empty((t.shape[0] * C.group_size(e.group),) + tuple(t.shape[1:]))
        C.all_gather_into_tensor(full, t, group=e.group, tag="checkpoint_experts")
        t = full
    return t


def _optimizer_slots(optimizer, experts):
    """(expert, index in the fp32 master list, index in torch's packed state, master) per expert
    tensor: the plain optimizer keys both by the parameter's position, whatever the EP size."""
    index = {id(p): i for i, p in enumerate(optimizer.model_params)}
    packed = {id(m): j for j, m in
              enumerate(chain.from_iterable(g["params"] for g in optimizer.param_groups))}
    for e in experts:
        i = index.get(id(e.param))
        if i is not None:
            m = optimizer.masters[i]
            yield e, i, packed[id(m)], m


def _gather_experts(model_chunks, optimizer, with_optim: bool, ps, iteration: int,
                    tmp: str) -> dict:
    """The whole [E, ...] tensors of every expert tensor split over EP or sliced over ETP (model,
    and with ``with_optim`` the optimizer's moments and fp32 masters), all-gathered over each
    layer's ETP and EP groups one tensor at a time (``_gather_whole``); the writers (DP x CP rank
    0) keep them, the other ranks only take part. So the files hold whole experts whatever the
    EP and ETP sizes.

    A ZeRO-3 chunk holds 1/EDP of its expert weights: each rank first all-gathers its expert
    units over EDP (its EP rank's [E_local, ...], kept until its own gathers are done: every rank
    is some writer's EP peer), which its ZeRO-3 consolidation gathered only for DP rank 0.

    The ranks of an EP group run the same gathers in the same order (the group lies inside one
    pipeline stage, whose ranks hold the same layers); a pre-check as ZeRO-3's, agreed by every
    rank of the world, makes a rank that could not allocate them stop every rank instead of
    leaving its EP peers in a gather."""
    if ps.ep_size == 1 and ps.etp_size == 1:  # (every rank of the world has the same sizes)
        return {}
    experts = _split_experts(model_chunks)  # none on a stage of dense layers: it still agrees
    zero3 = {i for i, c in enumerate(model_chunks) if getattr(c, "zero_stage", 0) == 3}
    units = [(i, model_chunks[i], u) for i in sorted(zero3) for u in model_chunks[i].units
             if u.expert]
    local = {}  # (chunk, key) -> a ZeRO-3 expert weight at [E_local, ...], filled below
    # (where, this rank's tensor, its shape and dtype, group); tensors are fetched when gathered
    jobs = [(("model", e.chunk, e.key),
             (lambda e=e: local[(e.chunk, e.key)]) if e.chunk in zero3 else (lambda e=e: e.param),
             e.param.dtype, e) for e in experts]
    if with_optim:
        for e, i, j, m in _optimizer_slots(optimizer, experts):
            st = optimizer.inner.state.get(m, {})
            jobs += [(("state", j, k), lambda t=st[k]: t, st[k].dtype, e)
                     for k in sorted(st) if torch.is_tensor(st[k]) and st[k].shape == m.shape]
            if m is not e.param:  # a 16-bit model's fp32 master
                jobs.append((("master", i), lambda m=m: m, m.dtype, e))
    keep = ps.dp_cp_rank == 0

    def full_of(dtype, e):
        return torch.empty(_whole_shape(e, ps), dtype=dtype, device=ps.device)

    def precheck():
        if fault_hook is not None:
            fault_hook("before_expert_gather", tmp)
        probe = [torch.empty(u.padded, dtype=u.main.dtype, device=u.device) for _, _, u in units]
        if jobs:
            fulls = [j[2:] for j in jobs]
            probe += [full_of(*f) for f in fulls] if keep else [full_of(*max(
                fulls, key=lambda f: math.prod(_whole_shape(f[1], ps))
                * torch.empty((), dtype=f[0]).element_size()))]
        del probe

    _agree_on_save(ps, _attempt(precheck), iteration, tmp)
    out = {}
    with torch.no_grad():
        for i, chunk, u in units:
            flat = chunk.gather_flat(u, u.main)
            local.update({(i, k): v.to(chunk.compute_dtype)
                          for k, v in chunk.split_flat(u, flat).items()})
            del flat
        for where, tensor, _, e in jobs:
            full = _gather_whole(tensor().detach().contiguous(), e, ps)
            if keep:
                out[where] = full
    return {"model": {w: t for w, t in out.items() if w[0] == "model"},
            "state": {w[1:]: t for w, t in out.items() if w[0] == "state"},
            "master": {w[1]: t for w, t in out.items() if w[0] == "master"}}


def _with_full_experts(sd: dict, experts: dict) -> dict:
    """The plain optimizer's state_dict with the gathered expert tensors in place of this rank's
    (the per-parameter dicts are the live state's own: replaced, never written into)."""
    packed = sd["optimizer"]["state"]
    for (j, k), t in experts.get("state", {}).items():
        packed[j] = {**packed[j], k: t}
    for i, t in experts.get("master", {}).items():
        sd["fp32_master_params"][i] = t
    return sd


def _keep_local_experts(state: dict, opt_sd: Optional[dict], model_chunks, optimizer,
                        ps) -> None:
    """On load, in place: this rank's [first, first + E_local) of every saved [E, ...] tensor of
    the model and the optimizer (the plain optimizer's state, or a ZeRO optimizer's merged
    FULL_FORMAT one, whose experts are also whole over ETP: this rank's ETP slice is cut by the
    parameter's own partition dim)."""
    experts = _experts_of(model_chunks)
    if not experts:
        return

    def local(t, e, what, etp: bool = False):
        if t.shape[0] != e.total:
            raise CheckpointError(f"{what} holds {t.shape[0]} experts along dim 0, this model "
                                  f"{e.total} (a checkpoint of this model stores all of them)")
        t = t.narrow(0, e.first, e.shape[0])
        m = param_meta(e.param)
        if etp and m.tp_split:
            t = shard_tensor(t, m.partition_dim, ps.etp_rank, ps.etp_size, m.partition_stride)
        return t.clone()

    split = _split_experts(model_chunks)
    for e in split:
        sd = state.get(_chunk_key(e.chunk, len(model_chunks)), {})
        if e.key in sd:  # a missing key is reported by load_state_dict
            sd[e.key] = local(sd[e.key], e, e.key, etp=True)
    if opt_sd is None:
        return
    if opt_sd.get("format") == FULL_FORMAT:
        names = {id(p): n for n, p in optimizer.param_names.items()}
        params = opt_sd["params"]
        for e in experts:
            name = names.get(id(e.param))
            if name in params and (e.shape[0] != e.total or param_meta(e.param).tp_split):
                params[name] = {k: local(v, e, f"the optimizer's {k} of {name}", etp=True)
                                for k, v in params[name].items()}
        return
    packed, masters = opt_sd["optimizer"]["state"], opt_sd.get("fp32_master_params")
    for e, i, j, m in _optimizer_slots(optimizer, split):
        st = packed.get(j, {})
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() == m.dim():
                st[k] = local(v, e, f"the optimizer's {k} of {e.key}", etp=True)
        if masters is not None and i < len(masters):
            masters[i] = local(masters[i], e, f"the fp32 master of {e.key}", etp=True)


def _attempt(fn) -> Optional[BaseException]:
    try:
        fn()
    except Exception as e:  # OSError (ENOSPC, EACCES, EIO...) or torch.save's RuntimeError
        return e
    return None


def _write(path: str, write) -> None:
    """Write a file and fsync it, so a crash after the tracker names it cannot lose it."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_file(path: str, obj) -> None:
    """The one writer of checkpoint files (model and optimizer shards; pretrain.py and the
    converter): ``torch.save``, flushed and fsynced."""
    _write(path, lambda f: torch.save(obj, f))


def _fsync_dir(path: str) -> None:
    """fsync a directory: makes the names created or renamed in it durable (POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(save_dir: str, final: str, tmp: str, iteration: int, run_id: int) -> None:
    """Rank 0, after every shard is durable: tmp -> iter_X, then the tracker (temp + replace)."""
    if fault_hook is not None:
        fault_hook("before_rename", tmp)
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        # Re-saving an iteration (e.g. after a resume): the complete old copy is only renamed
        # until the new one is in place, and the loader falls back to it in between.
        old = f"{final}.old-{run_id:08x}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    tracker_tmp = os.path.join(save_dir, f".{TRACKER_FILE}.tmp-{run_id:08x}")
    _write(tracker_tmp, lambda f: f.write(str(iteration).encode()))
    os.replace(tracker_tmp, os.path.join(save_dir, TRACKER_FILE))
    _fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _agree_on_save(ps, error: Optional[BaseException], iteration: int, tmp: str) -> None:
    """A barrier that also agrees on failure: if any rank's write failed, all raise at once."""
    failed = None
    # our own errors are sentences naming the file already; others are quoted with their type
    if error is None:
        said = None
    elif isinstance(error, CheckpointError):
        said = (str(error).strip().splitlines() or ["CheckpointError"])[0][:300]
    else:
        said = C.one_line(error)
    if ps.world_size > 1:
        flag = torch.tensor([ps.rank if error is not None else ps.world_size])  # host path
        C.all_reduce(flag, group=C.world_group(), op=C.ReduceOp.MIN, tag="checkpoint_save_flag",
                     host=True)
        if int(flag.item()) < ps.world_size:
            failed = int(flag.item())
            msg = C.all_gather_object(said, C.world_group())[failed]
    elif error is not None:
        failed, msg = ps.rank, said
    if failed is None:
        return
    if ps.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing that looks like a checkpoint is left
    raise CheckpointError(f"saving checkpoint iteration {iteration} failed on rank {failed}: "
                          f"{msg}; the previous checkpoint is untouched")


def save_tokenizer(save_dir: str, tokenizer, ps) -> None:
    """Once per run, rank 0: tools/generate.py decodes with the run's own tokenizer. Written
    aside; an identical copy is kept, a different one swapped out only once the new is complete."""
    if ps.rank != 0 or tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return
    import filecmp

    target = os.path.join(save_dir, "tokenizer")
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(target):
        names = sorted(os.listdir(tmp))
        if names == sorted(os.listdir(target)) and \
                len(filecmp.cmpfiles(tmp, target, names, shallow=False)[0]) == len(names):
            shutil.rmtree(tmp)
            return
        old = f"{target}.old-{os.getpid()}"
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)


# ------------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------------
def read_tracker(load_dir: str) -> Optional[int]:
    """The latest complete iteration in ``load_dir``, or None if there is no tracker file."""
    path = os.path.join(load_dir, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"--load {load_dir}: {TRACKER_FILE} is corrupt (holds {text!r}, "
                              f"expected an iteration number)")


def read_checkpoint_config(load_dir: str, iteration: Optional[int] = None) -> MegaliteConfig:
    """The MegaliteConfig saved with a checkpoint (args.json)."""
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            raise CheckpointError(f"--load {load_dir}: no {TRACKER_FILE} there (not a megalite "
                                  f"checkpoint directory, or no save has completed)")
    path = os.path.join(_loadable_iteration_dir(load_dir, iteration), "args.json")
    try:
        with open(path) as f:
            return config_from_dict(json.load(f))
    except FileNotFoundError:
        raise CheckpointError(f"--load {load_dir}: {path} is missing (incomplete checkpoint)")
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"--load {load_dir}: {path} is corrupt ({e})")


def with_checkpoint_args(cfg: MegaliteConfig) -> MegaliteConfig:
    """--use-checkpoint-args: ``cfg`` with the model shape and the tokenizer of ``--load``.

    The model fields come from the checkpoint's args.json. The tokenizer is the one saved in
    ``DIR/tokenizer/`` (pretrain.py and ``convert.py hf-to-megalite`` write it), else the one
    args.json names; a ``--tokenizer-type`` or ``--tokenizer-model`` given on the command line wins.
    """
    load = cfg.checkpoint.load
    saved = read_checkpoint_config(load)
    model = replace(cfg.model, **{n: getattr(saved.model, n) for n in CHECKPOINT_ARGS_FIELDS})
    data = cfg.data
    if data.tokenizer_type is None and data.tokenizer_model is None:
        folder = os.path.join(load, "tokenizer")
        if os.path.isdir(folder):
            data = replace(data, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder)
        else:
            data = replace(data, tokenizer_type=saved.data.tokenizer_type,
                           tokenizer_model=saved.data.tokenizer_model,
                           vocab_size=saved.data.vocab_size)
    return replace(cfg, model=model, data=data)


def _load_file(path: str, what: str, mmap: bool = False):
    if not os.path.isfile(path):
        raise CheckpointError(f"{what}: {path} is missing (incomplete checkpoint)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, bad pickle, disallowed global, ...
        raise CheckpointError(f"{what}: {path} is corrupt or truncated ({C.one_line(e, 200)})")


def _agree_on_errors(ps, error: Optional[BaseException]) -> None:
    """If any rank failed to load, every rank raises (so none waits forever in a collective)."""
    flag = torch.tensor([1.0 if error is not None else 0.0])  # host path, as new_run_id
    if ps.world_size > 1:
        C.all_reduce(flag, group=C.world_group(), op=C.ReduceOp.MAX, tag="checkpoint_error_flag",
                     host=True)
    if flag.item() > 0:
        if error is not None:
            raise error
        raise CheckpointError("loading the checkpoint failed on another rank (see its message)")


def _load_dp_files(shard: str, what: str) -> List[dict]:
    """Every DP rank's ZeRO optimizer file of one (TP, PP) directory, each once, or a one-line
    error naming the file that is missing."""
    import glob

    files = sorted(glob.glob(os.path.join(shard, "distrib_optim_dp*.pt")))
    if not files:
        raise CheckpointError(f"{what}: {shard} has no distrib_optim_dp*.pt (the checkpoint's "
                              f"optimizer state is not sharded per DP rank); resume with the "
                              f"--zero-stage that saved it, or pass --no-load-optim")
    sds = [_load_file(f, what) for f in files]
    gone = [distrib_optim_name(d) for d in range(int(sds[0].get("dp_size", 0)))
            if not os.path.exists(os.path.join(shard, distrib_optim_name(d)))]
    if gone:  # a file of the saving DP group is missing: name it, not the merge that fails
        raise CheckpointError(f"{what}: {os.path.join(shard, gone[0])} is missing (incomplete "
                              f"checkpoint)")
    return sds


def _load_dp_sharded_optimizer_state(it_dir: str, optimizer, ps, what: str) -> dict:
    """This DP rank's ZeRO optimizer shard; if it was saved at another DP size (or bucket layout,
    ZeRO stage, EP size), every DP rank's file merged into the unsharded state
    (``optimizer.merge_shard_state_dicts``), which the optimizer's load_state_dict re-splits for
    this layout (docs/data_parallel.md, "resharding"). Files that shard experts over an
    expert-data-parallel group bring the stage's other TP ranks' files along: that group can
    span them."""
    shard = os.path.join(it_dir, shard_dir_name(ps.tp_rank, ps.pp_rank))
    own = os.path.join(shard, distrib_optim_name(ps.dp_cp_rank))
    fits = getattr(optimizer, "shard_fits", None)
    if os.path.exists(own):
        sd = _load_file(own, what)
        if fits is None or fits(sd):
            return sd
    elif fits is None:
        raise CheckpointError(f"{what}: no {distrib_optim_name(ps.dp_cp_rank)} (saved with fewer "
                              f"data-parallel ranks); resume with the same data-parallel size")
    sds = _load_dp_files(shard, what)
    stage = []
    if "edp_size" in sds[0] and ps.tp_size > 1:
        for t in range(ps.tp_size):
            other = os.path.join(it_dir, shard_dir_name(t, ps.pp_rank))
            stage += sds if t == ps.tp_rank else _load_dp_files(other, what)
    metas = {n: param_meta(p) for n, p in getattr(optimizer, "param_names", {}).items()}
    try:
        return merge_shard_state_dicts(sds, stage, lambda n: metas.get(n, ParamMeta()))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{what}: the distrib_optim_dp*.pt files in {shard} do not fit this "
                              f"optimizer ({e}); resume with the --zero-stage that saved them, "
                              f"or pass --no-load-optim")


def _layout_of(cfg: MegaliteConfig, num_chunks: int) -> tuple:
    """What decides which rank's files hold which tensors: TP, PP, the virtual stages and the
    stage cuts (DP, CP and EP do not: their ranks' model files are identical or whole)."""
    p, t = cfg.parallel, cfg.training
    return (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, num_chunks,
            t.decoder_first_pipeline_num_layers, t.decoder_last_pipeline_num_layers,
            t.pipeline_schedule in V_SCHEDULES)


def _describe_layout(cfg: MegaliteConfig, num_chunks: int, per_dp: bool) -> str:
    p = cfg.parallel
    v = f" x {num_chunks} virtual stages" if num_chunks > 1 else ""
    return (f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size}{v}, "
            f"{'ZeRO' if per_dp else 'plain (ZeRO 0)'} optimizer")


def _reseeded_rng(seed: int, iteration: int, ps) -> dict:
    """The RNG states of a rank resuming at another layout: its saved generators belong to
    another rank grid, so every generator is seeded as a run with ``--seed seed + iteration``
    seeds this rank (``model_parallel_seed``: torch's default and TP streams, Python's random and
    NumPy). Returned, not set: the caller sets it right before the first step, as it sets a
    loaded state."""
    before = get_all_rng_states(ps.device)
    model_parallel_seed(seed + iteration, ps.tp_rank, ps.pp_rank, ps.device)
    out = get_all_rng_states(ps.device)
    set_all_rng_states(before, ps.device)
    return out


def load_checkpoint(cfg: MegaliteConfig, model_chunks, optimizer, scheduler, ps,
                    reshard: Optional[Resharder] = None,
                    log: Optional[Callable[[str], None]] = None
                    ) -> Tuple[int, int, Optional[dict]]:
    """Restore from ``cfg.checkpoint.load``. Collective.

    Returns (iteration, consumed_samples, rng_state or None). The RNG state is returned, not set,
    so the caller can restore it right before the first training step, after everything that
    might draw random numbers during start-up (DESIGN: bit-exact resume).

    A checkpoint of another TP / PP / virtual-stage layout, or of the other optimizer kind
    (ZeRO 0 <-> ZeRO >= 1), is read through ``reshard`` (each rank assembles its own files from
    the saved ones; docs/checkpoints.md, "Resharding on load"); without one it is refused with
    the converter's hint. Its RNG is then re-seeded (``_reseeded_rng``), said once on ``log``.
    """
    ck = cfg.checkpoint
    load_dir = ck.load
    what = f"--load {load_dir}"
    iteration = None
    error = None
    try:
        if not os.path.isdir(load_dir):
            raise CheckpointError(f"{what}: no such directory")
        iteration = read_tracker(load_dir)
    except Exception as e:  # e.g. an unreadable tracker: every rank must hear of it
        error = e if isinstance(e, CheckpointError) else CheckpointError(f"{what}: {C.one_line(e)}")
    _agree_on_errors(ps, error)
    if iteration is None:
        if ck.exit_on_missing_checkpoint:
            raise CheckpointError(f"{what}: no {TRACKER_FILE} (no completed checkpoint) and "
                                  f"--exit-on-missing-checkpoint was given")
        if ck.load != ck.save:
            raise CheckpointError(f"{what}: no {TRACKER_FILE} there (not a megalite checkpoint "
                                  f"directory, or no save has completed)")
        return 0, 0, None  # --save X --load X on a first run: start from scratch

    # Phase 1, local: read and validate every file this rank needs and copy it into this rank's
    # own tensors; any exception counts. Phase 2, after every rank agrees phase 1 succeeded: the
    # collectives (ZeRO-1/2's parameter all-gather). A rank that failed can then never leave its
    # peers waiting in a collective it does not join.
    it_dir = _loadable_iteration_dir(load_dir, iteration)
    state, file, resharded = None, None, None
    load_optim = not (ck.finetune or ck.no_load_optim)
    per_dp = bool(getattr(optimizer, "sharded_state_dict_per_dp_rank", False))
    try:
        if not os.path.isdir(it_dir):
            raise CheckpointError(f"{what}: {TRACKER_FILE} names iteration {iteration} but "
                                  f"{it_dir} does not exist")
        saved_cfg = read_checkpoint_config(load_dir, iteration)
        diffs = model_shape_differences(saved_cfg.model, cfg.model)
        if diffs:
            raise CheckpointError(
                f"{what}: the checkpoint has a different model shape: {'; '.join(diffs)} "
                f"(pass the checkpoint's values or --use-checkpoint-args)")
        # The first stage's file says how many chunks a rank held and where the optimizer
        # state is (memory-mapped: only its small entries are read)
        file = os.path.join(it_dir, shard_dir_name(0, 0), MODEL_FILE)
        head = _load_file(file, what, mmap=True)
        saved = (_layout_of(saved_cfg, head.get("num_model_chunks", 1)),
                 "opt_param_scheduler" in head and "optimizer" not in head)
        del head
        mine = (_layout_of(cfg, len(model_chunks)), per_dp)
        if saved[0] != mine[0] or (load_optim and saved[1] != mine[1]):
            layouts = (f"saved with {_describe_layout(saved_cfg, saved[0][2], saved[1])}, "
                       f"this run uses {_describe_layout(cfg, mine[0][2], per_dp)}")
            if reshard is None:
                raise CheckpointError(f"{what}: {layouts}; {RESHARD_HINT}")
            if per_dp and load_optim and any(getattr(optimizer, "shard_is_expert", ())):
                raise CheckpointError(
                    f"{what}: {layouts}: a ZeRO optimizer with experts sharded apart (EP > 1 or "
                    f"ETP != TP) cannot reshard on load; load at EP 1 and ETP = TP first, or "
                    f"{RESHARD_HINT}")
            resharded = layouts
    except Exception as e:  # any failure, not only ours: a peer must not wait for this rank
        error = e if isinstance(e, CheckpointError) else CheckpointError(
            f"{what}: loading {file or it_dir} failed: {C.one_line(e)}")
    _agree_on_errors(ps, error)
    try:
        shard = os.path.join(it_dir, shard_dir_name(ps.tp_rank, ps.pp_rank))
        file = os.path.join(shard, MODEL_FILE)
        if resharded:
            file = it_dir
            state, opt_sd = reshard(load_dir, iteration, cfg, ps, load_optim)
        else:
            state = _load_file(file, what)
            opt_sd = None
        if resharded:
            fits = getattr(optimizer, "shard_fits", None)
            if load_optim and per_dp and fits is not None and not fits(opt_sd):
                raise CheckpointError(
                    f"{what}: {resharded}: the optimizer shard assembled for this rank does not "
                    f"fit its optimizer (another bucket or unit layout); {RESHARD_HINT}")
        elif load_optim:
            if "opt_param_scheduler" not in state:
                raise CheckpointError(f"{what}: the checkpoint has no optimizer state (saved with "
                                      f"--no-save-optim); pass --no-load-optim or --finetune")
            if per_dp:
                file = os.path.join(shard, distrib_optim_name(ps.dp_cp_rank))
                opt_sd = _load_dp_sharded_optimizer_state(it_dir, optimizer, ps, what)
            elif "optimizer" not in state:
                raise CheckpointError(
                    f"{what}: the optimizer state was saved per data-parallel rank (ZeRO); "
                    f"load with the same --zero-stage / --use-distributed-optimizer")
            else:
                opt_sd = state["optimizer"]
        file = os.path.join(shard, MODEL_FILE) if not resharded else it_dir
        # (a ZeRO shard that fits this rank is its own already; a merged one holds all experts)
        whole = opt_sd is not None and (not per_dp or opt_sd.get("format") == FULL_FORMAT)
        _keep_local_experts(state, opt_sd if whole else None, model_chunks, optimizer, ps)
        for i, chunk in enumerate(model_chunks):
            key = _chunk_key(i, len(model_chunks))
            missing, unexpected = chunk.load_state_dict(state[key], strict=False)
            if missing or unexpected:
                raise CheckpointError(f"{what}: model weights do not match this model (missing "
                                      f"{list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
        if hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()
        if load_optim:
            try:
                optimizer.load_state_dict(opt_sd)
            except Exception as e:
                raise CheckpointError(f"{what}: optimizer state does not fit this optimizer ({e}); "
                                      f"pass --no-load-optim to start the optimizer afresh")
            scheduler.load_state_dict(state["opt_param_scheduler"])
    except Exception as e:  # any failure, not only ours: a peer must not wait for this rank
        error = (e if isinstance(e, CheckpointError) else
                 CheckpointError(str(e)) if isinstance(e, ConfigError) else  # the resharder's
                 CheckpointError(f"{what}: loading {file or it_dir} failed: {C.one_line(e)}"))
    _agree_on_errors(ps, error)
    if load_optim and hasattr(optimizer, "sync_model_params"):
        optimizer.sync_model_params()

    if ck.finetune:
        return 0, 0, None
    rng = None if ck.no_load_rng else state.get("rng_state")
    if resharded and not ck.no_load_rng:
        rng = _reseeded_rng(saved_cfg.training.seed, iteration, ps)
        if log is not None:
            log(f" resharded on load ({resharded}): RNG re-seeded from seed "
                f"{saved_cfg.training.seed} and iteration {iteration}, so data and weights "
                f"resume exactly but dropout masks differ from an uninterrupted run's")
    return int(state["iteration"]), int(state["consumed_samples"]), rng
