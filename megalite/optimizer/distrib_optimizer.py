"""The ZeRO distributed optimizer (stages 0, 1, 2) over DistributedDataParallel's buffers.

ZeRO (Rajbhandari et al. 2020; docs/theory.md, "ZeRO"): with N data-parallel ranks, rank r owns
shard r of every bucket (``bucket[r*B/N:(r+1)*B/N]``, param_and_grad_buffer.py) and keeps the fp32
master parameters and the Adam moments of that shard only. A step is

    reduce-scatter grads (DDP, during/after backward)  ->  unscale, overflow check, clip
    ->  AdamW on the flat shard  ->  copy master -> model param shard
    ->  all-gather each bucket's params (at once, or overlapped with the next forward)

which moves the same 2Ψ elements per rank as the all-reduce of plain DP (docs/theory.md: all-reduce
= reduce-scatter + all-gather) while cutting optimizer memory by N. Stage 2 additionally keeps only
the gradient shard (ddp.py). Stage 0 is the same code with the "shard" = the whole bucket: every
rank all-reduces and steps the full model.

Per-rank model-state bytes (megalite's layout; measured by megalite/memory.py):

    fp32:        params 4Ψ + grads 4Ψ (stage 2: 4Ψ/N) + Adam 8Ψ/N (stage 0: 8Ψ)   [masters = params]
    bf16/fp16:   params 2Ψ + fp32 grads 4Ψ (stage 2: 4Ψ/N) + masters 4Ψ/N + Adam 8Ψ/N
                 (stage 0: 4Ψ + 8Ψ), i.e. Megatron's 6 + 12/N bytes per parameter for stage 1.

The AdamW update is written on the flat shard with torch's ``_foreach`` kernels in exactly the
order of ``torch.optim.AdamW``'s foreach path, so a DP run matches a single-process
``torch.optim.AdamW`` run. Shards straddle parameters, so weight decay is applied per segment
(the part of a parameter inside the shard): matrices decay, biases and norm weights (dim <= 1) do
not — the same rule as the plain optimizer (optimizer.py).

Checkpoints: :meth:`state_dict` is this DP rank's shard (``sharded_state_dict_per_dp_rank``: the
checkpoint writer saves one file per DP rank) and loads only at the same DP size and layout. To
change the DP size, save :meth:`gather_full_optimizer_state` (collective over DP; unsharded fp32
params and moments keyed by parameter name) and load it with :meth:`load_full_optimizer_state`, which
re-splits it for the new layout without communication. See docs/data_parallel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from megalite import collectives as C
from megalite.config import ConfigError, OptimizerConfig
from megalite.distributed.ddp import DistributedDataParallel
from megalite.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer
from megalite.optimizer.clip_grads import counts_for_norm
from megalite.optimizer.grad_scaler import build_grad_scaler, check_grad_norm
from megalite.parallel_state import ParallelState

FULL_STATE_FORMAT = "megalite.zero.full/v1"


@dataclass
class Segment:
    """The part [lo, hi) of a flat shard that belongs to one parameter (elements [plo, phi) of it)."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    plo: int
    phi: int
    decay: bool
    counts_for_norm: bool


@dataclass
class Shard:
    """What this rank's optimizer owns of one bucket."""

    ddp: DistributedDataParallel
    buffer: ParamAndGradBuffer
    bucket: Bucket
    start: int  # buffer coordinates
    end: int
    master: torch.Tensor  # fp32; for fp32 models a view of the param buffer (no copy)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    segments: List[Segment] = field(default_factory=list)

    @property
    def model_param_shard(self) -> torch.Tensor:
        return self.buffer.param_data[self.start:self.end]

    @property
    def grad(self) -> torch.Tensor:
        return self.buffer.grad_shard(self.bucket)


def _world_group():
    return dist.group.WORLD if dist.is_initialized() else None


class DistributedOptimizer:
    """AdamW over this rank's ZeRO shards; the interface of megalite/optimizer/optimizer.py."""

    sharded_state_dict_per_dp_rank = True

    def __init__(self, model_chunks, config: OptimizerConfig, ps: ParallelState, **unused):
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        for c in chunks:
            if not isinstance(c, DistributedDataParallel):
                raise ConfigError(
                    "--zero-stage >= 1 / --use-distributed-optimizer needs the model chunks wrapped "
                    "in megalite.distributed.DistributedDataParallel (training.py's "
                    "wrap_model_for_data_parallel does it)")
        self.chunks = chunks
        self.cfg = config
        self.ps = ps
        self.zero_stage = config.zero_stage
        self.dp_group = ps.dp_group
        self.dp_size = C.group_size(ps.dp_group)
        self.dp_rank = C.group_rank(ps.dp_group)
        self.step_count = 0
        self.grad_scaler = build_grad_scaler(config)
        # Two groups like the plain optimizer; the LR scheduler writes group["lr"] and step() reads
        # lr and weight_decay from here. "params" holds the segments for inspection only.
        self.param_groups = [
            {"params": [], "lr": config.lr, "weight_decay": config.weight_decay, "name": "decay"},
            {"params": [], "lr": config.lr, "weight_decay": 0.0, "name": "no_decay"},
        ]
        names: Dict[str, nn.Parameter] = {}
        self.shards: List[Shard] = []
        for ci, ddp in enumerate(chunks):
            for buf in ddp.grad_buffers:
                for b in buf.buckets:
                    self.shards.append(self._make_shard(ci, ddp, buf, b, names))
        self.param_names = names
        self._shard_of_segment = {id(seg): s for s in self.shards for seg in s.segments}

    # ------------------------------------------------------------------------------ layout
    def _key(self, ci: int, name: str) -> str:
        return name if len(self.chunks) == 1 else f"chunk{ci}.{name}"

    def _make_shard(self, ci, ddp, buf, bucket, names) -> Shard:
        start, end = buf.shard_range(bucket)
        model_shard = buf.param_data[start:end]
        if buf.param_dtype == torch.float32:
            master = model_shard  # fp32 params are their own masters (docs/theory.md: K = 8)
        else:
            master = model_shard.detach().clone().float()
        shard = Shard(ddp, buf, bucket, start, end, master,
                      torch.zeros_like(master, dtype=torch.float32),
                      torch.zeros_like(master, dtype=torch.float32))
        for slot in bucket.slots:
            a, b = max(slot.start, start), min(slot.end, end)
            key = self._key(ci, slot.name)
            if key in names and names[key] is not slot.param:
                raise ValueError(f"parameter name {key} appears twice among the model chunks")
            names[key] = slot.param
            if a >= b:
                continue
            seg = Segment(key, slot.param, a - start, b - start, a - slot.start, b - slot.start,
                          decay=slot.param.dim() > 1,
                          counts_for_norm=counts_for_norm(slot.param, self.ps.tp_rank,
                                                          self.ps.is_pipeline_first_stage))
            shard.segments.append(seg)
            self.param_groups[0 if seg.decay else 1]["params"].append(seg)
        return shard

    # ---------------------------------------------------------------------------- interface
    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def _finish_grad_sync(self) -> None:
        # Normally done by finalize_model_grads_ddp (the schedule's finalize hook); harmless twice.
        for c in self.chunks:
            c.finish_grad_sync()

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        self._finish_grad_sync()
        for c in self.chunks:
            c.finish_param_sync()  # never write params while last step's gather is in flight
        grads = [s.grad for s in self.shards]

        if self.grad_scaler is not None:
            torch._foreach_mul_(grads, 1.0 / self.grad_scaler.scale)
            # Each rank sees only its shard, so the flag must be agreed by every rank (MAX over
            # the world), or some ranks would step and others skip.
            flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
            for g in grads:
                if not torch.isfinite(g).all():
                    flag.fill_(1.0)
                    break
            C.all_reduce(flag, group=_world_group(), op=C.ReduceOp.MAX, tag="found_inf_all_reduce")
            found_inf = bool(flag.item() > 0)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None, None

        grad_norm = self._global_grad_norm()
        check_grad_norm(self, grad_norm)
        if self.cfg.clip_grad > 0:
            coef = self.cfg.clip_grad / (grad_norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        self._adamw(grads)
        if self.shards[0].master is not self.shards[0].model_param_shard:
            for s in self.shards:
                if s.master.data_ptr() != s.model_param_shard.data_ptr():
                    s.model_param_shard.copy_(s.master)
        for c in self.chunks:
            c.start_param_sync()
        return True, grad_norm, None

    def _global_grad_norm(self) -> float:
        """L2 norm of the full model's gradient, each element counted once over the world.

        Stages 1/2: the DP ranks hold disjoint shards, so the squares are summed over DP and then
        over model parallelism (clip_grads.counts_for_norm's TP/replicated/shared-embedding rule).
        Stage 0: DP replicas are equal, so only over model parallelism.
        """
        views = [s.grad[seg.lo:seg.hi] for s in self.shards for seg in s.segments
                 if seg.counts_for_norm]
        device = self.shards[0].grad.device
        if views:
            norms = torch._foreach_norm(views)
            sq = torch.stack(norms).double().pow(2).sum().float().reshape(1)
        else:
            sq = torch.zeros(1, dtype=torch.float32, device=device)
        if self.zero_stage >= 1:
            C.all_reduce(sq, group=self.dp_group, tag="grad_norm_all_reduce")
        C.all_reduce(sq, group=self.ps.mp_group, tag="grad_norm_all_reduce")
        return float(sq.sqrt().item())

    def _adamw(self, grads: List[torch.Tensor]) -> None:
        """torch.optim.AdamW (foreach path) on the flat shards, decay applied per segment."""
        cfg = self.cfg
        beta1, beta2, eps = cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps
        self.step_count += 1
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            if wd != 0 and group["params"]:
                views = [self._shard_of_segment[id(seg)].master[seg.lo:seg.hi]
                         for seg in group["params"]]
                torch._foreach_mul_(views, 1 - lr * wd)
        masters = [s.master for s in self.shards]
        exp_avgs = [s.exp_avg for s in self.shards]
        exp_avg_sqs = [s.exp_avg_sq for s in self.shards]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        bias_correction1 = 1 - beta1 ** self.step_count
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** self.step_count)
        lrs = {g["lr"] for g in self.param_groups}
        if len(lrs) == 1:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(masters, exp_avgs, denom, -lrs.pop() / bias_correction1)
            return
        # Different learning rates per group: update segment by segment (padding stays 0).
        for group in self.param_groups:
            segs = group["params"]
            if not segs:
                continue
            shards = self._shard_of_segment
            p = [shards[id(g)].master[g.lo:g.hi] for g in segs]
            m = [shards[id(g)].exp_avg[g.lo:g.hi] for g in segs]
            v = [shards[id(g)].exp_avg_sq[g.lo:g.hi] for g in segs]
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(p, m, denom, -group["lr"] / bias_correction1)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Masters <- model params (after loading model weights without optimizer state)."""
        for c in self.chunks:
            c.finish_param_sync()
        for s in self.shards:
            if s.master.data_ptr() != s.model_param_shard.data_ptr():
                s.master.copy_(s.model_param_shard.float())

    # ------------------------------------------------------------------------- accounting
    def model_state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        """The tensors megalite/memory.py counts as masters and optimizer states."""
        return {"master_params": [s.master for s in self.shards],
                "optimizer_states": [t for s in self.shards for t in (s.exp_avg, s.exp_avg_sq)]}

    # -------------------------------------------------------------------------- checkpoints
    def _layout(self) -> List[Tuple[int, int, int]]:
        return [(s.bucket.numel, s.start - s.bucket.offset, s.end - s.bucket.offset)
                for s in self.shards]

    def state_dict(self) -> dict:
        """This DP rank's shard (tensors and primitives only: safe for weights_only loading)."""
        for c in self.chunks:
            c.finish_param_sync()
        return {
            "format": "megalite.zero.shard/v1",
            "zero_stage": self.zero_stage, "dp_size": self.dp_size, "dp_rank": self.dp_rank,
            "step": self.step_count,
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in self.param_groups],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "layout": [list(x) for x in self._layout()],
            "shards": [{"master": s.master.detach().clone(), "exp_avg": s.exp_avg.clone(),
                        "exp_avg_sq": s.exp_avg_sq.clone(),
                        # enough to rebuild the unsharded state from all DP ranks' files
                        "segments": [[g.name, g.lo, g.hi, g.plo, g.phi, list(g.param.shape)]
                                     for g in s.segments]} for s in self.shards],
        }

    def shard_fits(self, sd: dict) -> bool:
        """Whether a per-DP-rank state dict was saved with this DP size and bucket layout."""
        return (sd.get("format") == "megalite.zero.shard/v1" and sd.get("dp_size") == self.dp_size
                and sd.get("dp_rank") == self.dp_rank
                and [tuple(x) for x in sd.get("layout", [])] == self._layout())

    def _load_common(self, sd: dict) -> None:
        self.step_count = int(sd["step"])
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            g["lr"] = saved["lr"]  # weight decay stays this run's flag
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if sd.get("format") == FULL_STATE_FORMAT:
            return self.load_full_optimizer_state(sd)
        if not self.shard_fits(sd):
            raise ValueError(
                f"optimizer shard was saved with DP size {sd.get('dp_size')} and a different "
                f"bucket layout; this run has DP size {self.dp_size}. Load the unsharded state "
                f"with load_full_optimizer_state() (docs/data_parallel.md)")
        self._load_common(sd)
        for c in self.chunks:
            c.finish_param_sync()
        for s, saved in zip(self.shards, sd["shards"]):
            s.exp_avg.copy_(saved["exp_avg"])
            s.exp_avg_sq.copy_(saved["exp_avg_sq"])
            s.master.copy_(saved["master"])
            if s.master.data_ptr() != s.model_param_shard.data_ptr():
                s.model_param_shard.copy_(s.master)
        for c in self.chunks:
            c.start_param_sync(overlap=False)

    @torch.no_grad()
    def gather_full_optimizer_state(self) -> dict:
        """Unsharded fp32 params and Adam moments keyed by parameter name (collective over DP).

        Every DP rank returns the same dict; names are the chunk's own (prefixed "chunk{i}." when
        there are several chunks). The params/moments are this rank's TP/PP slice, unsharded over DP.
        """
        for c in self.chunks:
            c.finish_param_sync()
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        for s in self.shards:
            full = {}
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                local = getattr(s, kind)
                if self.zero_stage == 0:
                    full[kind] = local.detach().clone()
                else:
                    t = torch.empty(s.bucket.numel, dtype=torch.float32, device=local.device)
                    C.all_gather_into_tensor(t, local.detach().float(), group=self.dp_group,
                                             tag="checkpoint_all_gather")
                    full[kind] = t
            ci = self.chunks.index(s.ddp)
            for slot in s.bucket.slots:
                lo = slot.start - s.bucket.offset
                key = self._key(ci, slot.name)
                out[key] = {("param" if k == "master" else k): v[lo:lo + slot.numel]
                            .view(slot.param.shape).clone() for k, v in full.items()}
        return {
            "format": FULL_STATE_FORMAT, "step": self.step_count,
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in self.param_groups],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "params": out,
        }

    @torch.no_grad()
    def load_full_optimizer_state(self, full: dict) -> None:
        """Re-split an unsharded state (any DP size it came from) into this rank's shards.

        Also writes the fp32 params into the model (rounded for 16-bit models), so model and
        masters agree; no communication is needed since every rank reads the full tensors.
        """
        if full.get("format") != FULL_STATE_FORMAT:
            raise ValueError("not an unsharded ZeRO optimizer state (gather_full_optimizer_state)")
        params = full["params"]
        missing = sorted(set(self.param_names) - set(params))
        if missing:
            raise ValueError(f"optimizer state lacks parameters {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        self._load_common(full)
        for c in self.chunks:
            c.finish_param_sync()
        for name, p in self.param_names.items():
            saved = params[name]["param"]
            if tuple(saved.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state for {name} has shape {tuple(saved.shape)}, the "
                                 f"model {tuple(p.shape)}: a different TP layout?")
            p.data.copy_(saved.to(p.dtype))
        for s in self.shards:
            for seg in s.segments:
                entry = params[seg.name]
                s.exp_avg[seg.lo:seg.hi].copy_(entry["exp_avg"].reshape(-1)[seg.plo:seg.phi])
                s.exp_avg_sq[seg.lo:seg.hi].copy_(entry["exp_avg_sq"].reshape(-1)[seg.plo:seg.phi])
                s.master[seg.lo:seg.hi].copy_(entry["param"].reshape(-1)[seg.plo:seg.phi])


def merge_shard_state_dicts(shard_state_dicts: List[dict]) -> dict:
    """The unsharded state (as gather_full_optimizer_state returns) from *all* DP ranks' shards.

    For resuming at a different DP size or bucket layout: the checkpoint loader reads every
    ``distrib_optim_dp*.pt`` of one (TP, PP) rank and hands the result to
    :meth:`DistributedOptimizer.load_full_optimizer_state` (through ``load_state_dict``), which
    re-splits it. No communication: each rank merges the files itself.
    """
    if not shard_state_dicts:
        raise ValueError("no optimizer shards to merge")
    sds = sorted(shard_state_dicts, key=lambda sd: sd["dp_rank"])
    n = sds[0]["dp_size"]
    if [sd["dp_rank"] for sd in sds] != list(range(n)):
        raise ValueError(f"optimizer shards of DP ranks {[sd['dp_rank'] for sd in sds]} found, "
                         f"expected all of 0..{n - 1}")
    if sds[0].get("zero_stage") == 0:
        sds = sds[:1]  # stage 0: every DP rank holds the whole state
    params: Dict[str, Dict[str, torch.Tensor]] = {}
    covered: Dict[str, int] = {}
    for sd in sds:
        for shard in sd["shards"]:
            for name, lo, hi, plo, phi, shape in shard["segments"]:
                if name not in params:
                    numel = math.prod(shape)
                    params[name] = {k: torch.zeros(numel, dtype=torch.float32)
                                    for k in ("param", "exp_avg", "exp_avg_sq")}
                    params[name]["_shape"] = shape
                    covered[name] = 0
                for kind, key in (("master", "param"), ("exp_avg", "exp_avg"),
                                  ("exp_avg_sq", "exp_avg_sq")):
                    params[name][key][plo:phi].copy_(shard[kind][lo:hi].float())
                covered[name] += phi - plo
    for name, entry in params.items():
        shape = entry.pop("_shape")
        if covered[name] != math.prod(shape):
            raise ValueError(f"optimizer shards cover {covered[name]} of {math.prod(shape)} "
                             f"elements of {name}")
        for k in list(entry):
            entry[k] = entry[k].view(shape)
    first = sds[0]
    return {"format": FULL_STATE_FORMAT, "step": first["step"],
            "param_groups": first["param_groups"], "grad_scaler": first["grad_scaler"],
            "params": params}
