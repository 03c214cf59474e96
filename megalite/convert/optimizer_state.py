"""Optimizer state in checkpoints, translated to and from one canonical form: by parameter name.

The two on-disk formats (the facts this module reads and writes):

* **Plain** (``MixedPrecisionOptimizer.state_dict``, megalite/optimizer/optimizer.py), inside
  ``model_optim_rng.pt["optimizer"]`` of DP rank 0:
  ``{"optimizer": torch.optim.AdamW.state_dict(), "grad_scaler": dict | None,
  "fp32_master_params": [tensor, ...] (16-bit models only)}``. torch numbers parameters by their
  position in the param groups: group 0 holds the matrices (weight decay), group 1 the 1-D
  parameters, each in ``model_parameters(chunks)`` order; the master list is in
  ``model_parameters`` order itself.
* **ZeRO** (``DistributedOptimizer.state_dict``, megalite/optimizer/distrib_optimizer.py), one file
  ``distrib_optim_dp{d:03d}.pt`` per DP rank: flat fp32 ``master`` / ``exp_avg`` / ``exp_avg_sq``
  shards, one per bucket of DistributedDataParallel's buffers, plus a ``layout`` list
  ``(bucket numel, shard start, shard end)`` per bucket. Which parameter sits where in a bucket is
  the rule of megalite/distributed/param_and_grad_buffer.py, reproduced by :func:`zero_buckets`
  (and checked against the saved ``layout`` before anything is read).
* **ZeRO-3** (``Zero3Optimizer.state_dict``, megalite/optimizer/zero3_optimizer.py), one file
  ``distrib_optim_dp{d:03d}.pt`` per DP rank: per sharding unit (embedding, each layer, head) the
  flat fp32 ``main`` / ``exp_avg`` / ``exp_avg_sq`` shard of rank d, with the unit's parameter
  ``names`` and TP-local ``shapes`` in flat order, so it is read by name without any rule
  (:func:`read_zero3`); :func:`zero3_units` rebuilds the unit layout to write it.

Canonical form: ``{name: {"param": fp32 master, "exp_avg", "exp_avg_sq"}}`` with full (TP-unsharded)
tensors under the layout-independent parameter names, plus :class:`OptimCommon` (step count,
learning rate, grad-scaler state, group hyperparameters). A tensor is sharded over TP exactly like
its parameter (same ``partition_dim`` / ``partition_stride``): Adam is elementwise, so a slice of
the moments belongs to the same slice of the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megalite.config import ConfigError, ModelConfig, OptimizerConfig
from megalite.convert.layout import Chunk, ParamSpec, chunk_specs

ADAM_KINDS = ("param", "exp_avg", "exp_avg_sq")
ZERO_SHARD_FORMAT = "megalite.zero.shard/v1"
ZERO_FULL_FORMAT = "megalite.zero.full/v1"  # distrib_optimizer.FULL_STATE_FORMAT
_ZERO_KIND = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


class OptimizerStateError(ConfigError):
    """The optimizer state cannot be mapped to parameters; the message says why."""


@dataclass
class OptimCommon:
    """What is not per parameter."""

    step: int = 0
    lr: Optional[float] = None
    grad_scaler: Optional[dict] = None
    torch_groups: Optional[List[dict]] = None  # plain: torch param_groups without "params"
    zero_groups: Optional[List[dict]] = None  # ZeRO: [{"name", "lr", "weight_decay"}, ...]


# =============================================================================== plain format
@dataclass
class PlainIndex:
    """Where each parameter of one rank lives in a plain optimizer state dict."""

    order: List[ParamSpec]  # model_parameters order
    opt_index: Dict[str, int] = field(default_factory=dict)  # torch's state index
    master_pos: Dict[str, int] = field(default_factory=dict)  # position in fp32_master_params
    group_sizes: List[int] = field(default_factory=list)

    @classmethod
    def build(cls, order: List[ParamSpec]) -> "PlainIndex":
        decay = [s.name for s in order if s.decay]
        no_decay = [s.name for s in order if not s.decay]
        idx = cls(order)
        idx.opt_index = {n: i for i, n in enumerate(decay + no_decay)}
        idx.master_pos = {s.name: i for i, s in enumerate(order)}
        idx.group_sizes = [n for n in (len(decay), len(no_decay)) if n]
        return idx


def check_plain(opt_sd: dict, index: PlainIndex, where: str) -> None:
    try:
        sizes = [len(g["params"]) for g in opt_sd["optimizer"]["param_groups"]]
    except (KeyError, TypeError):
        raise OptimizerStateError(f"{where}: the optimizer state is not megalite's plain AdamW "
                                  f"format (no optimizer.param_groups)")
    if sizes != index.group_sizes:
        raise OptimizerStateError(
            f"{where}: the optimizer has parameter groups of sizes {sizes}, the model layout in "
            f"args.json implies {index.group_sizes} (args.json does not describe this checkpoint)")
    state = opt_sd["optimizer"].get("state", {})
    if any("exp_avg" not in s for s in state.values()):
        raise OptimizerStateError(f"{where}: the optimizer state is not Adam's (no exp_avg); "
                                  f"only AdamW state can be resharded: pass --no-optim")


def read_plain(opt_sd: dict, index: PlainIndex, name: str) -> Dict[str, Optional[torch.Tensor]]:
    """This rank's (TP-local) slices of one parameter's state; None where there is none yet."""
    st = opt_sd["optimizer"]["state"].get(index.opt_index[name])
    masters = opt_sd.get("fp32_master_params")
    return {"param": masters[index.master_pos[name]] if masters is not None else None,
            "exp_avg": st["exp_avg"] if st else None,
            "exp_avg_sq": st["exp_avg_sq"] if st else None}


def plain_common(opt_sd: dict) -> OptimCommon:
    opt = opt_sd["optimizer"]
    steps = [float(s["step"]) for s in opt.get("state", {}).values() if "step" in s]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    return OptimCommon(step=int(max(steps)) if steps else 0, lr=float(groups[0]["lr"]),
                       grad_scaler=opt_sd.get("grad_scaler"), torch_groups=groups)


def _torch_group_template(opt_cfg: OptimizerConfig, sizes: List[int]) -> List[dict]:
    """torch.optim.AdamW's param_groups entries for this config (keys differ between torch
    versions, so they are taken from torch itself rather than written out here)."""
    dummy = [{"params": [torch.zeros(1)], "weight_decay": opt_cfg.weight_decay},
             {"params": [torch.zeros(1)], "weight_decay": 0.0}]
    groups = torch.optim.AdamW(dummy, lr=opt_cfg.lr, betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
                               eps=opt_cfg.adam_eps,
                               weight_decay=opt_cfg.weight_decay).state_dict()["param_groups"]
    # the plain optimizer drops an empty group; the decay group is first
    if len(sizes) == 1:
        groups = groups[:1]
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def build_plain(index: PlainIndex, get: Callable[[str, str], Optional[torch.Tensor]],
                common: OptimCommon, opt_cfg: OptimizerConfig, mixed: bool) -> dict:
    """A plain optimizer state dict for one rank; ``get(name, kind)`` gives its local tensors."""
    groups = common.torch_groups
    if groups is None or len(groups) != len(index.group_sizes):
        groups = _torch_group_template(opt_cfg, index.group_sizes)
        if common.lr is not None:
            for g in groups:
                g["lr"] = common.lr
    state: Dict[int, dict] = {}
    for name, i in index.opt_index.items():
        m, v = get(name, "exp_avg"), get(name, "exp_avg_sq")
        if m is None or v is None:
            continue  # never stepped: torch creates the state lazily at the first step
        state[i] = {"step": torch.tensor(float(common.step), dtype=torch.float32),
                    "exp_avg": m, "exp_avg_sq": v}
    start, param_groups = 0, []
    for g, n in zip(groups, index.group_sizes):
        param_groups.append(dict(g, params=list(range(start, start + n))))
        start += n
    sd = {"optimizer": {"state": state, "param_groups": param_groups},
          "grad_scaler": common.grad_scaler}
    if mixed:
        masters = []
        for s in index.order:
            p = get(s.name, "param")
            if p is None:
                raise OptimizerStateError(f"no fp32 master weights for {s.name} in the source "
                                          f"checkpoint")
            masters.append(p)
        sd["fp32_master_params"] = masters
    return sd


# ================================================================================ ZeRO format
@dataclass
class BucketLayout:
    numel: int  # padded to a multiple of the DP size
    slots: List[Tuple[str, int, int]]  # (name, start inside the bucket, numel)


def zero_buckets(cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int, dp: int,
                 bucket_size: Optional[int]) -> List[BucketLayout]:
    """DistributedOptimizer's shards of one (tp, pp) rank, in its order: chunk by chunk, one buffer
    per parameter dtype (in order of first appearance), its buckets in order.

    Bucketing is param_and_grad_buffer.ParamAndGradBuffer's rule: parameters in reverse
    registration order, never split; a ``shared_embedding`` parameter gets a bucket of its own;
    a bucket closes once it holds >= bucket_size elements; each bucket is padded to a multiple of
    the DP size.
    """
    from megalite.distributed.ddp import DEFAULT_BUCKET_SIZE

    limit = bucket_size if bucket_size is not None else DEFAULT_BUCKET_SIZE
    out: List[BucketLayout] = []
    for ch in chunks:
        by_dtype: Dict[torch.dtype, List[ParamSpec]] = {}
        for s in chunk_specs(cfg, ch, pp):
            by_dtype.setdefault(s.dtype, []).append(s)
        for named in by_dtype.values():
            groups: List[List[ParamSpec]] = []
            current: List[ParamSpec] = []
            current_numel = 0
            for s in reversed(named):
                if s.shared_embedding:
                    if current:
                        groups.append(current)
                        current, current_numel = [], 0
                    groups.append([s])
                    continue
                current.append(s)
                current_numel += s.numel(cfg, tp)
                if current_numel >= limit:
                    groups.append(current)
                    current, current_numel = [], 0
            if current:
                groups.append(current)
            for group in groups:
                slots, off = [], 0
                for s in group:
                    n = s.numel(cfg, tp)
                    slots.append((s.name, off, n))
                    off += n
                out.append(BucketLayout(int(math.ceil(off / dp) * dp), slots))
    return out


def zero_shard_range(bucket: BucketLayout, dp_rank: int, dp: int, zero_stage: int
                     ) -> Tuple[int, int]:
    if zero_stage == 0:
        return 0, bucket.numel
    n = bucket.numel // dp
    return dp_rank * n, (dp_rank + 1) * n


def check_zero(sd: dict, buckets: List[BucketLayout], where: str) -> None:
    fmt = sd.get("format")
    if fmt == ZERO_FULL_FORMAT:
        return
    if fmt != ZERO_SHARD_FORMAT:
        raise OptimizerStateError(
            f"{where}: optimizer format {fmt!r} cannot be resharded offline (unknown format): "
            f"pass --no-optim, or save through the plain/ZeRO optimizer")
    dp, stage, d = int(sd["dp_size"]), int(sd["zero_stage"]), int(sd["dp_rank"])
    expect = [[b.numel, *zero_shard_range(b, d, dp, stage)] for b in buckets]
    if [list(x) for x in sd["layout"]] != expect:
        raise OptimizerStateError(
            f"{where}: the ZeRO bucket layout on disk differs from the one rebuilt from args.json "
            f"(--ddp-bucket-size or the model shape changed?); pass --no-optim")


def read_zero(sds: List[dict], buckets: List[BucketLayout], zero_stage: int, name: str,
              chunk_index: int, num_chunks: int, shape: Tuple[int, ...]
              ) -> Dict[str, Optional[torch.Tensor]]:
    """One parameter's (TP-local) state, gathered from the per-DP-rank files ``sds``."""
    if sds[0].get("format") == ZERO_FULL_FORMAT:
        params = sds[0]["params"]
        key = name if num_chunks == 1 else f"chunk{chunk_index}.{name}"
        entry = params.get(key, params.get(name))
        if entry is None:
            raise OptimizerStateError(f"the ZeRO optimizer state has no entry for {name}")
        return {k: entry[k].reshape(shape) for k in ADAM_KINDS}
    dp = len(sds)
    for b_index, b in enumerate(buckets):
        for slot_name, start, numel in b.slots:
            if slot_name == name:
                break
        else:
            continue
        out = {}
        for kind in ADAM_KINDS:
            pieces = []
            for d, sd in enumerate(sds):
                lo, hi = zero_shard_range(b, d, dp, zero_stage)
                a, e = max(lo, start), min(hi, start + numel)
                if a < e:
                    pieces.append(sd["shards"][b_index][_ZERO_KIND[kind]][a - lo:e - lo])
                if zero_stage == 0:
                    break  # every rank holds the whole bucket
            out[kind] = torch.cat(pieces).reshape(shape)
        return out
    raise OptimizerStateError(f"parameter {name} is in no ZeRO bucket")


def zero_common(sd: dict) -> OptimCommon:
    groups = [dict(g) for g in sd.get("param_groups", [])]
    return OptimCommon(step=int(sd["step"]), lr=float(groups[0]["lr"]) if groups else None,
                       grad_scaler=sd.get("grad_scaler"), zero_groups=groups)


def build_zero(buckets: List[BucketLayout], get: Callable[[str, str], Optional[torch.Tensor]],
               common: OptimCommon, opt_cfg: OptimizerConfig, dp: int, zero_stage: int
               ) -> List[dict]:
    """One DistributedOptimizer shard state dict per DP rank. Padding stays zero (as training
    keeps it); a parameter never stepped has zero moments, as a fresh optimizer would."""
    groups = common.zero_groups
    if not groups:
        lr = common.lr if common.lr is not None else opt_cfg.lr
        groups = [{"lr": lr, "weight_decay": opt_cfg.weight_decay, "name": "decay"},
                  {"lr": lr, "weight_decay": 0.0, "name": "no_decay"}]
    flats = []
    for b in buckets:
        flat = {k: torch.zeros(b.numel, dtype=torch.float32) for k in ADAM_KINDS}
        for name, start, numel in b.slots:
            for kind in ADAM_KINDS:
                t = get(name, kind)
                if t is not None:
                    flat[kind][start:start + numel] = t.reshape(-1).float()
        flats.append(flat)
    out = []
    for d in range(dp):
        shards, layout = [], []
        for b, flat in zip(buckets, flats):
            lo, hi = zero_shard_range(b, d, dp, zero_stage)
            layout.append([b.numel, lo, hi])
            shards.append({_ZERO_KIND[k]: flat[k][lo:hi].clone() for k in ADAM_KINDS})
        out.append({"format": ZERO_SHARD_FORMAT, "zero_stage": zero_stage, "dp_size": dp,
                    "dp_rank": d, "step": int(common.step),
                    "param_groups": [dict(g) for g in groups],
                    "grad_scaler": common.grad_scaler, "layout": layout, "shards": shards})
    return out


# ============================================================================ ZeRO-3 format
ZERO3_SHARD_FORMAT = "megalite-zero3-shard/1"  # zero3_optimizer._SHARD_FORMAT
_ZERO3_KIND = {"param": "main", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@dataclass
class Zero3Unit:
    name: str
    slots: List[Tuple[str, Tuple[int, ...]]]  # (parameter name, TP-local shape), in flat order

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.slots)


def zero3_units(cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int) -> List[Zero3Unit]:
    """Zero3Model's sharding units of one (tp, pp) rank (megalite/distributed/zero3.py, its
    _build_units): per chunk the embedding, each layer, then final norm + output layer; the
    embedding and the head are one unit "embedding+output" when a tied model has both on one
    chunk. Each unit's parameters in registration order. The loader checks the names, and merges
    by name if they ever differ, so this is a fast-path layout, never a correctness risk."""
    out: List[Zero3Unit] = []
    for ch in chunks:
        specs = chunk_specs(cfg, ch, pp)
        slot = {s.name: (s.name, s.local_shape(cfg, tp)) for s in specs}
        emb = [slot[s.name] for s in specs if s.name.startswith("embedding.")]
        head = [slot[s.name] for s in specs
                if s.name.startswith(("final_layernorm.", "output_layer."))]
        layers: Dict[str, list] = {}
        for s in specs:
            if s.name.startswith("layers."):
                layers.setdefault(".".join(s.name.split(".")[:2]), []).append(slot[s.name])
        tied = ch.pre and ch.post and cfg.tie_embeddings
        shared = {s.name for s in specs if s.shared_embedding}  # tied over stages: own units
        if tied:
            out.append(Zero3Unit("embedding+output", emb + head))
        elif emb:
            out += [Zero3Unit(n, slots) for n, slots in (
                ("embedding.word_embeddings", [x for x in emb if x[0] in shared]),
                ("embedding", [x for x in emb if x[0] not in shared])) if slots]
        out += [Zero3Unit(k, v) for k, v in layers.items()]
        if head and not tied:
            if any(x[0] in shared for x in head):
                out += [Zero3Unit("output", [x for x in head if x[0] not in shared]),
                        Zero3Unit("output_layer", [x for x in head if x[0] in shared])]
            else:
                out.append(Zero3Unit("output", head))
    return out


def read_zero3(sds: List[dict], name: str, shape: Tuple[int, ...]
               ) -> Dict[str, Optional[torch.Tensor]]:
    """One parameter's (TP-local) state from every DP rank's Zero3Optimizer file: the unit's flat
    buffer is rank r's elements [r*S, (r+1)*S), so the parameter's range is cut out of the shards
    it overlaps (one parameter at a time: conversion keeps streaming)."""
    sds = sorted(sds, key=lambda sd: int(sd["dp_rank"]))
    for unit, meta in sds[0]["units"].items():
        if "names" not in meta:
            raise OptimizerStateError("the ZeRO-3 optimizer files carry no parameter names "
                                      "(saved by an older megalite); pass --no-optim")
        if name in meta["names"]:
            break
    else:
        raise OptimizerStateError(f"parameter {name} is in no ZeRO-3 unit")
    i = meta["names"].index(name)
    start = sum(math.prod(s) for s in meta["shapes"][:i])
    numel = math.prod(meta["shapes"][i])
    if tuple(meta["shapes"][i]) != tuple(shape):
        raise OptimizerStateError(f"ZeRO-3 unit {unit}: {name} has shape "
                                  f"{tuple(meta['shapes'][i])}, args.json implies {tuple(shape)}")
    out = {}
    for kind, key in _ZERO3_KIND.items():
        pieces, lo = [], 0
        for sd in sds:
            t = sd["units"][unit][key]
            hi = lo + t.numel()
            a, e = max(lo, start), min(hi, start + numel)
            if a < e:
                pieces.append(t[a - lo:e - lo])
            lo = hi
        got = torch.cat(pieces) if pieces else torch.empty(0)
        if got.numel() != numel:
            raise OptimizerStateError(f"ZeRO-3 unit {unit}: the shards hold {got.numel()} of "
                                      f"{name}'s {numel} elements (missing DP rank file?)")
        out[kind] = got.reshape(shape)
    return out


def build_zero3(units: List[Zero3Unit], get: Callable[[str, str], Optional[torch.Tensor]],
                common: OptimCommon, opt_cfg: OptimizerConfig, dp: int) -> List[dict]:
    """One Zero3Optimizer.state_dict() per DP rank (each unit padded to a multiple of dp)."""
    groups = common.zero_groups
    if not groups:
        lr = common.lr if common.lr is not None else opt_cfg.lr
        groups = [{"lr": lr, "weight_decay": opt_cfg.weight_decay},
                  {"lr": lr, "weight_decay": 0.0}]
    groups = [{"lr": g["lr"], "weight_decay": g["weight_decay"]} for g in groups]
    flats = []
    for u in units:
        padded = int(math.ceil(u.numel / dp) * dp)
        flat = {k: torch.zeros(padded, dtype=torch.float32) for k in ADAM_KINDS}
        off = 0
        for name, shape in u.slots:
            n = math.prod(shape)
            for kind in ADAM_KINDS:
                t = get(name, kind)
                if t is not None:  # never stepped: zero moments, as a fresh optimizer
                    flat[kind][off:off + n] = t.reshape(-1).float()
            off += n
        flats.append(flat)
    out = []
    for d in range(dp):
        units_sd = {}
        for u, flat in zip(units, flats):
            s = flat["param"].numel() // dp
            units_sd[u.name] = {"numel": u.numel, "names": [n for n, _ in u.slots],
                                "shapes": [list(sh) for _, sh in u.slots],
                                **{_ZERO3_KIND[k]: flat[k][d * s:(d + 1) * s].clone()
                                   for k in ADAM_KINDS}}
        out.append({"format": ZERO3_SHARD_FORMAT, "dp_size": dp, "dp_rank": d,
                    "step": int(common.step), "param_groups": groups,
                    "grad_scaler": common.grad_scaler, "units": units_sd})
    return out
