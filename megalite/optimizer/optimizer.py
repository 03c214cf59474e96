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

from typing import List, Optional, Tuple

import torch

from megalite.optimizer.clip_grads import clip_grads_by_norm, global_grad_norm
from megalite.optimizer.grad_scaler import build_grad_scaler, check_grad_norm, found_inf_anywhere


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


class MixedPrecisionOptimizer:
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

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

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
        if self.grad_scaler is not None:
            if present:
                torch._foreach_mul_(present, 1.0 / self.grad_scaler.scale)
            # Overflow must be agreed by every rank (the world), or ranks would diverge.
            found_inf = found_inf_anywhere(present, self.ps.device)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None, None
        grad_norm = global_grad_norm(self.model_params, grads, self.ps)
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
