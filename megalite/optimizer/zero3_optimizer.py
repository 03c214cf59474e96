"""AdamW on ZeRO-3 shards (the optimizer half of megalite.distributed.zero3).

Each rank updates only its 1/N slice of every unit's flat buffer (docs/theory.md, ZeRO stage 3:
16Ψ/N bytes): the fp32 master shard (in fp32 training the gathered shard itself), the fp32
gradient shard the backward reduce-scattered into, and the two Adam moments. A shard straddles
parameter boundaries, so what depends on the parameter — weight decay only on matrices (the
second, no-decay group holds biases and norm weights, as Megatron and GPT-2), counting in the
gradient norm, the sequence-parallel TP all-reduce — is applied through per-element runs
(``unit.segments``: a run-length form of a per-element mask, which costs no memory).

Interface (the one training.py uses, see megalite/optimizer/optimizer.py):

    opt = Zero3Optimizer(zero3_model, opt_cfg, ps)
    opt.zero_grad(); loss = opt.scale_loss(loss); updated, grad_norm, _ = opt.step()
    opt.get_loss_scale(); opt.param_groups (the LR scheduler writes group["lr"])
    opt.state_dict() / load_state_dict(sd)        this DP rank's shards (same DP size to load)
    opt.gather_full_state() / load_full_state(f)  consolidated by parameter name (any DP size)
    merge_shard_state_dicts([sd_dp0, sd_dp1, ...]) the same, from the saved per-rank files
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from megalite import collectives as C
from megalite.distributed.zero3 import Zero3Model
from megalite.optimizer.clip_grads import counts_for_norm
from megalite.optimizer.grad_scaler import build_grad_scaler, check_grad_norm

DECAY, NO_DECAY = 0, 1
_SHARD_FORMAT = "megalite-zero3-shard/1"
_FULL_FORMAT = "megalite-zero3-full/1"


class Zero3Optimizer:
    sharded_state_dict_per_dp_rank = True

    def __init__(self, model, opt_cfg, ps):
        # One Zero3Model, or one per pipeline chunk (virtual stages): their units together are
        # this rank's model state; unit names are unique (layers carry their global number).
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not chunks or not all(isinstance(c, Zero3Model) for c in chunks):
            raise TypeError("Zero3Optimizer needs the Zero3Model(s) from shard_model_zero3")
        self.chunks = chunks
        self.model = chunks[0]  # its flat-buffer helpers work on any chunk's units
        self.units = [u for c in chunks for u in c.units]
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"ZeRO-3 unit names repeat across model chunks: {names}")
        self.cfg = opt_cfg
        self.ps = ps
        self.param_groups = [
            {"name": "decay", "lr": opt_cfg.lr, "weight_decay": opt_cfg.weight_decay},
            {"name": "no_decay", "lr": opt_cfg.lr, "weight_decay": 0.0},
        ]
        self.step_count = 0
        self.exp_avg = [torch.zeros_like(u.main) for u in self.units]
        self.exp_avg_sq = [torch.zeros_like(u.main) for u in self.units]
        # Per-unit runs [(start, end, group)] and the runs that count in the gradient norm.
        self.runs: List[List[Tuple[int, int, int]]] = []
        self.norm_runs: List[List[Tuple[int, int]]] = []
        for u in self.units:
            runs, norm = [], []
            for s in u.segments:
                p = u.params[s.param_index]
                group = DECAY if len(u.shapes[s.param_index]) > 1 else NO_DECAY
                runs.append((s.start, s.end, group))
                # Each element counted once over tp x dp: DP shards are disjoint; a TP-sharded
                # parameter counts on every TP rank, a replicated one on TP rank 0 only.
                if counts_for_norm(p, ps.tp_rank, ps.is_pipeline_first_stage):
                    norm.append((s.start, s.end))
            self.runs.append(runs)
            self.norm_runs.append(norm)
        self.grad_scaler = build_grad_scaler(opt_cfg)

    # ------------------------------------------------------------------------------ interface
    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_shards()

    def reload_model_params(self) -> None:
        """The masters live in the model's units (shared), so there is nothing to copy."""

    def _grads(self) -> List[torch.Tensor]:
        return [u.grad for u in self.units]

    def _found_inf(self, grads) -> bool:
        flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        if any(not torch.isfinite(g).all() for g in grads):
            flag.fill_(1.0)
        # Every rank must agree to skip, or the shards would diverge: MAX over the world
        # (megalite.collectives reads group None as "no peers", so name the world explicitly).
        if torch.distributed.is_initialized():
            C.all_reduce(flag, group=torch.distributed.group.WORLD, op=C.ReduceOp.MAX,
                         tag="found_inf_all_reduce")
        return bool(flag.item() > 0)

    def grad_norm(self) -> float:
        """sqrt(Σ g²) of the full model: local shard squares summed over DP, then over TP."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.units[0].grad.device)
        for u, runs in zip(self.units, self.norm_runs):
            for a, b in runs:
                sq += u.grad[a:b].pow(2).sum()
        C.all_reduce(sq, group=self.ps.dp_group, tag="grad_norm_all_reduce")
        C.all_reduce(sq, group=self.ps.mp_group, tag="grad_norm_all_reduce")
        return float(sq.sqrt().item())

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        for c in self.chunks:
            c.finalize_grads()
        grads = self._grads()
        if self.grad_scaler is not None:
            inv = 1.0 / self.grad_scaler.scale
            for g in grads:
                g.mul_(inv)
            found_inf = self._found_inf(grads)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None, None
        norm = self.grad_norm()
        check_grad_norm(self, norm)
        clip = self.cfg.clip_grad
        if clip > 0:
            coef = clip / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        self.step_count += 1
        self._adamw(grads)
        for u in self.units:
            if u.shard is not u.main:
                u.shard.copy_(u.main)  # round the fp32 masters into the 16-bit gather source
        return True, norm, None

    def _adamw(self, grads: List[torch.Tensor]) -> None:
        """torch.optim.AdamW's update (decoupled decay first), on whole shards; decay and lr per
        run, since a shard straddles parameters of both groups."""
        b1, b2, eps = self.cfg.adam_beta1, self.cfg.adam_beta2, self.cfg.adam_eps
        t = self.step_count
        bc1 = 1.0 - b1 ** t
        bc2_sqrt = math.sqrt(1.0 - b2 ** t)
        groups = self.param_groups
        same_lr = groups[DECAY]["lr"] == groups[NO_DECAY]["lr"]
        for u, g, m, v, runs in zip(self.units, grads, self.exp_avg, self.exp_avg_sq,
                                    self.runs):
            p = u.main
            for a, b, gi in runs:
                lr, wd = groups[gi]["lr"], groups[gi]["weight_decay"]
                if wd != 0.0:
                    p[a:b].mul_(1.0 - lr * wd)
            m.lerp_(g, 1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
            if same_lr:
                p.addcdiv_(m, denom, value=-groups[DECAY]["lr"] / bc1)
            else:
                for a, b, gi in runs:
                    p[a:b].addcdiv_(m[a:b], denom[a:b], value=-groups[gi]["lr"] / bc1)

    # ---------------------------------------------------------------------- per-rank checkpoint
    def state_dict(self) -> dict:
        units = {}
        for u, m, v in zip(self.units, self.exp_avg, self.exp_avg_sq):
            # names and shapes make the file self-describing: merging the shards of every DP
            # rank by parameter name needs no model (pretrain at another DP size, convert.py).
            units[u.name] = {"numel": u.numel, "names": list(u.names),
                             "shapes": [list(s) for s in u.shapes],
                             "main": u.main, "exp_avg": m, "exp_avg_sq": v}
        return {
            "format": _SHARD_FORMAT,
            "dp_size": self.units[0].dp_size if self.units else 1,
            "dp_rank": self.units[0].dp_rank if self.units else 0,
            "step": self.step_count,
            "param_groups": [{"lr": g["lr"], "weight_decay": g["weight_decay"]}
                             for g in self.param_groups],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "units": units,
        }

    def shard_fits(self, sd: dict) -> bool:
        """True if ``sd`` is this very rank's shard: same format, DP size and rank, and the same
        units holding the same parameters (else checkpointing merges every rank's file)."""
        if sd.get("format") != _SHARD_FORMAT or not self.units:
            return False
        u0 = self.units[0]
        if (sd.get("dp_size"), sd.get("dp_rank")) != (u0.dp_size, u0.dp_rank):
            return False
        saved = sd.get("units", {})
        return (list(saved) == [u.name for u in self.units]
                and all(saved[u.name].get("names", u.names) == u.names
                        and saved[u.name]["numel"] == u.numel for u in self.units))

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """This rank's own shard (fast path, no copy of anything else), or a consolidated state
        (:meth:`gather_full_state`, :func:`merge_shard_state_dicts`) from any DP size."""
        if sd.get("format") == _FULL_FORMAT:
            self.load_full_state(sd)
            return
        if sd.get("format") != _SHARD_FORMAT:
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
            if u.shard is not u.main:
                u.shard.copy_(u.main)
        self._load_common(sd)

    @staticmethod
    def merge_shard_state_dicts(sds: List[dict]) -> dict:
        """The checkpoint loader's seam (megalite/checkpointing.py): see the module function."""
        return merge_shard_state_dicts(sds)

    def _load_common(self, sd: dict) -> None:
        self.step_count = int(sd["step"])
        for g, s in zip(self.param_groups, sd["param_groups"]):
            g["lr"] = s["lr"]  # weight decay stays this run's flag
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])

    # ------------------------------------------------------------------- consolidated full state
    @torch.no_grad()
    def gather_full_state(self) -> dict:
        """Model weights and optimizer states of the whole model (this TP rank's shapes) by
        megalite parameter name. Collective over DP; every DP rank gets the same dict."""
        model, master, exp_avg, exp_avg_sq = {}, {}, {}, {}
        zm = self.model
        for u, m, v in zip(self.units, self.exp_avg, self.exp_avg_sq):
            master.update(zm.split_flat(u, zm.gather_flat(u, u.main)))
            exp_avg.update(zm.split_flat(u, zm.gather_flat(u, m)))
            exp_avg_sq.update(zm.split_flat(u, zm.gather_flat(u, v)))
        model = {k: t.to(zm.compute_dtype) for k, t in master.items()}
        return {
            "format": _FULL_FORMAT,
            "model": model,
            "optimizer": {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
            "step": self.step_count,
            "param_groups": [{"lr": g["lr"], "weight_decay": g["weight_decay"]}
                             for g in self.param_groups],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
        }

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
            if u.shard is not u.main:
                u.shard.copy_(u.main)
        self._load_common(full)

    def model_state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        """For megalite.memory: fp32 masters and Adam moments (the 16-bit shards and the fp32
        gradient shards are the model's: ``unit.shard``, ``unit.grad``)."""
        return {"master_params": [u.main for u in self.units],
                "optimizer_states": list(self.exp_avg) + list(self.exp_avg_sq)}

    def state_bytes(self) -> Dict[str, int]:
        """Bytes of the optimizer-owned tensors (the Adam moments) on this rank."""
        return {"exp_avg": sum(t.numel() * t.element_size() for t in self.exp_avg),
                "exp_avg_sq": sum(t.numel() * t.element_size() for t in self.exp_avg_sq)}


def _check_shard_set(sds: List[dict]) -> int:
    if not sds:
        raise ValueError("no ZeRO-3 optimizer shards to merge")
    if any(sd.get("format") != _SHARD_FORMAT for sd in sds):
        bad = next(sd.get("format") for sd in sds if sd.get("format") != _SHARD_FORMAT)
        raise ValueError(f"not a ZeRO-3 per-rank optimizer state (format {bad!r})")
    n = int(sds[0]["dp_size"])
    ranks = sorted(int(sd["dp_rank"]) for sd in sds)
    if ranks != list(range(n)) or any(int(sd["dp_size"]) != n for sd in sds):
        raise ValueError(f"ZeRO-3 optimizer shards of DP ranks {ranks} do not make up one DP "
                         f"group of {n} (missing or mixed files?)")
    if any("names" not in u for u in sds[0]["units"].values()):
        raise ValueError("ZeRO-3 optimizer shards carry no parameter names (saved by an older "
                         "megalite); resume at the DP size that saved them")
    return n


def merge_shard_unit(sds: List[dict], unit: str, kinds=("main", "exp_avg", "exp_avg_sq")
                     ) -> Dict[str, Dict[str, torch.Tensor]]:
    """One unit of every DP rank's shard file, concatenated in rank order (the flat layout is
    rank r's elements [r*S, (r+1)*S)), unpadded and split by parameter name:
    ``{kind: {name: tensor}}``. Streaming-friendly: touches one unit of each file."""
    by_rank = sorted(sds, key=lambda sd: int(sd["dp_rank"]))
    meta = by_rank[0]["units"][unit]
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for kind in kinds:
        flat = torch.cat([sd["units"][unit][kind].reshape(-1) for sd in by_rank])
        if flat.numel() < meta["numel"]:
            raise ValueError(f"ZeRO-3 unit {unit}: the shards hold {flat.numel()} elements, "
                             f"fewer than its {meta['numel']} parameters (truncated file?)")
        out[kind], off = {}, 0
        for name, shape in zip(meta["names"], meta["shapes"]):
            n = math.prod(shape)
            out[kind][name] = flat[off:off + n].view(shape).clone()
            off += n
    return out


def merge_shard_state_dicts(sds: List[dict]) -> dict:
    """Every DP rank's ``Zero3Optimizer.state_dict()`` (one TP/PP rank) merged into the
    consolidated form :meth:`Zero3Optimizer.load_full_state` re-splits at any DP size: this is
    how a stage-3 checkpoint resumes at another DP size."""
    _check_shard_set(sds)
    first = min(sds, key=lambda sd: int(sd["dp_rank"]))
    master, exp_avg, exp_avg_sq = {}, {}, {}
    for unit in first["units"]:
        got = merge_shard_unit(sds, unit)
        master.update(got["main"])
        exp_avg.update(got["exp_avg"])
        exp_avg_sq.update(got["exp_avg_sq"])
    return {"format": _FULL_FORMAT, "model": {}, "step": first["step"],
            "optimizer": {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
            "param_groups": first["param_groups"], "grad_scaler": first.get("grad_scaler")}
