"""A checkpoint read in canonical form (full tensors by layout-free name) and re-assembled for any
layout: the one assembly behind the offline converter and a load at another layout
(docs/checkpoints.md, "Conversion and resharding", "Resharding on load")."""

from __future__ import annotations

import copy
import os
import types
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megalite.checkpoint.format import (MODEL_FILE, CheckpointError, chunk_key, distrib_optim_name,
                                        file_header, latest_iteration, load_file,
                                        loadable_iteration_dir, read_checkpoint_config,
                                        shard_dir_name)
from megalite.checkpoint.layout import (Layout, ParamSpec, canonical_name, chunks_of, layer_of,
                                        meta_chunk, rank_param_order)
from megalite.checkpoint.optim_state import (OptimCommon, PlainIndex, build_plain, check_plain,
                                             merge_rank_files, merge_shard_state_dicts,
                                             plain_common, read_plain, upgrade_shard,
                                             zero_common, zero_target)
from megalite.config import ConfigError, MegaliteConfig
from megalite.optimizer.optimizer import ADAM_KINDS

# read_group(specs, with_optim) -> {canonical name: {"weight", "master", "exp_avg", ...}}
ReadGroup = Callable[[List[ParamSpec], bool], Dict[str, Dict[str, Optional[torch.Tensor]]]]


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage is exactly its data (torch.save and safetensors write whole
    storages; a view of a bigger tensor would bloat the file or be refused)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


class MegaliteSource:
    """A megalite checkpoint opened for reads of canonical tensors, a layer at a time: each read
    memory-maps the source files holding the layer, copies its tensors out and drops them."""

    def __init__(self, load_dir: str, iteration: Optional[int] = None):
        self.dir = os.path.abspath(load_dir)
        self.what = f"--load {load_dir}"
        if not os.path.isdir(self.dir):
            raise CheckpointError(f"{self.what}: no such directory")
        self.iteration = int(latest_iteration(self.dir, self.what) if iteration is None
                             else iteration)
        self.it_dir = loadable_iteration_dir(self.dir, self.iteration)
        if not os.path.isdir(self.it_dir):
            raise CheckpointError(f"{self.what}: iteration {self.iteration} is missing "
                                  f"({self.it_dir} does not exist)")
        self.cfg = read_checkpoint_config(self.dir, self.iteration)
        self.model_cfg = self.cfg.model
        self.layout = Layout.of_config(self.cfg)
        try:
            self.chunks = chunks_of(self.layout, self.model_cfg.num_layers)
        except ConfigError as e:
            raise CheckpointError(f"{self.what}: args.json describes an impossible layout ({e})")
        self.num_chunks = len(self.chunks[0])
        for r in range(self.layout.pp):
            for t in range(self.layout.tp):
                if not os.path.isfile(self._path(t, r)):
                    raise CheckpointError(f"{self.what}: {self._path(t, r)} is missing (args.json "
                                          f"says {self.layout.describe()}; incomplete checkpoint?)")
        self._loc: Dict[int, Tuple[int, int]] = {
            i: (r, ch.index) for r, rank_chunks in enumerate(self.chunks) for ch in rank_chunks
            for i in range(*ch.layer_range)}
        head = self._load(self._path(0, 0))
        saved = (head.get("tensor_model_parallel_size"), head.get("pipeline_model_parallel_size"),
                 head.get("num_model_chunks", 1))
        if saved != (self.layout.tp, self.layout.pp, self.num_chunks):
            raise CheckpointError(
                f"{self.what}: the shard files were saved with tp={saved[0]} pp={saved[1]} and "
                f"{saved[2]} chunk(s) per rank, args.json says {self.layout.describe()} and "
                f"{self.num_chunks}")
        self.consumed_samples = int(head.get("consumed_samples", 0))
        self.scheduler = head.get("opt_param_scheduler")
        self.optim_kind: Optional[str] = None  # None, "plain", "zero" (ZeRO-1/2) or "zero3"
        self.dp_size = 1
        self.optim_common: Optional[OptimCommon] = None
        if "opt_param_scheduler" in head:
            if "optimizer" in head:
                self.optim_kind = "plain"
                self.optim_common = plain_common(head["optimizer"])
            elif os.path.isfile(self._dp_path(0, 0, 0)):
                while os.path.isfile(self._dp_path(0, 0, self.dp_size)):
                    self.dp_size += 1
                dp0 = upgrade_shard(self._load(self._dp_path(0, 0, 0)))
                self.optim_kind = "zero3" if dp0.get("zero_stage") == 3 else "zero"
                self.optim_common = zero_common(dp0)
                del dp0
        del head
        self._checked: set = set()
        self._plain_index = [None] * self.layout.pp

    def optim_for(self, zero_stage: int, hint: str) -> str:
        """The optimizer state a target at ``zero_stage`` takes; ``hint`` where there is none."""
        if self.optim_kind is None:
            raise CheckpointError(f"{self.what}: the checkpoint has no optimizer state (saved "
                                  f"with --no-save-optim); {hint}")
        return "zero3" if zero_stage == 3 else "zero" if zero_stage >= 1 else "plain"

    def _path(self, t: int, r: int) -> str:
        return os.path.join(self.it_dir, shard_dir_name(t, r), MODEL_FILE)

    def _dp_path(self, t: int, r: int, d: int) -> str:
        return os.path.join(self.it_dir, shard_dir_name(t, r), distrib_optim_name(d))

    def _load(self, path: str) -> dict:
        return load_file(path, self.what, mmap=True)

    def rng_state(self, t: int, r: int):
        """The RNG state of source rank (t mod T, r mod P): every stream stays well defined
        (resharding cannot reproduce another layout's dropout masks anyway)."""
        state = self._load(self._path(t % self.layout.tp, r % self.layout.pp)).get("rng_state")
        return copy.deepcopy(state) if state is not None else None

    def location(self, name: str) -> Tuple[int, int]:
        """(pp rank, chunk index) of the source chunk holding canonical parameter ``name``."""
        i = layer_of(name)
        if i is not None:
            if i not in self._loc:
                raise CheckpointError(f"{self.what}: no layer {i} in this checkpoint")
            return self._loc[i]
        want = "pre" if name.startswith("embedding.") else "post"
        return next((c.pp_rank, c.index) for row in self.chunks for c in row if getattr(c, want))

    def read(self, names: Sequence[str], with_optim: bool = False
             ) -> Dict[str, Dict[str, Optional[torch.Tensor]]]:
        """Canonical tensors of ``names``: ``{name: {"weight": ..., "master"/"exp_avg"/
        "exp_avg_sq": ... or None}}``, read chunk by chunk; every tensor is a fresh copy."""
        by_chunk: Dict[Tuple[int, int], Dict[str, None]] = {}
        for n in names:
            by_chunk.setdefault(self.location(n), {})[n] = None  # (in order, each once)
        out = {}
        for (r, c), chunk_names in by_chunk.items():
            out.update(self._read_chunk(r, c, list(chunk_names), with_optim))
        return out

    def read_group(self, group: List[ParamSpec], with_optim: bool):
        """assemble_stage's ``read_group`` over this checkpoint."""
        return self.read([canonical_name(s.name, self.model_cfg) for s in group], with_optim)

    def _read_chunk(self, r: int, c: int, names: List[str], with_optim: bool):
        specs = {s.name: s for s in meta_chunk(self.model_cfg, self.chunks[r][c],
                                               self.layout.pp).state}
        key = chunk_key(c, self.num_chunks)
        per_t: Dict[str, Dict[str, List[torch.Tensor]]] = {n: {} for n in names}
        for t in range(self.layout.tp):
            sd = self._load(self._path(t, r))
            where = f"{self.what}: {self._path(t, r)}"
            model_sd = sd.get(key)
            if model_sd is None:
                raise CheckpointError(f"{where} has no {key!r} entry")
            for n in names:
                if n not in specs or n not in model_sd:
                    raise CheckpointError(f"{where} has no tensor {n} (chunk {key})")
                w = model_sd[n]
                expect = specs[n].local_shape(self.model_cfg, self.layout.tp)
                if tuple(w.shape) != expect:
                    raise CheckpointError(f"{where}: {n} has shape {tuple(w.shape)}, args.json "
                                          f"implies {expect}")
                per_t[n].setdefault("weight", []).append(w)
            if with_optim:  # (buffers have no optimizer state)
                self._read_optim(sd, t, r, c, [n for n in names if not specs[n].buffer], specs,
                                 per_t)
            del sd, model_sd  # the file is unmapped once only the copies below are left
        # a state that some TP rank lacks (never stepped) is absent as a whole
        return {n: {k: None if any(x is None for x in shards)
                    else specs[n].unshard(shards, self.model_cfg)
                    for k, shards in per_t[n].items()} for n in names}

    def _read_optim(self, sd, t, r, c, names, specs, per_t) -> None:
        where = f"{self.what}: tp rank {t}, pp rank {r}"
        if not names:
            return
        if self.optim_kind == "plain":
            if self._plain_index[r] is None:
                self._plain_index[r] = PlainIndex.build(
                    rank_param_order(self.model_cfg, self.chunks[r], self.layout.pp))
            opt_sd, index = sd["optimizer"], self._plain_index[r]
            if (t, r) not in self._checked:
                check_plain(opt_sd, index, where)
                self._checked.add((t, r))
            for n in names:
                for k, v in read_plain(opt_sd, index, n).items():
                    per_t[n].setdefault(k, []).append(v)
            return

        def files(u):
            return [self._load(self._dp_path(u, r, d)) for d in range(self.dp_size)]

        key = (lambda n: n) if self.optim_kind == "zero3" or self.num_chunks == 1 else (
            lambda n: f"chunk{c}.{n}")
        metas = {key(n): specs[n].meta for n in names}
        try:
            merged = merge_rank_files(files(t), files, self.layout.tp, t, metas.__getitem__,
                                      names=[key(n) for n in names])["params"]
        except CheckpointError:  # a missing or corrupt file, named
            raise
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{where}: the distrib_optim_dp*.pt files cannot be merged "
                                  f"({e}); pass --no-optim")
        for n in names:
            expect = specs[n].local_shape(self.model_cfg, self.layout.tp)
            entry = merged[key(n)]
            if tuple(entry["master"].shape) != expect:
                raise CheckpointError(f"{where}: the optimizer state of {n} has shape "
                                      f"{tuple(entry['master'].shape)}, args.json implies "
                                      f"{expect}")
            for k in ADAM_KINDS:
                per_t[n].setdefault(k, []).append(entry[k])


class StageFiles(NamedTuple):
    """What one (tp, pp) rank of a layout holds: its model file (``model_optim_rng.pt``'s
    dict) and, for a ZeRO optimizer, its DP ranks' ``distrib_optim_dp{d}.pt`` dicts by d."""
    tp_rank: int
    model_file: dict
    zero_files: Optional[Dict[int, dict]]


def _groups(specs: Sequence[ParamSpec]) -> List[List[ParamSpec]]:
    """Consecutive entries read together, the unit of streaming: one transformer layer, or the
    non-layer tensors of one top-level module."""
    out: List[List[ParamSpec]] = []
    key = None
    for s in specs:
        k = (layer_of(s.name), layer_of(s.name) is None and s.name.split(".")[0])
        if out and k == key:
            out[-1].append(s)
        else:
            out.append([s])
            key = k
    return out


def assemble_stage(cfg: MegaliteConfig, layout: Layout, r: int, iteration: int,
                   read_group: ReadGroup, *, tp_ranks: Optional[Sequence[int]] = None,
                   dp_ranks: Optional[Sequence[int]] = None, consumed: int = 0,
                   optim: Optional[str] = None, common: Optional[OptimCommon] = None,
                   scheduler: Optional[dict] = None, dp: int = 1,
                   rng: Optional[Callable[[int, int], object]] = None,
                   weight_dtype: Optional[torch.dtype] = None,
                   what: str = "source") -> List[StageFiles]:
    """The files of pipeline stage ``r`` of ``layout`` for TP ranks ``tp_ranks`` (default all)
    and, with a ZeRO ``optim``, DP ranks ``dp_ranks`` of ``dp`` (default all), read one group
    (a layer) at a time. ``optim``: None (no optimizer state), "plain", "zero" (ZeRO-1/2),
    "zero3", or "fresh" (an empty plain state, so a plain --load of an imported model works)."""
    m = cfg.model
    chunks = chunks_of(layout, m.num_layers)
    v = len(chunks[0])
    tps = list(range(layout.tp)) if tp_ranks is None else list(tp_ranks)
    with_optim = optim in ("plain", "zero", "zero3")
    files = {t: file_header(iteration, consumed, layout.tp, layout.pp, v) for t in tps}
    zero = None
    if optim in ("zero", "zero3"):
        zero = {t: zero_target(optim, m, chunks[r], layout.pp, layout.tp, dp, cfg.optimizer,
                               dp_ranks) for t in tps}
    # plain optimizer state, per TP rank (ZeRO state goes straight into its shards instead)
    local: Dict[int, Dict[str, Dict[str, torch.Tensor]]] = {t: {} for t in tps}
    for c, ch in enumerate(chunks[r]):
        key = chunk_key(c, v)
        for f in files.values():
            f[key] = {}
        for group in _groups(meta_chunk(m, ch, layout.pp).state):
            full = read_group(group, with_optim)
            for s in group:
                src = full[canonical_name(s.name, m)]
                w = src["weight"]
                if tuple(w.shape) != s.full_shape(m):
                    raise CheckpointError(f"{what}: {s.name} has shape {tuple(w.shape)}, the "
                                          f"model needs {s.full_shape(m)}")
                if weight_dtype is not None and not s.buffer:  # (buffers keep theirs)
                    w = w.to(weight_dtype)
                for t in tps:
                    w_t = files[t][key][s.name] = own_storage(s.shard(w, m, t, layout.tp))
                    if not with_optim or s.buffer:
                        continue
                    state = {k: (s.shard(x, m, t, layout.tp) if x is not None else None)
                             for k, x in src.items() if k != "weight"}
                    if state.get("master") is None:
                        # fp32 models have no separate master: the weight is the master
                        state["master"] = w_t.float()
                    if zero is not None:
                        for k in ADAM_KINDS:
                            zero[t].fill(s.name, k, state.get(k))
                    else:
                        local[t][s.name] = {k: (own_storage(x) if x is not None else None)
                                            for k, x in state.items()}
            del full
    out = []
    order = rank_param_order(m, chunks[r], layout.pp) if optim is not None else None
    for t in tps:
        f = files[t]
        if optim in ("plain", "fresh"):
            f["optimizer"] = build_plain(
                PlainIndex.build(order), lambda n, k, t=t: local[t].get(n, {}).get(k),
                common or OptimCommon(), cfg.optimizer,
                mixed=m.params_dtype != "float32" and optim == "plain")
        if optim is not None:
            f["opt_param_scheduler"] = (scheduler if scheduler is not None
                                        else _fresh_scheduler_state(cfg))
        if rng is not None and (state := rng(t, r)) is not None:
            f["rng_state"] = state
        out.append(StageFiles(t, f, None if zero is None else
                              zero[t].files(common or OptimCommon(), cfg.optimizer)))
        local[t] = {}
    return out


def _fresh_scheduler_state(cfg: MegaliteConfig) -> dict:
    from megalite.optimizer.lr_scheduler import OptimizerParamScheduler

    holder = types.SimpleNamespace(param_groups=[{}])
    return OptimizerParamScheduler.from_config(holder, cfg.optimizer,
                                               cfg.training.train_iters).state_dict()


def load_resharded(load_dir: str, iteration: int, cfg: MegaliteConfig, ps, with_optim: bool,
                   experts_apart: bool = False) -> Tuple[dict, Optional[dict]]:
    """This rank's model file (less the RNG state) and optimizer state at the running job's layout,
    assembled from a checkpoint of any other layout: only its own TP, PP and DP shards. With
    ``experts_apart`` (a ZeRO run whose expert shards follow the expert grid, not DP) the
    optimizer state is this (TP, PP) rank's unsharded one (FULL_FORMAT, every expert), which the
    loader cuts to this rank's experts and the optimizer re-splits, as after a merge."""
    src = MegaliteSource(load_dir, iteration)
    optim = (src.optim_for(cfg.optimizer.zero_stage, "pass --no-load-optim or --finetune")
             if with_optim else None)
    # DP 1's one shard holds every parameter of the rank: merged, it is the unsharded state
    dp, d = (1, 0) if experts_apart else (ps.zero_size, ps.zero_rank)
    (files,) = assemble_stage(cfg, Layout.of_config(cfg), ps.pp_rank, src.iteration,
                              src.read_group, tp_ranks=[ps.tp_rank], dp_ranks=[d],
                              consumed=src.consumed_samples, optim=optim, common=src.optim_common,
                              scheduler=src.scheduler, dp=dp, what=src.what)
    state = files.model_file
    if optim == "plain":
        return state, state.pop("optimizer")
    if files.zero_files is None:
        return state, None
    return state, (merge_shard_state_dicts([files.zero_files[0]]) if experts_apart
                   else files.zero_files[d])
