"""Optimizer state files, read and written by parameter name (docs/checkpoints.md, "Optimizer
state files"): the plain format inside model_optim_rng.pt, the ZeRO shard files (merged from any
DP size, ZeRO stage, EP size or older format version) and the canonical per-name form
(``{name: {"master", "exp_avg", "exp_avg_sq"}}`` at full TP-unsharded shape, plus
:class:`OptimCommon`). ZeRO files are written with the layout rules of megalite/distributed/
themselves (``params_by_dtype``, ``bucket_layout``, ``unit_plan``), never a restatement."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megalite.checkpoint.format import CheckpointError
from megalite.checkpoint.layout import Chunk, ParamSpec, chunk_specs, meta_chunk
from megalite.config import ModelConfig, OptimizerConfig
from megalite.distributed.ddp import DEFAULT_BUCKET_SIZE, params_by_dtype
from megalite.distributed.param_and_grad_buffer import bucket_layout, packed
from megalite.optimizer.optimizer import ADAM_KINDS, FULL_FORMAT, SHARD_FORMAT
from megalite.param_meta import ParamMeta, set_param_meta
from megalite.tensor_parallel.utils import unshard_tensors


def merge_pieces(pieces: Iterable[Tuple[str, Sequence[int], int, Dict[str, torch.Tensor]]],
                 names: Optional[Iterable[str]] = None) -> Dict[str, Dict[str, torch.Tensor]]:
    """Pieces ``(name, shape, start, {kind: 1-D tensor})`` (elements ``[start, start + len)`` of
    the flattened parameter) put back together as ``{name: {kind: fp32 tensor}}``, only ``names``
    if given; ValueError if a parameter is not covered exactly (a missing rank's file)."""
    wanted = set(names) if names is not None else None
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    covered: Dict[str, int] = {}
    for name, shape, start, tensors in pieces:
        if wanted is not None and name not in wanted:
            continue
        if name not in out:
            out[name] = {k: torch.zeros(shape, dtype=torch.float32) for k in tensors}
            covered[name] = 0
        for k, t in tensors.items():
            out[name][k].view(-1)[start:start + t.numel()].copy_(t)
        covered[name] += next(iter(tensors.values())).numel()
    for name, entry in out.items():
        numel = next(iter(entry.values())).numel()
        if covered[name] != numel:
            raise ValueError(f"optimizer shards cover {covered[name]} of {numel} elements of "
                             f"{name} (missing or mixed files?)")
    if wanted is not None and wanted - set(out):
        raise ValueError(f"optimizer shards hold no state for {sorted(wanted - set(out))[:3]}")
    return out


def shard_pieces(sds: List[dict]):
    """The per-parameter pieces (:func:`merge_pieces`) of per-DP-rank files (SHARD_FORMAT)."""
    for sd in sds:
        for shard in sd["shards"]:
            for name, lo, hi, plo, shape in shard["segments"]:
                yield name, shape, plo, {k: shard[k][lo:hi] for k in ADAM_KINDS}


def upgrade_shard(sd: dict) -> dict:
    """A per-DP-rank file in SHARD_FORMAT: the v1 files of older megalite (ZeRO-1/2's segments
    with an extra end; ZeRO-3's per-unit flats, DP rank r holding ``[r*S, (r+1)*S)``) translated,
    their tensors never copied."""
    fmt = sd.get("format")
    if fmt == "megalite.zero.shard/v1":
        shards = [{**{k: s[k] for k in ADAM_KINDS},
                   "segments": [[n, lo, hi, plo, shape] for n, lo, hi, plo, _, shape in
                                s["segments"]]} for s in sd["shards"]]
    elif fmt == "megalite-zero3-shard/1":
        shards = []
        for unit in sd["units"].values():
            if "names" not in unit:
                raise ValueError("ZeRO-3 optimizer shards without parameter names (saved by an "
                                 "older megalite) cannot be read; pass --no-load-optim")
            size, off, segs = unit["main"].numel(), 0, []
            base = int(sd["dp_rank"]) * size
            for name, shape in zip(unit["names"], unit["shapes"]):
                a, b = max(off, base), min(off + math.prod(shape), base + size)
                if a < b:
                    segs.append([name, a - base, b - base, a - off, list(shape)])
                off += math.prod(shape)
            shards.append({"master": unit["main"], "exp_avg": unit["exp_avg"],
                           "exp_avg_sq": unit["exp_avg_sq"], "segments": segs})
    else:
        return sd
    return {"format": SHARD_FORMAT, "zero_stage": sd.get("zero_stage", 3),
            **{k: sd.get(k) for k in ("dp_size", "dp_rank", "step", "param_groups",
                                      "grad_scaler")}, "shards": shards}


def check_shard_set(sds: List[dict]) -> List[dict]:
    """Every DP rank's file exactly once, in rank order, in SHARD_FORMAT."""
    if not sds:
        raise ValueError("no optimizer shards to merge")
    sds = sorted((upgrade_shard(sd) for sd in sds), key=lambda sd: int(sd["dp_rank"]))
    bad = [sd.get("format") for sd in sds if sd.get("format") != SHARD_FORMAT]
    if bad:
        raise ValueError(f"not a per-DP-rank optimizer state (format {bad[0]!r})")
    n = int(sds[0]["dp_size"])
    if [int(sd["dp_rank"]) for sd in sds] != list(range(n)) or any(
            int(sd["dp_size"]) != n for sd in sds):
        raise ValueError(f"optimizer shards of DP ranks {[sd['dp_rank'] for sd in sds]} do not "
                         f"make up one DP group of {n} (missing or mixed files?)")
    return sds


def _expert_grid(stage: Sequence[dict], first: dict) -> Dict[Tuple[int, int], List[dict]]:
    """The stage's files by (ETP rank, EP rank), each group checked whole over EDP."""
    grid = {}
    for sd in stage:
        if "edp_size" not in sd:
            raise ValueError(f"optimizer shard of DP rank {sd.get('dp_rank')} records no "
                             f"expert grid, the others do (mixed files?)")
        grid.setdefault((int(sd.get("etp_rank", 0)), int(sd["ep_rank"])), []).append(sd)
    etp, ep, edp = int(first.get("etp_size", 1)), int(first["ep_size"]), int(first["edp_size"])
    for (t, e), sds in sorted(grid.items()):
        got = sorted(int(sd["edp_rank"]) for sd in sds)
        if got != list(range(edp)):
            raise ValueError(f"expert optimizer shards of ETP rank {t}, EP rank {e} come from "
                             f"expert-data-parallel ranks {got}, expected 0..{edp - 1} "
                             f"(missing or mixed files?)")
    if sorted(grid) != [(t, e) for t in range(etp) for e in range(ep)]:
        raise ValueError(f"expert optimizer shards cover (ETP, EP) ranks {sorted(grid)}, "
                         f"expected {etp} x {ep} (missing files?)")
    return grid


def merge_shard_state_dicts(own: List[dict], stage: Sequence[dict] = (),
                            meta_of: Callable[[str], ParamMeta] = lambda name: ParamMeta(),
                            names: Optional[Sequence[str]] = None) -> dict:
    """The unsharded state (FULL_FORMAT) of one (TP, PP) rank from *all* its DP ranks' files
    ``own``, only ``names`` if given; where they record an expert grid, ``stage`` is every file of
    the pipeline stage, ETP slices joined along ``meta_of(name)``'s partition dim
    (docs/checkpoints.md, "Experts"). No communication; ValueError for a missing or mixed file."""
    own = check_shard_set(own)
    first = own[0]

    def pieces(sds, expert: bool):  # shard_pieces of the expert shards, or of the others
        return shard_pieces([{**sd, "shards": [s for s in sd["shards"]
                                               if bool(s.get("expert")) == expert]} for sd in sds])

    apart = "edp_size" in first
    stage = list(stage) or own
    expert_names = {g[0] for sd in stage for s in sd["shards"] if s.get("expert")
                    for g in s["segments"]} if apart else set()
    wanted = None if names is None else [n for n in names if n not in expert_names]
    params = merge_pieces(pieces(own, False), wanted)
    if apart and (names is None or len(wanted) < len(names)):
        grid = _expert_grid(stage, first)
        etp, ep = int(first.get("etp_size", 1)), int(first["ep_size"])
        want = None if names is None else [n for n in names if n in expert_names]
        parts = {te: merge_pieces(pieces(sds, True), want) for te, sds in grid.items()}
        for name in parts[(0, 0)]:
            m = meta_of(name)
            # (the partition dim, not tp_split: this run may hold the expert whole, ETP 1); dim 0
            # is the expert index, so none: whole on every ETP rank (fc2's bias, docs/moe.md)
            split = etp > 1 and m.partition_dim > 0
            params[name] = {}
            for k in ADAM_KINDS:
                slices = [torch.cat([parts[(t, e)][name][k] for e in range(ep)])
                          for t in range(etp)]
                params[name][k] = (unshard_tensors(slices, m.partition_dim, m.partition_stride)
                                   if split else slices[0])
    return {"format": FULL_FORMAT, "step": first["step"], "param_groups": first["param_groups"],
            "grad_scaler": first.get("grad_scaler"), "params": params}


def merge_rank_files(own: List[dict], tp_files: Callable[[int], List[dict]], tp: int,
                     tp_rank: int, meta_of: Callable[[str], ParamMeta],
                     names: Optional[Sequence[str]] = None) -> dict:
    """merge_shard_state_dicts of one (TP, PP) rank's DP files ``own``, with the stage's other
    TP ranks' files (``tp_files(t)``) where they shard experts apart."""
    stage = []
    if "edp_size" in own[0] and tp > 1:
        stage = [sd for t in range(tp) for sd in (own if t == tp_rank else tp_files(t))]
    return merge_shard_state_dicts(own, stage, meta_of, names)


@dataclass
class OptimCommon:
    """What is not per parameter."""

    step: int = 0
    lr: Optional[float] = None
    grad_scaler: Optional[dict] = None
    torch_groups: Optional[List[dict]] = None  # plain: torch param_groups without "params"
    zero_groups: Optional[List[dict]] = None  # ZeRO: [{"name", "lr", "weight_decay"}, ...]


def zero_common(sd: dict) -> OptimCommon:
    groups = [dict(g) for g in sd.get("param_groups", [])]
    return OptimCommon(step=int(sd["step"]), lr=float(groups[0]["lr"]) if groups else None,
                       grad_scaler=sd.get("grad_scaler"), zero_groups=groups)


class PlainIndex(NamedTuple):
    """Where each parameter of one rank lives in a plain optimizer state dict: torch numbers the
    decay group (matrices) first, then the rest, each in model_parameters order."""

    order: List[ParamSpec]  # model_parameters order
    opt_index: Dict[str, int]  # torch's state index
    master_pos: Dict[str, int]  # position in fp32_master_params
    group_sizes: List[int]

    @classmethod
    def build(cls, order: List[ParamSpec]) -> "PlainIndex":
        decay = [s.name for s in order if s.decay]
        no_decay = [s.name for s in order if not s.decay]
        return cls(order, {n: i for i, n in enumerate(decay + no_decay)},
                   {s.name: i for i, s in enumerate(order)},
                   [n for n in (len(decay), len(no_decay)) if n])


def check_plain(opt_sd: dict, index: PlainIndex, where: str) -> None:
    try:
        sizes = [len(g["params"]) for g in opt_sd["optimizer"]["param_groups"]]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: the optimizer state is not megalite's plain AdamW "
                              f"format (no optimizer.param_groups)")
    if sizes != index.group_sizes:
        raise CheckpointError(
            f"{where}: the optimizer has parameter groups of sizes {sizes}, the model layout in "
            f"args.json implies {index.group_sizes} (args.json does not describe this checkpoint)")
    state = opt_sd["optimizer"].get("state", {})
    if any("exp_avg" not in s for s in state.values()):
        raise CheckpointError(f"{where}: the optimizer state is not Adam's (no exp_avg); "
                              f"only AdamW state can be resharded: pass --no-optim")


def read_plain(opt_sd: dict, index: PlainIndex, name: str) -> Dict[str, Optional[torch.Tensor]]:
    """This rank's (TP-local) slices of one parameter's state; None where there is none yet."""
    st = opt_sd["optimizer"]["state"].get(index.opt_index[name])
    masters = opt_sd.get("fp32_master_params")
    return {"master": masters[index.master_pos[name]] if masters is not None else None,
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
            p = get(s.name, "master")
            if p is None:
                raise CheckpointError(f"no fp32 master weights for {s.name} in the source "
                                      f"checkpoint")
            masters.append(p)
        sd["fp32_master_params"] = masters
    return sd


class ZeroTarget:
    """The ZeRO files (SHARD_FORMAT) of some DP ranks of one (tp, pp) rank, filled a parameter at
    a time. ``groups``: the buckets or units, each (slots, padded size P, parameter key), a slot
    (name, start, numel, TP-local shape); DP rank d holds ``[d*P/dp, (d+1)*P/dp)`` of each.
    Padding and never-stepped moments stay zero, as training keeps them."""

    def __init__(self, groups, dp: int, stage: int, ranks=None):
        self.groups, self.dp, self.stage = groups, dp, stage
        self.ranks = list(range(dp)) if ranks is None else list(ranks)
        self.bounds = {d: [(d * padded // dp, (d + 1) * padded // dp) for _, padded, _ in groups]
                       for d in self.ranks}
        self.flat = {d: [{k: torch.zeros(hi - lo, dtype=torch.float32) for k in ADAM_KINDS}
                         for lo, hi in self.bounds[d]] for d in self.ranks}
        self.where: Dict[str, List[Tuple[int, int, int]]] = {}
        for g, (slots, _, _) in enumerate(groups):
            for name, start, numel, _ in slots:
                self.where.setdefault(name, []).append((g, start, numel))

    def fill(self, name: str, kind: str, t: Optional[torch.Tensor]) -> None:
        """Copy this rank's part of parameter ``name``'s (TP-local) state ``kind``."""
        if t is None:
            return
        t = t.reshape(-1)
        for g, start, numel in self.where.get(name, ()):
            for d in self.ranks:
                lo, hi = self.bounds[d][g]
                a, b = max(start, lo), min(start + numel, hi)
                if a < b:
                    self.flat[d][g][kind][a - lo:b - lo] = t[a - start:b - start].float()

    def files(self, common: OptimCommon, opt_cfg: OptimizerConfig) -> Dict[int, dict]:
        lr = opt_cfg.lr if common.lr is None else common.lr
        groups = ([dict(g) for g in common.zero_groups] if common.zero_groups else
                  [{"name": "decay", "lr": lr, "weight_decay": opt_cfg.weight_decay},
                   {"name": "no_decay", "lr": lr, "weight_decay": 0.0}])
        out = {}
        for d in self.ranks:
            shards = []
            for (slots, _, key), (lo, hi), flat in zip(self.groups, self.bounds[d], self.flat[d]):
                segs = [[key(n), a - lo, b - lo, a - start, shape]
                        for n, start, numel, shape in slots
                        for a, b in [(max(start, lo), min(start + numel, hi))] if a < b]
                shards.append({"segments": segs, **flat})
            out[d] = {"format": SHARD_FORMAT, "zero_stage": self.stage, "dp_size": self.dp,
                      "dp_rank": d, "step": int(common.step), "param_groups": groups,
                      "grad_scaler": common.grad_scaler, "shards": shards}
        return out


def _stand_in(spec: ParamSpec) -> torch.Tensor:
    """What ddp.params_by_dtype reads of a parameter, its dtype and its record (an expert weight
    gets a buffer of its own), on a tensor of no memory."""
    t = torch.empty(0, dtype=spec.dtype, device="meta")
    set_param_meta(t, **dataclasses.asdict(spec.meta))
    return t


def zero_groups(cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int, dp: int,
                opt_cfg: OptimizerConfig) -> list:
    """``DistributedOptimizer``'s buckets of one (tp, pp) rank, as ZeroTarget groups: chunk by
    chunk, one buffer per dtype, its buckets as DistributedDataParallel lays them out."""
    size = opt_cfg.ddp_bucket_size or DEFAULT_BUCKET_SIZE
    groups = []
    for ci, ch in enumerate(chunks):
        specs = {s.name: s for s in chunk_specs(cfg, ch, pp)}
        key = (lambda n: n) if len(chunks) == 1 else (lambda n, ci=ci: f"chunk{ci}.{n}")
        for named in params_by_dtype([(n, _stand_in(s)) for n, s in specs.items()]):
            info = [(n, specs[n].numel(cfg, tp), specs[n].meta.tied_embedding) for n, _ in named]
            for placed, padded in bucket_layout(info, size, dp):
                slots = [(n, a, specs[n].numel(cfg, tp), list(specs[n].local_shape(cfg, tp)))
                         for n, a in placed]
                groups.append((slots, padded, key))
    return groups


def zero3_units(cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int
                ) -> List[Tuple[str, List[Tuple[str, Tuple[int, ...]]]]]:
    """Zero3Model's units of one (tp, pp) rank: (unit name, [(parameter, TP-local shape)])."""
    out = []
    for ch in chunks:
        specs = {s.name: s for s in chunk_specs(cfg, ch, pp)}
        out += [(unit, [(n, specs[n].local_shape(cfg, tp)) for n in names])
                for unit, names in meta_chunk(cfg, ch, pp).units]
    return out


def zero_target(optim: str, cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int, dp: int,
                opt_cfg: OptimizerConfig, ranks=None) -> ZeroTarget:
    """The ZeroTarget of ``optim``: "zero" (ZeRO-1/2 buckets) or "zero3" (ZeRO-3 units, each
    padded to a multiple of dp)."""
    if optim != "zero3":
        return ZeroTarget(zero_groups(cfg, chunks, pp, tp, dp, opt_cfg), dp,
                          opt_cfg.zero_stage, ranks)
    groups = []
    for _, shapes in zero3_units(cfg, chunks, pp, tp):
        numels = [math.prod(shape) for _, shape in shapes]
        starts, padded = packed(numels, dp)
        slots = [(n, a, k, list(shape)) for (n, shape), a, k in zip(shapes, starts, numels)]
        groups.append((slots, padded, lambda n: n))
    return ZeroTarget(groups, dp, 3, ranks)
