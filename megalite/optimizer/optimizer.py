"""AdamW with fp32 master weights for 16-bit models, loss scaling and global-norm clipping.

The interface every megalite optimizer keeps (the ZeRO ``DistributedOptimizer`` matches it, and
``training.py`` uses nothing else):

    opt = build_optimizer(model_chunks, opt_cfg, ps)
    opt.zero_grad()
    loss = opt.scale_loss(loss)                         # x loss scale (fp16), else identity
    updated, grad_norm, num_zeros_or_None = opt.step()  # unscale, overflow check, clip, step
    opt.get_loss_scale(); opt.param_groups              # the LR scheduler writes group["lr"]
    opt.state_dict(); opt.load_state_dict(sd)           # tensors and primitives only
    opt.reload_model_params()                           # masters <- model after loading weights
    opt.sharded_state_dict_per_dp_rank                  # True: checkpointing saves one optimizer
                                                        # file per DP rank (docs/checkpoints.md)

Mixed precision follows Megatron's Float16OptimizerWithFloat16Params idea: the model holds bf16 or
fp16 parameters (so forward/backward run in 16 bits); the optimizer holds an fp32 master copy of
each and fp32 Adam moments (docs/theory.md, ZeRO: 2Ψ + 2Ψ + 12Ψ bytes). Each step copies the 16-bit
grads to the masters, updates the masters and copies them back, rounded, into the model.
In fp32 the masters *are* the model parameters.

Weight decay is decoupled (AdamW, Loshchilov & Hutter) and applied only to matrices: biases and
norm weights (1-D parameters) are in a second group with weight decay 0, as in Megatron and GPT-2.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megalite.optimizer.clip_grads import clip_grads_by_norm, counts_for_norm, global_grad_norm
from megalite.optimizer.grad_scaler import build_grad_scaler, check_grad_norm, found_inf_anywhere

# The per-parameter optimizer state every format can be merged into (by parameter name).
ADAM_KINDS = ("param", "exp_avg", "exp_avg_sq")


def _grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def model_parameters(model_chunks) -> List[torch.nn.Parameter]:
    """Trainable parameters of all chunks, each once, in a deterministic order."""
    seen, out = set(), []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def unscale_and_check_overflow(grad_scaler, grads: List[torch.Tensor], device) -> bool:
    """Divide the gradients by the loss scale and report (and record in the scaler) whether any
    rank saw an inf/NaN, in which case every rank skips the step. False without a scaler."""
    if grad_scaler is None:
        return False
    if grads:
        torch._foreach_mul_(grads, 1.0 / grad_scaler.scale)
    # Every rank must agree (the world), or some would step and some would skip.
    found_inf = found_inf_anywhere(grads, device)
    grad_scaler.update(found_inf)
    return found_inf


class _LossScaling:
    grad_scaler = None

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss


class MixedPrecisionOptimizer(_LossScaling):
    """fp32/bf16/fp16 AdamW over this rank's (TP/PP-sharded, DP-replicated) parameters."""

    sharded_state_dict_per_dp_rank = False

    def __init__(self, model_chunks, opt_cfg, ps):
        self.ps = ps
        self.cfg = opt_cfg
        self.model_params = model_parameters(model_chunks)
        self.mixed = any(p.dtype in (torch.float16, torch.bfloat16) for p in self.model_params)
        self.masters: List[torch.Tensor] = []
        for p in self.model_params:
            if p.dtype == torch.float32:
                self.masters.append(p)
            else:
                m = torch.nn.Parameter(p.detach().clone().float())
                self.masters.append(m)
        decay = [m for p, m in zip(self.model_params, self.masters) if p.dim() > 1]
        no_decay = [m for p, m in zip(self.model_params, self.masters) if p.dim() <= 1]
        groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        device = self.masters[0].device if self.masters else torch.device("cpu")
        if opt_cfg.optimizer == "sgd":
            self.inner = torch.optim.SGD(groups, lr=opt_cfg.lr, momentum=opt_cfg.adam_beta1)
        else:
            # fused kernels on GPU; on CPU the default (per-tensor) path, which is deterministic.
            kwargs = {"fused": True} if device.type == "cuda" else {}
            self.inner = torch.optim.AdamW(groups, lr=opt_cfg.lr,
                                           betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
                                           eps=opt_cfg.adam_eps,
                                           weight_decay=opt_cfg.weight_decay, **kwargs)
        self.grad_scaler = build_grad_scaler(opt_cfg)

    # --------------------------------------------------------------------------------- interface
    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
        if self.mixed:
            for m in self.masters:
                m.grad = None

    def _master_grads(self) -> List[Optional[torch.Tensor]]:
        grads = []
        for p, m in zip(self.model_params, self.masters):
            g = _grad_of(p)
            if m is p:
                if g is not None and p.grad is None:
                    p.grad = g  # main_grad (fp32) owned by a DP wrapper
                grads.append(p.grad)
            else:
                m.grad = g.float() if g is not None else None
                grads.append(m.grad)
        return grads

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        grads = self._master_grads()
        present = [g for g in grads if g is not None]
        if unscale_and_check_overflow(self.grad_scaler, present, self.ps.device):
            self.zero_grad()
            return False, None, None
        ps = self.ps
        counted = [g for p, g in zip(self.model_params, grads) if g is not None
                   and counts_for_norm(p, ps.tp_rank, ps.is_pipeline_first_stage)]
        grad_norm = global_grad_norm(counted, ps)
        check_grad_norm(self, grad_norm)
        if self.cfg.clip_grad > 0:
            clip_grads_by_norm(present, grad_norm, self.cfg.clip_grad)
        self.inner.step()
        if self.mixed:
            for p, m in zip(self.model_params, self.masters):
                if m is not p:
                    p.data.copy_(m.data)
        return True, grad_norm, None

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model (after loading weights into the model)."""
        for p, m in zip(self.model_params, self.masters):
            if m is not p:
                m.data.copy_(p.data.float())

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        sd = {"optimizer": self.inner.state_dict(),
              "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None}
        if self.mixed:
            sd["fp32_master_params"] = [m.detach().clone() for m in self.masters]
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        # torch restores the saved hyperparameters with the state; this run's flags win (betas,
        # eps, weight decay; the LR schedule sets lr), as the ZeRO optimizers read them from cfg.
        flags = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        self.inner.load_state_dict(sd["optimizer"])
        for group, hyper in zip(self.inner.param_groups, flags):
            group.update(hyper)
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])
        if self.mixed:
            saved = sd.get("fp32_master_params")
            if saved is None:  # saved by an fp32 run: the model weights are the masters
                self.reload_model_params()
            else:
                if len(saved) != len(self.masters):
                    raise ValueError("optimizer state does not match the model's parameters")
                for m, s in zip(self.masters, saved):
                    m.data.copy_(s)


# ============================================================ what the ZeRO optimizers share
class ShardedAdamW(_LossScaling):
    """AdamW on flat fp32 shards: the step of both ZeRO optimizers (distrib_optimizer.py, stages
    0-2 over DDP's buckets; zero3_optimizer.py, stage 3 over the model's units).

    A subclass fills ``masters``, ``exp_avg``, ``exp_avg_sq`` (flat fp32 tensors, one per shard),
    ``runs`` (per shard, ``[(lo, hi, group)]``: the part of the shard holding one parameter, and
    its param group — a shard straddles parameters, so weight decay and lr apply per run) and
    ``norm_runs`` (the runs this rank counts in the global gradient norm, clip_grads.
    counts_for_norm), and implements ``_grads``, ``_finish_grads``, ``_publish`` and
    ``zero_grad``.
    """

    sharded_state_dict_per_dp_rank = True
    dp_sharded = True  # the DP ranks hold disjoint shards (False: ZeRO stage 0, replicas)

    def _init_shared(self, cfg, ps) -> None:
        self.cfg, self.ps = cfg, ps
        self.step_count = 0
        self.grad_scaler = build_grad_scaler(cfg)
        # Matrices decay, biases and norm weights do not (as the plain optimizer); the LR
        # scheduler writes group["lr"].
        self.param_groups = [{"name": "decay", "lr": cfg.lr, "weight_decay": cfg.weight_decay},
                             {"name": "no_decay", "lr": cfg.lr, "weight_decay": 0.0}]

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        self._finish_grads()
        grads = self._grads()
        if unscale_and_check_overflow(self.grad_scaler, grads, self.ps.device):
            self.zero_grad()
            return False, None, None
        grad_norm = global_grad_norm([g[a:b] for g, runs in zip(grads, self.norm_runs)
                                      for a, b in runs], self.ps, self.dp_sharded)
        check_grad_norm(self, grad_norm)
        clip_grads_by_norm(grads, grad_norm, self.cfg.clip_grad)
        self.step_count += 1
        self._adamw(grads)
        self._publish()
        return True, grad_norm, None

    def _adamw(self, grads: List[torch.Tensor]) -> None:
        """torch.optim.AdamW's update (decoupled decay first; the order of its foreach path, so a
        ZeRO run matches a single-process torch run), with decay and lr per run."""
        cfg, groups, t = self.cfg, self.param_groups, self.step_count
        beta1, beta2 = cfg.adam_beta1, cfg.adam_beta2
        for gi, group in enumerate(groups):
            lr, wd = group["lr"], group["weight_decay"]
            views = [p[a:b] for p, runs in zip(self.masters, self.runs) for a, b, g in runs
                     if g == gi]
            if wd != 0 and views:
                torch._foreach_mul_(views, 1 - lr * wd)
        torch._foreach_lerp_(self.exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(self.exp_avg_sq, beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, 1 - beta2)
        bias_correction1 = 1 - beta1 ** t
        denom = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denom, math.sqrt(1 - beta2 ** t))
        torch._foreach_add_(denom, cfg.adam_eps)
        lrs = {g["lr"] for g in groups}
        if len(lrs) == 1:
            torch._foreach_addcdiv_(self.masters, self.exp_avg, denom,
                                    -lrs.pop() / bias_correction1)
            return
        for p, m, d, runs in zip(self.masters, self.exp_avg, denom, self.runs):
            for a, b, gi in runs:  # padding outside the runs stays 0
                p[a:b].addcdiv_(m[a:b], d[a:b], value=-groups[gi]["lr"] / bias_correction1)

    # ------------------------------------------------------------------------------ checkpoints
    def _common_state(self) -> dict:
        return {"step": self.step_count,
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups],
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None}

    def _load_common(self, sd: dict) -> None:
        self.step_count = int(sd["step"])
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            g["lr"] = saved["lr"]  # weight decay stays this run's flag
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])

    def model_state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        """The tensors megalite/memory.py counts as masters and optimizer states."""
        return {"master_params": list(self.masters),
                "optimizer_states": list(self.exp_avg) + list(self.exp_avg_sq)}


def merge_pieces(pieces: Iterable[Tuple[str, Sequence[int], int, Dict[str, torch.Tensor]]],
                 names: Optional[Iterable[str]] = None) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every DP rank's pieces of each parameter's state, put back together: ``{name: {kind: fp32
    tensor of the parameter's shape}}``. The one merge of ZeRO shard files, used to resume at
    another DP size (checkpointing.py) and by the checkpoint converter.

    A piece ``(name, shape, start, {kind: 1-D tensor})`` holds elements ``[start, start + len)``
    of the flattened parameter; each file format lists its pieces (``zero12_pieces``,
    ``zero3_pieces``). ``names`` restricts the merge to those parameters (streaming). Raises
    ValueError if a parameter is not covered exactly (a missing rank's file).
    """
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
