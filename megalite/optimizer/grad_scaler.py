"""Loss scaling for fp16 training (Micikevicius et al. 2018; Megatron-LM's DynamicGradScaler idea).

fp16 has a narrow exponent range: small gradients underflow to zero. The loss is multiplied by a
scale S before backward and the gradients divided by S before the update. The dynamic scaler
starts high; when any rank sees an inf/NaN gradient the step is skipped and, after ``hysteresis``
such overflows, S is halved (never below ``min_scale``); after ``window`` clean steps in a row S is
doubled. bf16 and fp32 need no scaling (bf16 has fp32's exponent range).
"""

from __future__ import annotations

import torch


class ConstantGradScaler:
    """A static loss scale (``--loss-scale``): fixed; overflowing steps are skipped."""

    dynamic = False

    def __init__(self, scale: float):
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, sd: dict) -> None:
        self._scale = float(sd["scale"])


class DynamicGradScaler:
    dynamic = True

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2):
        if not (min_scale > 0 and initial_scale >= min_scale):
            raise ValueError("need 0 < min_scale <= initial_scale")
        self._scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            # An overflow breaks the run of clean steps; only after `hysteresis` overflows (not
            # necessarily consecutive, as in Megatron) is the scale actually reduced.
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        self._scale = float(sd["scale"])
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])


def build_grad_scaler(opt_cfg, params_dtype: torch.dtype):
    """None for bf16/fp32 parameters; a constant or dynamic scaler for fp16 ones (the model's
    dtype is the one fact of the 16-bit mode: ModelConfig.params_dtype)."""
    if params_dtype != torch.float16:
        return None
    if opt_cfg.loss_scale is not None:
        return ConstantGradScaler(opt_cfg.loss_scale)
    return DynamicGradScaler(opt_cfg.initial_loss_scale, opt_cfg.min_loss_scale,
                             growth_interval=opt_cfg.loss_scale_window,
                             hysteresis=opt_cfg.hysteresis)


def found_inf_flag(grads, device: torch.device, group=None, inv_scale: float = 1.0
                   ) -> torch.Tensor:
    """A float32 device tensor of shape [1], > 0 if any gradient on any rank of ``group`` (None:
    the world) holds an inf or NaN; the gradients are multiplied by ``inv_scale`` (unscaled) in
    the same pass.

    Every rank must agree, or some would step and some would skip: a MAX all-reduce of the flag,
    on the compute ``device`` even on a rank without gradients (NCCL takes device tensors only).
    The check is one fused kernel per dtype writing the flag, which stays on the device: the
    optimizer reads it together with the gradient norm (optimizer.py, ``_decide_step``), since a
    read per gradient, or even one of its own, would stall the host behind the device.
    """
    from megalite import collectives as C
    import torch.distributed as dist

    flag = torch.zeros(1, dtype=torch.float32, device=device)
    scale = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, scale)
    if dist.is_initialized():
        C.all_reduce(flag, group=group if group is not None else dist.group.WORLD,
                     op=C.ReduceOp.MAX, tag="found_inf_all_reduce")
    return flag


class NonFiniteStep(RuntimeError):
    """The step's loss or global gradient norm is NaN or Inf (bf16/fp32: the run has diverged);
    raised before any weight changes, on every rank alike (both values are global)."""
