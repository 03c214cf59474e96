"""Sharded, atomic, durable saves, synchronous and asynchronous (docs/checkpoints.md: "Layout on
disk", "Atomicity", "Asynchronous saves", "Experts"; docs/design.md, contract 8)."""

from __future__ import annotations

import filecmp
import math
import os
import shutil
import threading
import time
from typing import Callable, NamedTuple, Optional

import torch

from megalite import collectives as C
from megalite.checkpoint.experts import (gather_whole, optimizer_slots, split_experts, whole_shape,
                                         with_full_experts)
from megalite.checkpoint.format import (MODEL_FILE, RECORD_FILE, TRACKER_FILE, CheckpointError,
                                        chunk_key, distrib_optim_name, file_header, fsync_dir,
                                        iteration_dir, save_file, shard_dir_name, write_fsynced)
from megalite.checkpoint.snapshot import HostBuffers, snapshot
from megalite.config import MegaliteConfig, config_to_json
from megalite.memory import theoretical_model_state_bytes
from megalite.tensor_parallel.random import get_all_rng_states

# Test seam: hook(stage, path) at points of a save ("write_file", "shard_written", "before_rename",
# ...; docs/checkpoints.md, "Asynchronous saves"), which a fault test makes raise or exit.
fault_hook: Optional[Callable[[str, str], None]] = None


def _hook(stage: str, path: str) -> None:
    if fault_hook is not None:
        fault_hook(stage, path)


def new_run_id(ps) -> int:
    """An id shared by all ranks of this run (names the temp directories of its saves)."""
    t = torch.tensor([int.from_bytes(os.urandom(4), "little") if ps.rank == 0 else 0],
                     dtype=torch.int64)
    if ps.world_size > 1:
        C.broadcast(t, src=0, group=C.world_group(), tag="checkpoint_run_id", host=True)
    return int(t.item())


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
                    consumed_samples: int, cfg: MegaliteConfig, ps, run_id: int,
                    record: Optional[dict] = None) -> str:
    """Write iteration ``iteration`` atomically and durably; returns the final directory.
    Collective: a rank whose write fails makes every rank raise a CheckpointError naming it.
    ``record``: what a load must reproduce (checkpoint/verify.py), written by rank 0."""
    plan = _plan_save(save_dir, iteration, model_chunks, optimizer, scheduler, consumed_samples,
                      cfg, ps, run_id, record)
    # (on a GPU the device tensors go to plain host memory one file at a time: the same bytes as
    # an asynchronous save's host snapshot, whose storages say "cpu")
    on_host = (lambda obj: obj) if ps.device.type == "cpu" else \
        (lambda obj: snapshot(obj, copy_host=False))
    error = _attempt(lambda: _write_plan(plan, on_host))
    _agree_on_save(ps, error, iteration, plan.tmp)  # every shard is durable before it is visible
    _publish_agreed(plan, ps)
    return plan.final


def _plan_save(save_dir: str, iteration: int, model_chunks, optimizer, scheduler,
               consumed_samples: int, cfg: MegaliteConfig, ps, run_id: int,
               record: Optional[dict] = None) -> _SavePlan:
    """The collective part of a save: the temp directory (agreed), ZeRO-3 and expert gathers,
    and the objects this rank's files hold (still the live tensors)."""
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
        state = {**file_header(iteration, consumed_samples, ps.tp_size, ps.pp_size,
                               len(model_chunks)), "rng_state": get_all_rng_states(ps.device)}
        for i, chunk in enumerate(model_chunks):
            sd = full[i] if full[i] is not None else chunk.state_dict()
            for (_, c, key), t in experts.get("model", {}).items():
                if c == i:
                    sd[key] = t
            state[chunk_key(i, len(model_chunks))] = sd
        if save_optim:
            state["opt_param_scheduler"] = scheduler.state_dict()
            if not per_dp:
                state["optimizer"] = with_full_experts(optimizer.state_dict(), experts)
        files.append((os.path.join(shard, MODEL_FILE), state))
    if save_optim and per_dp and ps.dp_cp_rank < ps.zero_size:  # HSDP: instance 0's, as DP/R's
        files.append((os.path.join(shard, distrib_optim_name(ps.zero_rank)),
                      optimizer.state_dict()))
    if record is not None and ps.rank == 0:
        files.append((os.path.join(tmp, RECORD_FILE), record))
    args_json = config_to_json(cfg).encode() if ps.rank == 0 else None
    return _SavePlan(save_dir, iteration, final, tmp, shard, files, args_json, run_id)


def _write_plan(plan: _SavePlan, prepare=lambda obj: obj) -> None:
    """Write one rank's files of a save (no collective: also the background writer's work);
    ``prepare``: the object a file is written from. A failure names the file."""
    for path, obj in plan.files:
        try:
            _hook("write_file", path)
            os.makedirs(plan.shard, exist_ok=True)
            save_file(path, prepare(obj))
        except Exception as e:
            raise CheckpointError(f"writing {path}: {C.one_line(e)}") from e
    _hook("shard_written", plan.tmp)
    if plan.args_json is not None:
        path = os.path.join(plan.tmp, "args.json")
        try:
            write_fsynced(path, lambda f: f.write(plan.args_json))
        except Exception as e:
            raise CheckpointError(f"writing {path}: {C.one_line(e)}") from e
    if os.path.isdir(plan.shard):
        fsync_dir(plan.shard)


def _publish_agreed(plan: _SavePlan, ps) -> None:
    """Once every rank agreed its files are durable: rank 0 makes the save visible."""
    error = None
    if ps.rank == 0:
        error = _attempt(lambda: _publish(plan))
    _agree_on_save(ps, error, plan.iteration, plan.tmp)


def snapshot_share_bytes(cfg: MegaliteConfig, ps) -> int:
    """Host bytes of one snapshot of this rank's share (docs/checkpoints.md, "Memory" of
    "Asynchronous saves")."""
    psi = cfg.model.num_parameters() / (ps.tp_size * ps.pp_size)
    st = theoretical_model_state_bytes(int(psi), ps.zero_size, cfg.optimizer.zero_stage,
                                       cfg.model.params_dtype)
    weights = st["params_bytes"] * (ps.zero_size if cfg.optimizer.zero_stage >= 3 else 1)
    optim = 0 if cfg.checkpoint.no_save_optim else (st["master_params_bytes"]
                                                    + st["optimizer_states_bytes"])
    return int(weights + optim)


def host_memory_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_async_save_memory(cfg: MegaliteConfig, ps) -> int:
    """Refuse --async-save at start-up, on every rank alike, where this host cannot hold one copy
    of each of its ranks' shares. Returns this rank's estimate."""
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
    """Run the calling thread at nice 10 (Linux nice is per thread; docs/checkpoints.md, "Thread,
    not process")."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
        pass


class PendingSave:
    """An asynchronous save in flight: this rank's snapshot, written by a daemon thread that makes
    no collective; every agreement is made by the training thread (:meth:`settle`)."""

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
            _write_plan(self.plan)
        except BaseException as e:  # reported by settle, on every rank
            self.error = e
        self.cpu_s = time.thread_time() - cpu  # what the write took from training's cores
        self.write_s = time.perf_counter() - self.started

    def join(self) -> None:
        """Wait for this rank's writer (no collective: also on the way out of a failed run)."""
        self.thread.join()

    def settle(self, wait: bool) -> bool:
        """Collective. True once the save is published; False while some rank still writes
        (``wait`` False only). A failure on any rank raises CheckpointError on every rank."""
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
                     buffers: HostBuffers, record: Optional[dict] = None) -> PendingSave:
    """--async-save: the collective part of a save, a host snapshot of what a synchronous save
    writes (into ``buffers``), then a background writer. The caller settled any earlier save."""
    plan = _plan_save(save_dir, iteration, model_chunks, optimizer, scheduler, consumed_samples,
                      cfg, ps, run_id, record)
    buffers.begin()
    files = [(path, snapshot(obj, buffers)) for path, obj in plan.files]
    buffers.end(ps.device)
    return PendingSave(plan._replace(files=files), buffers, ps)


def _gather_zero3_models(model_chunks, ps, iteration: int, tmp: str) -> list:
    """ZeRO-3 chunks' consolidated models, all-gathered unit by unit, kept by DP rank 0; every
    rank first allocates what the gather allocates, and the ranks agree (docs/zero3.md)."""
    units = [u for c in model_chunks if getattr(c, "zero_stage", 0) == 3 for u in c.units]
    if not units:
        return [None] * len(model_chunks)

    def precheck():
        _hook("before_zero3_gather", tmp)
        probe = [torch.empty(max(u.padded for u in units), dtype=units[0].main.dtype,
                             device=units[0].device)]
        if ps.dp_cp_rank == 0:
            probe.append(torch.empty(sum(u.numel for u in units), device=units[0].device,
                                     dtype=model_chunks[0].compute_dtype))
        del probe

    _agree_on_save(ps, _attempt(precheck), iteration, tmp)
    return [chunk.full_state_dict(keep=ps.dp_cp_rank == 0)
            if getattr(chunk, "zero_stage", 0) == 3 else None for chunk in model_chunks]


def _gather_experts(model_chunks, optimizer, with_optim: bool, ps, iteration: int,
                    tmp: str) -> dict:
    """The whole [E, ...] tensors of every split expert tensor (model, and with ``with_optim`` the
    plain optimizer's), gathered one at a time (docs/checkpoints.md, "Experts"); pre-checked."""
    if ps.ep_size == 1 and ps.etp_size == 1:  # (every rank of the world has the same sizes)
        return {}
    experts = split_experts(model_chunks)  # none on a stage of dense layers: it still agrees
    zero3 = {i for i, c in enumerate(model_chunks) if getattr(c, "zero_stage", 0) == 3}
    units = [(i, model_chunks[i], u) for i in sorted(zero3) for u in model_chunks[i].units
             if u.expert]
    local = {}  # (chunk, key) -> a ZeRO-3 expert weight at [E_local, ...], filled below
    # (where, this rank's tensor, its shape and dtype, group); tensors are fetched when gathered
    jobs = [(("model", e.chunk, e.key),
             (lambda e=e: local[(e.chunk, e.key)]) if e.chunk in zero3 else (lambda e=e: e.param),
             e.param.dtype, e) for e in experts]
    if with_optim:
        for e, i, j, m in optimizer_slots(optimizer, experts):
            st = optimizer.inner.state.get(m, {})
            jobs += [(("state", j, k), lambda t=st[k]: t, st[k].dtype, e)
                     for k in sorted(st) if torch.is_tensor(st[k]) and st[k].shape == m.shape]
            if m.dtype != e.param.dtype:  # a 16-bit model's fp32 master (not an offloaded copy)
                jobs.append((("master", i), lambda m=m: m, m.dtype, e))
    keep = ps.dp_cp_rank == 0

    def full_of(dtype, e):
        return torch.empty(whole_shape(e, ps), dtype=dtype, device=ps.device)

    def precheck():
        _hook("before_expert_gather", tmp)
        probe = [torch.empty(u.padded, dtype=u.main.dtype, device=u.device) for _, _, u in units]
        if jobs:
            fulls = [j[2:] for j in jobs]
            probe += [full_of(*f) for f in fulls] if keep else [full_of(*max(
                fulls, key=lambda f: math.prod(whole_shape(f[1], ps))
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
        for where, tensor, _, e in jobs:  # (on the device: offloaded state is on the host)
            full = gather_whole(tensor().detach().contiguous().to(ps.device), e, ps)
            if keep:
                out[where] = full
    return {"model": {w: t for w, t in out.items() if w[0] == "model"},
            "state": {w[1:]: t for w, t in out.items() if w[0] == "state"},
            "master": {w[1]: t for w, t in out.items() if w[0] == "master"}}


def _attempt(fn) -> Optional[BaseException]:
    try:
        fn()
    except Exception as e:  # OSError (ENOSPC, EACCES, EIO...) or torch.save's RuntimeError
        return e
    return None


def _publish(plan: _SavePlan) -> None:
    """Rank 0, after every shard is durable: tmp -> iter_X, then the tracker (temp + replace)."""
    save_dir, final, tmp = plan.save_dir, plan.final, plan.tmp
    _hook("before_rename", tmp)
    fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        # Re-saving an iteration (e.g. after a resume): the complete old copy is only renamed
        # until the new one is in place, and the loader falls back to it in between.
        old = f"{final}.old-{plan.run_id:08x}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    tracker_tmp = os.path.join(save_dir, f".{TRACKER_FILE}.tmp-{plan.run_id:08x}")
    write_fsynced(tracker_tmp, lambda f: f.write(str(plan.iteration).encode()))
    os.replace(tracker_tmp, os.path.join(save_dir, TRACKER_FILE))
    fsync_dir(save_dir)
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
