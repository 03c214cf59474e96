"""Loss scaling for fp16 training (Micikevicius et al. 2018; Megatron-LM's DynamicGradScaler).

The scale and its trackers are device tensors updated with ``torch.where`` from the step's
overflow flag, which the host never reads (docs/design.md, contract 11). An update makes new
tensors rather than writing in place, so a scale handed out earlier (the loss of a step already
queued, a test's list of scales) keeps the value it had.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from megalite import collectives as C
from megalite import torch_private as P


def _flag(found_inf: Union[bool, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The overflow flag as a 0-dim device bool (a host bool from a test or a library caller)."""
    if not torch.is_tensor(found_inf):
        found_inf = torch.tensor(float(found_inf))
    return found_inf.to(device).reshape(()) > 0


class _Scaler:
    def __init__(self, scale: float, device: Optional[torch.device] = None):
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._scale = self._full(scale, torch.float32)

    def _full(self, value, dtype) -> torch.Tensor:
        return torch.full((), value, dtype=dtype, device=self.device)

    @property
    def scale(self) -> torch.Tensor:
        """S, a 0-dim float32 device tensor."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1/S as the unscale kernel takes it: float32, from the float64 quotient (as the host
        float 1.0 / S was)."""
        return torch.reciprocal(self._scale.double()).float()


class ConstantGradScaler(_Scaler):
    """A static loss scale (``--loss-scale``): fixed; overflowing steps are skipped."""

    dynamic = False

    def update(self, found_inf) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": float(self._scale)}  # read at a save only

    def load_state_dict(self, sd: dict) -> None:
        self._scale = self._full(float(sd["scale"]), torch.float32)


class DynamicGradScaler(_Scaler):
    dynamic = True

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2,
                 device: Optional[torch.device] = None):
        if not (min_scale > 0 and initial_scale >= min_scale):
            raise ValueError("need 0 < min_scale <= initial_scale")
        super().__init__(float(initial_scale), device)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = self._full(0, torch.int32)
        self._hysteresis_tracker = self._full(self.hysteresis, torch.int32)

    def update(self, found_inf) -> None:
        """One step's update from its overflow flag (> 0 on overflow): the scale backs off after
        ``hysteresis`` overflows (not necessarily consecutive, as in Megatron) and grows after
        ``growth_interval`` clean steps in a row, which also restore the hysteresis."""
        found = _flag(found_inf, self.device)
        growth = torch.where(found, 0, self._growth_tracker + 1)
        hysteresis = torch.where(found, self._hysteresis_tracker - 1, self._hysteresis_tracker)
        backoff = found & (hysteresis <= 0)
        grow = growth == self.growth_interval  # never on an overflow: growth is 0 there
        scale = torch.where(backoff, torch.clamp(self._scale * self.backoff_factor,
                                                 min=self.min_scale), self._scale)
        self._scale = torch.where(grow, scale * self.growth_factor, scale)
        self._growth_tracker = torch.where(grow, 0, growth)
        self._hysteresis_tracker = torch.where(grow, self.hysteresis, hysteresis)

    def state_dict(self) -> dict:  # read at a save only
        return {"scale": float(self._scale), "growth_tracker": int(self._growth_tracker),
                "hysteresis_tracker": int(self._hysteresis_tracker)}

    def load_state_dict(self, sd: dict) -> None:
        self._scale = self._full(float(sd["scale"]), torch.float32)
        self._growth_tracker = self._full(int(sd["growth_tracker"]), torch.int32)
        self._hysteresis_tracker = self._full(int(sd["hysteresis_tracker"]), torch.int32)


def build_grad_scaler(opt_cfg, params_dtype: torch.dtype, device: Optional[torch.device] = None):
    """None for bf16/fp32 parameters (ModelConfig.params_dtype); for fp16 a constant or dynamic
    scaler with its state on the compute ``device``."""
    if params_dtype != torch.float16:
        return None
    if opt_cfg.loss_scale is not None:
        return ConstantGradScaler(opt_cfg.loss_scale, device)
    return DynamicGradScaler(opt_cfg.initial_loss_scale, opt_cfg.min_loss_scale,
                             growth_interval=opt_cfg.loss_scale_window,
                             hysteresis=opt_cfg.hysteresis, device=device)


def found_inf_flag(grads, device: torch.device, group=None,
                   inv_scale: Union[float, torch.Tensor] = 1.0) -> torch.Tensor:
    """A float32 device tensor [1], > 0 if any gradient on any rank of ``group`` (None: the
    world) holds an inf or NaN; the gradients are unscaled by ``inv_scale`` in the same pass.
    Every rank must agree, or some would step and some would skip: a MAX all-reduce of the flag,
    on ``device`` even on a rank without gradients (NCCL takes device tensors only)."""
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    scale = inv_scale.reshape(1) if torch.is_tensor(inv_scale) else \
        torch.full((1,), inv_scale, dtype=torch.float32, device=device)
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        P.unscale_and_check_(gs, flag, scale)
    if dist.is_initialized():
        C.all_reduce(flag, group=group if group is not None else dist.group.WORLD,
                     op=C.ReduceOp.MAX, tag="found_inf_all_reduce")
    return flag
