"""AdamW on ZeRO-3 shards (the optimizer half of megalite.distributed.zero3).

The step (unscale, overflow check, norm, clipping, AdamW) is ``optimizer.ShardedAdamW``'s, shared
with stages 0-2. Each rank updates only its 1/N slice of every unit's flat buffer (docs/theory.md,
ZeRO stage 3: 16Ψ/N bytes): the fp32 master shard (in fp32 training the gathered shard itself), the
fp32 gradient shard the backward reduce-scattered into, and the two Adam moments. A shard straddles
parameter boundaries, so what depends on the parameter — weight decay only on matrices (the second,
no-decay group holds biases and norm weights, as Megatron and GPT-2), counting in the gradient
norm, the sequence-parallel TP all-reduce — is applied through per-element runs (``unit.segments``:
a run-length form of a per-element mask, which costs no memory).

Interface (the one training.py uses, see megalite/optimizer/optimizer.py):

    opt = Zero3Optimizer(zero3_model, opt_cfg, ps)
    opt.zero_grad(); loss = opt.scale_loss(loss); updated, grad_norm, _ = opt.step()
    opt.get_loss_scale(); opt.param_groups (the LR scheduler writes group["lr"])
    opt.state_dict() / load_state_dict(sd)        this DP rank's shards (same DP size to load)
    opt.gather_full_state() / load_full_state(f)  consolidated by parameter name (any DP size)
    merge_shard_state_dicts([sd_dp0, sd_dp1, ...]) the same, from the saved per-rank files
"""

from __future__ import annotations

import itertools
import math
from typing import List

import torch

from megalite.distributed.zero3 import Zero3Model
from megalite.optimizer.clip_grads import counts_for_norm
from megalite.optimizer.optimizer import ShardedAdamW, merge_pieces

DECAY, NO_DECAY = 0, 1
SHARD_FORMAT = "megalite-zero3-shard/1"
_FULL_FORMAT = "megalite-zero3-full/1"
_FILE_KINDS = {"param": "main", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


class Zero3Optimizer(ShardedAdamW):
    def __init__(self, model, opt_cfg, ps):
        # One Zero3Model, or one per pipeline chunk (virtual stages): their units together are
        # this rank's model state; unit names are unique (layers carry their global number).
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not chunks or not all(isinstance(c, Zero3Model) for c in chunks):
            raise TypeError("Zero3Optimizer needs the Zero3Model(s) from shard_model_zero3")
        self._init_shared(opt_cfg, ps)
        self.chunks = chunks
        self.model = chunks[0]  # its flat-buffer helpers work on any chunk's units
        self.units = [u for c in chunks for u in c.units]
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"ZeRO-3 unit names repeat across model chunks: {names}")
        self.masters = [u.main for u in self.units]
        self.exp_avg = [torch.zeros_like(u.main) for u in self.units]
        self.exp_avg_sq = [torch.zeros_like(u.main) for u in self.units]
        # Per-unit runs (start, end, group) and the runs that count in the gradient norm: each
        # element counted once over tp x dp (DP shards are disjoint; a TP-sharded parameter
        # counts on every TP rank, a replicated one on TP rank 0 only).
        self.runs = [[(s.start, s.end, DECAY if len(u.shapes[s.param_index]) > 1 else NO_DECAY)
                      for s in u.segments] for u in self.units]
        self.norm_runs = [[(s.start, s.end) for s in u.segments
                           if counts_for_norm(u.params[s.param_index], ps.tp_rank,
                                              ps.is_pipeline_first_stage)] for u in self.units]

    # ------------------------------------------------------------------------------ interface
    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_shards()

    def reload_model_params(self) -> None:
        """The masters live in the model's units (shared), so there is nothing to copy."""

    def _finish_grads(self) -> None:
        for c in self.chunks:
            c.finalize_grads()

    def _grads(self) -> List[torch.Tensor]:
        return [u.grad for u in self.units]

    def _publish(self) -> None:
        for u in self.units:
            if u.shard is not u.main:
                u.shard.copy_(u.main)  # round the fp32 masters into the 16-bit gather source

    # ---------------------------------------------------------------------- per-rank checkpoint
    def state_dict(self) -> dict:
        units = {}
        for u, m, v in zip(self.units, self.exp_avg, self.exp_avg_sq):
            # names and shapes make the file self-describing: merging the shards of every DP
            # rank by parameter name needs no model (pretrain at another DP size, convert.py).
            units[u.name] = {"numel": u.numel, "names": list(u.names),
                             "shapes": [list(s) for s in u.shapes], "offsets": list(u.offsets),
                             "main": u.main, "exp_avg": m, "exp_avg_sq": v}
        return {
            "format": SHARD_FORMAT,
            "dp_size": self.units[0].dp_size if self.units else 1,
            "dp_rank": self.units[0].dp_rank if self.units else 0,
            **self._common_state(), "units": units,
        }

    def shard_fits(self, sd: dict) -> bool:
        """True if ``sd`` is this very rank's shard: same format, DP size and rank, and the same
        units holding the same parameters (else checkpointing merges every rank's file)."""
        if sd.get("format") != SHARD_FORMAT or not self.units:
            return False
        u0 = self.units[0]
        if (sd.get("dp_size"), sd.get("dp_rank")) != (u0.dp_size, u0.dp_rank):
            return False
        saved = sd.get("units", {})
        return (list(saved) == [u.name for u in self.units]
                and all(saved[u.name].get("names", u.names) == u.names
                        and saved[u.name]["numel"] == u.numel
                        # files from before the aligned layout have no offsets: merged
                        and saved[u.name].get("offsets") == list(u.offsets) for u in self.units))

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """This rank's own shard (fast path, no copy of anything else), or a consolidated state
        (:meth:`gather_full_state`, :func:`merge_shard_state_dicts`) from any DP size."""
        if sd.get("format") == _FULL_FORMAT:
            self.load_full_state(sd)
            return
        if sd.get("format") != SHARD_FORMAT:
            raise ValueError(f"not a ZeRO-3 optimizer state (format {sd.get('format')!r})")
        dp = self.units[0].dp_size
        if sd["dp_size"] != dp or sd["dp_rank"] != self.units[0].dp_rank:
            raise ValueError(f"ZeRO-3 optimizer state was saved by DP rank {sd['dp_rank']} of "
                             f"{sd['dp_size']}, this is rank {self.units[0].dp_rank} of "
                             f"{dp}: reshard with gather_full_state()/load_full_state()")
        if not self.shard_fits(sd):
            raise ValueError(f"ZeRO-3 optimizer state has units {list(sd['units'])[:4]}..., this "
                             f"model {[u.name for u in self.units][:4]}... (different model "
                             f"config?)")
        for u, m, v in zip(self.units, self.exp_avg, self.exp_avg_sq):
            s = sd["units"][u.name]
            u.main.copy_(s["main"])
            m.copy_(s["exp_avg"])
            v.copy_(s["exp_avg_sq"])
        self._publish()
        self._load_common(sd)

    @staticmethod
    def merge_shard_state_dicts(sds: List[dict]) -> dict:
        """The checkpoint loader's seam (megalite/checkpointing.py): see the module function."""
        return merge_shard_state_dicts(sds)

    # ------------------------------------------------------------------- consolidated full state
    @torch.no_grad()
    def gather_full_state(self) -> dict:
        """Model weights and optimizer states of the whole model (this TP rank's shapes) by
        megalite parameter name. Collective over DP; every DP rank gets the same dict."""
        zm = self.model
        opt = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for u, m, v in zip(self.units, self.exp_avg, self.exp_avg_sq):
            for kind, t in zip(opt, (u.main, m, v)):
                opt[kind].update(zm.split_flat(u, zm.gather_flat(u, t)))
        return {"format": _FULL_FORMAT, **self._common_state(), "optimizer": opt,
                "model": {k: t.to(zm.compute_dtype) for k, t in opt["master"].items()}}

    @torch.no_grad()
    def load_full_state(self, full: dict) -> None:
        """Reshard a consolidated state (from any DP size) onto this rank's shards."""
        if full.get("format") != _FULL_FORMAT:
            raise ValueError(f"not a ZeRO-3 full state (format {full.get('format')!r})")
        zm = self.model
        opt = full["optimizer"]
        for u, m, v in zip(self.units, self.exp_avg, self.exp_avg_sq):
            u.main.copy_(zm.local_shard_of(u, opt["master"]))
            m.copy_(zm.local_shard_of(u, opt["exp_avg"]))
            v.copy_(zm.local_shard_of(u, opt["exp_avg_sq"]))
        self._publish()
        self._load_common(full)


def zero3_pieces(sds: List[dict]):
    """The per-parameter pieces (optimizer.merge_pieces) of every DP rank's Zero3Optimizer file:
    a unit's flat buffer is rank r's elements [r*S, (r+1)*S), its parameters at the unit's
    ``offsets``, in the order of its ``names``."""
    if not sds:
        raise ValueError("no ZeRO-3 optimizer shards to merge")
    bad = [sd.get("format") for sd in sds if sd.get("format") != SHARD_FORMAT]
    if bad:
        raise ValueError(f"not a ZeRO-3 per-rank optimizer state (format {bad[0]!r})")
    n = int(sds[0]["dp_size"])
    ranks = sorted(int(sd["dp_rank"]) for sd in sds)
    if ranks != list(range(n)) or any(int(sd["dp_size"]) != n for sd in sds):
        raise ValueError(f"ZeRO-3 optimizer shards of DP ranks {ranks} do not make up one DP "
                         f"group of {n} (missing or mixed files?)")
    for sd in sds:
        for unit in sd["units"].values():
            if "names" not in unit:
                raise ValueError("ZeRO-3 optimizer shards carry no parameter names (saved by an "
                                 "older megalite); resume at the DP size that saved them")
            size = unit["main"].numel()
            base = int(sd["dp_rank"]) * size
            for name, shape, off in zip(unit["names"], unit["shapes"], _offsets(unit)):
                numel = math.prod(shape)
                a, b = max(off, base), min(off + numel, base + size)
                if a < b:
                    yield name, shape, a - off, {k: unit[f][a - base:b - base]
                                                 for k, f in _FILE_KINDS.items()}


def _offsets(unit: dict) -> List[int]:
    """Where each parameter of a saved unit starts; files saved before the aligned layout carry
    no offsets and packed their parameters end to end."""
    if "offsets" in unit:
        return [int(o) for o in unit["offsets"]]
    ends = list(itertools.accumulate(math.prod(s) for s in unit["shapes"]))
    return [0] + ends[:-1]


def merge_shard_state_dicts(sds: List[dict]) -> dict:
    """Every DP rank's ``Zero3Optimizer.state_dict()`` (one TP/PP rank) merged into the
    consolidated form :meth:`Zero3Optimizer.load_full_state` re-splits at any DP size: this is
    how a stage-3 checkpoint resumes at another DP size."""
    merged = merge_pieces(zero3_pieces(sds))
    first = min(sds, key=lambda sd: int(sd["dp_rank"]))
    opt = {kind: {name: e[k] for name, e in merged.items()}
           for kind, k in (("master", "param"), ("exp_avg", "exp_avg"),
                           ("exp_avg_sq", "exp_avg_sq"))}
    return {"format": _FULL_FORMAT, "model": {}, "step": first["step"], "optimizer": opt,
            "param_groups": first["param_groups"], "grad_scaler": first.get("grad_scaler")}
