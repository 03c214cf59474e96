"""Optimizer state in checkpoints, translated to and from one canonical form: by parameter name.

The on-disk formats:

* **Plain** (``MixedPrecisionOptimizer.state_dict``, megalite/optimizer/optimizer.py), inside
  ``model_optim_rng.pt["optimizer"]`` of DP rank 0:
  ``{"optimizer": torch.optim.AdamW.state_dict(), "grad_scaler": dict | None,
  "fp32_master_params": [tensor, ...] (16-bit models only)}``. torch numbers parameters by their
  position in the param groups: group 0 holds the matrices (weight decay), group 1 the 1-D
  parameters, each in ``model_parameters(chunks)`` order; the master list is in
  ``model_parameters`` order itself.
* **ZeRO-1/2/3** (``DistributedOptimizer`` / ``Zero3Optimizer.state_dict``, one format:
  ``optimizer.SHARD_FORMAT``), one file ``distrib_optim_dp{d:03d}.pt`` per DP rank. The files say
  which parameter sits where, so they are read with the optimizers' own merge
  (``optimizer.merge_pieces``; older formats through ``optimizer.upgrade_shard``); written with the
  layout rules of megalite/distributed/ themselves (``ddp.params_by_dtype``,
  ``param_and_grad_buffer.bucket_layout``, ``zero3.unit_plan``), never a restatement.

Canonical form: ``{name: {"master", "exp_avg", "exp_avg_sq"}}`` (fp32 master, Adam's moments)
with full (TP-unsharded) tensors under the layout-independent parameter names, plus
:class:`OptimCommon` (step count, learning rate, grad-scaler state, group hyperparameters). A tensor is sharded over TP exactly like
its parameter (same ``partition_dim`` / ``partition_stride``): Adam is elementwise, so a slice of
the moments belongs to the same slice of the parameter.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megalite.config import ConfigError, ModelConfig, OptimizerConfig
from megalite.convert.layout import Chunk, ParamSpec, chunk_specs, chunk_zero3_units
from megalite.distributed.ddp import DEFAULT_BUCKET_SIZE, params_by_dtype
from megalite.distributed.param_and_grad_buffer import bucket_layout, packed
from megalite.optimizer.optimizer import ADAM_KINDS, SHARD_FORMAT
from megalite.param_meta import set_param_meta

Getter = Callable[[str, str], Optional[torch.Tensor]]


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
                raise OptimizerStateError(f"no fp32 master weights for {s.name} in the source "
                                          f"checkpoint")
            masters.append(p)
        sd["fp32_master_params"] = masters
    return sd


# ========================================================================== ZeRO formats
def _zero_groups(common: OptimCommon, opt_cfg: OptimizerConfig) -> List[dict]:
    if common.zero_groups:
        return [dict(g) for g in common.zero_groups]
    lr = common.lr if common.lr is not None else opt_cfg.lr
    return [{"name": "decay", "lr": lr, "weight_decay": opt_cfg.weight_decay},
            {"name": "no_decay", "lr": lr, "weight_decay": 0.0}]


class ZeroTarget:
    """The ZeRO files (optimizer.SHARD_FORMAT) of some DP ranks of one (tp, pp) rank, filled a
    parameter at a time as a stage is assembled (the converter, and a load at another layout).

    ``groups`` are the buckets or units in order, each (slots, padded size, parameter key), a
    slot (name, start, numel, TP-local shape): DP rank d of ``dp`` holds elements
    ``[d*P/dp, (d+1)*P/dp)`` of each (ZeRO stage 0: all of it), as the optimizers shard them.
    Only the ranks asked for are allocated, and only their part: a loading rank holds its own
    shard, never the stage's whole state. Padding and never-stepped moments stay zero, as
    training keeps them."""

    def __init__(self, groups, dp: int, stage: int, ranks=None):
        self.groups, self.dp, self.stage = groups, dp, stage
        self.ranks = list(range(dp)) if ranks is None else list(ranks)
        self.bounds = {d: [(0, padded) if stage == 0 else
                           (d * padded // dp, (d + 1) * padded // dp) for _, padded, _ in groups]
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
        out = {}
        for d in self.ranks:
            shards = []
            for (slots, _, key), (lo, hi), flat in zip(self.groups, self.bounds[d], self.flat[d]):
                segs = [[key(n), a - lo, b - lo, a - start, shape]
                        for n, start, numel, shape in slots
                        for a, b in [(max(start, lo), min(start + numel, hi))] if a < b]
                shards.append({"segments": segs, **flat})
            out[d] = {"format": SHARD_FORMAT, "zero_stage": self.stage, "dp_size": self.dp,
                      "dp_rank": d, "step": int(common.step),
                      "param_groups": _zero_groups(common, opt_cfg),
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
                for unit, names in chunk_zero3_units(cfg, ch, pp)]
    return out


def zero3_groups(cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int, dp: int) -> list:
    """``Zero3Optimizer``'s units of one (tp, pp) rank as ZeroTarget groups (each unit padded to
    a multiple of dp)."""
    groups = []
    for _, shapes in zero3_units(cfg, chunks, pp, tp):
        numels = [math.prod(shape) for _, shape in shapes]
        starts, padded = packed(numels, dp)
        slots = [(n, a, k, list(shape)) for (n, shape), a, k in zip(shapes, starts, numels)]
        groups.append((slots, padded, lambda n: n))
    return groups


def zero_target(optim: str, cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int, dp: int,
                opt_cfg: OptimizerConfig, ranks=None) -> ZeroTarget:
    """The ZeroTarget of ``optim`` ("zero": ZeRO-1/2 buckets, "zero3": ZeRO-3 units)."""
    if optim == "zero3":
        return ZeroTarget(zero3_groups(cfg, chunks, pp, tp, dp), dp, 3, ranks)
    return ZeroTarget(zero_groups(cfg, chunks, pp, tp, dp, opt_cfg), dp, opt_cfg.zero_stage,
                      ranks)


def zero_common(sd: dict) -> OptimCommon:
    groups = [dict(g) for g in sd.get("param_groups", [])]
    return OptimCommon(step=int(sd["step"]), lr=float(groups[0]["lr"]) if groups else None,
                       grad_scaler=sd.get("grad_scaler"), zero_groups=groups)
