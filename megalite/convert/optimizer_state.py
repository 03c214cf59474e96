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


def _flat(slots, padded: int, get: Getter) -> Dict[str, torch.Tensor]:
    """One bucket's / unit's flat fp32 state: slot (name, start, numel, shape) filled from
    ``get(name, kind)``; padding and never-stepped moments stay zero, as training keeps them."""
    flat = {k: torch.zeros(padded, dtype=torch.float32) for k in ADAM_KINDS}
    for name, start, numel, _ in slots:
        for kind in ADAM_KINDS:
            t = get(name, kind)
            if t is not None:
                flat[kind][start:start + numel] = t.reshape(-1).float()
    return flat


def _per_rank_files(groups, dp: int, stage: int, common: OptimCommon,
                    opt_cfg: OptimizerConfig) -> List[dict]:
    """One file per DP rank (optimizer.SHARD_FORMAT) from ``groups`` of (slots, padded size,
    flat state, parameter key), one per bucket or unit: DP rank d holds elements
    ``[d*P/dp, (d+1)*P/dp)`` of each (ZeRO stage 0: all of it), as the optimizers shard them."""
    out = []
    for d in range(dp):
        shards = []
        for slots, padded, flat, key in groups:
            lo, hi = (0, padded) if stage == 0 else (d * padded // dp, (d + 1) * padded // dp)
            segs = [[key(n), a - lo, b - lo, a - start, shape] for n, start, numel, shape in slots
                    for a, b in [(max(start, lo), min(start + numel, hi))] if a < b]
            shards.append({"segments": segs, **{k: flat[k][lo:hi].clone() for k in ADAM_KINDS}})
        out.append({"format": SHARD_FORMAT, "zero_stage": stage, "dp_size": dp, "dp_rank": d,
                    "step": int(common.step), "param_groups": _zero_groups(common, opt_cfg),
                    "grad_scaler": common.grad_scaler, "shards": shards})
    return out


def _stand_in(spec: ParamSpec) -> torch.Tensor:
    """What ddp.params_by_dtype reads of a parameter, its dtype and its record (an expert weight
    gets a buffer of its own), on a tensor of no memory."""
    t = torch.empty(0, dtype=spec.dtype, device="meta")
    set_param_meta(t, **dataclasses.asdict(spec.meta))
    return t


def build_zero(cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int, dp: int, get: Getter,
               common: OptimCommon, opt_cfg: OptimizerConfig) -> List[dict]:
    """One ``DistributedOptimizer.state_dict()`` per DP rank for one (tp, pp) rank: chunk by
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
                groups.append((slots, padded, _flat(slots, padded, get), key))
    return _per_rank_files(groups, dp, opt_cfg.zero_stage, common, opt_cfg)


def zero3_units(cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int
                ) -> List[Tuple[str, List[Tuple[str, Tuple[int, ...]]]]]:
    """Zero3Model's units of one (tp, pp) rank: (unit name, [(parameter, TP-local shape)])."""
    out = []
    for ch in chunks:
        specs = {s.name: s for s in chunk_specs(cfg, ch, pp)}
        out += [(unit, [(n, specs[n].local_shape(cfg, tp)) for n in names])
                for unit, names in chunk_zero3_units(cfg, ch, pp)]
    return out


def build_zero3(cfg: ModelConfig, chunks: List[Chunk], pp: int, tp: int, dp: int, get: Getter,
                common: OptimCommon, opt_cfg: OptimizerConfig) -> List[dict]:
    """One ``Zero3Optimizer.state_dict()`` per DP rank (each unit padded to a multiple of dp)."""
    groups = []
    for _, shapes in zero3_units(cfg, chunks, pp, tp):
        numels = [math.prod(shape) for _, shape in shapes]
        starts, padded = packed(numels, dp)
        slots = [(n, a, k, list(shape)) for (n, shape), a, k in zip(shapes, starts, numels)]
        groups.append((slots, padded, _flat(slots, padded, get), lambda n: n))
    return _per_rank_files(groups, dp, 3, common, opt_cfg)


def zero_common(sd: dict) -> OptimCommon:
    groups = [dict(g) for g in sd.get("param_groups", [])]
    return OptimCommon(step=int(sd["step"]), lr=float(groups[0]["lr"]) if groups else None,
                       grad_scaler=sd.get("grad_scaler"), zero_groups=groups)
