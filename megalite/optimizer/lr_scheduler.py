"""Learning-rate schedule: linear warmup, then constant/linear/cosine/WSD/inverse-sqrt decay.

The schedule is a pure function of the iteration (``get_lr(step)``), so resuming from a checkpoint
only needs the step count. Iteration k (0-based) trains with ``get_lr(k)``:

  warmup  (k < W):          lr = max_lr * (k + 1) / W          (never 0: the first step moves)
  decay   (W <= k < D):     r = (k - W) / (D - W)
      constant              max_lr
      linear                min_lr + (max_lr - min_lr) * (1 - r)
      cosine                min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi r))
      WSD                   max_lr until D - Dwsd, then decays to min_lr over the last Dwsd steps
                            (linear, cosine, exponential or 1 - sqrt; Hu et al. 2024, MiniCPM)
      inverse-square-root   max_lr * sqrt(W) / sqrt(max(k, W)), floored at min_lr
  after   (k >= D):         min_lr (constant stays at max_lr)

k counts *applied* steps (a skipped fp16 overflow does not advance the schedule), which only the
device knows, so k is a device count that indexes ``table`` = [get_lr(0), get_lr(1), ...], built
once at start-up (docs/performance.md, "A step with no host read"). The table runs to
``max_steps`` (--train-iters), as inverse-square-root keeps decaying; the other styles are
constant past its end.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

# the fraction of (max_lr - min_lr) left at r, the fraction of the decay done
_DECAY = {"linear": lambda r: 1.0 - r,
          "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
          "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0,
          "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}


class OptimizerParamScheduler:
    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_steps: int,
                 decay_steps: int, decay_style: str = "cosine",
                 wsd_decay_steps: Optional[int] = None, wsd_decay_style: str = "linear",
                 max_steps: int = 0, device: Optional[torch.device] = None):
        if decay_style not in ("constant", "linear", "cosine", "WSD", "inverse-square-root"):
            raise ValueError(f"unknown lr decay style {decay_style!r}")
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = max(int(decay_steps), self.warmup_steps)
        self.decay_style = decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.wsd_decay_style = wsd_decay_style
        self.device = torch.device("cpu") if device is None else torch.device(device)
        # the dtype the optimizer takes its lr in (a fused kernel's contract; else float64, the
        # host float's precision)
        self.lr_dtype = getattr(optimizer, "lr_dtype", torch.float64)
        n = max(self.warmup_steps, self.decay_steps, int(max_steps)) + 1
        self.table = torch.tensor([self.get_lr(k) for k in range(n)], dtype=torch.float64,
                                  device=self.device)
        self._count = torch.zeros((), dtype=torch.int64, device=self.device)
        self._apply()

    @classmethod
    def from_config(cls, optimizer, opt_cfg, train_iters: int,
                    device: Optional[torch.device] = None) -> "OptimizerParamScheduler":
        decay = opt_cfg.lr_decay_iters or train_iters
        warmup = opt_cfg.lr_warmup_iters or 0
        if opt_cfg.lr_warmup_fraction is not None:
            warmup = int(opt_cfg.lr_warmup_fraction * decay)
        return cls(optimizer, opt_cfg.lr, opt_cfg.min_lr, warmup, decay, opt_cfg.lr_decay_style,
                   opt_cfg.lr_wsd_decay_iters, opt_cfg.lr_wsd_decay_style,
                   max_steps=train_iters, device=device)

    def get_lr(self, step: int) -> float:
        W, D = self.warmup_steps, self.decay_steps
        if W > 0 and step < W:
            return self.max_lr * (step + 1) / W
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "inverse-square-root":
            w = max(W, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(w) / math.sqrt(max(step, w)))
        if step >= D:
            return self.min_lr
        delta = self.max_lr - self.min_lr
        if self.decay_style == "WSD":
            wsd = min(self.wsd_decay_steps or 0, D - W)
            start = D - wsd
            if step < start:
                return self.max_lr
            r = (step - start) / max(wsd, 1)
            return self.min_lr + _DECAY[self.wsd_decay_style](r) * delta
        r = (step - W) / max(D - W, 1)
        return self.min_lr + _DECAY[self.decay_style](r) * delta

    def _apply(self) -> None:
        """The lr of the current count, a new 0-dim device tensor, into every param group: new
        each step, so the one a queued step or a record holds keeps its value."""
        at = self._count.clamp(max=self.table.numel() - 1).reshape(1)
        # (index_select: indexing by a 0-dim tensor would read it as a Python int)
        self.lr = self.table.index_select(0, at).reshape(()).to(self.lr_dtype)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    @property
    def num_steps(self) -> int:
        """Applied steps so far (a host read: for saves and tests, not the loop)."""
        return int(self._count)

    @property
    def current_lr(self) -> float:
        return float(self.lr)  # a host read, as num_steps

    def step(self, applied: Union[bool, torch.Tensor] = True) -> torch.Tensor:
        """After a step: advance by one if it was ``applied`` (the optimizer's device flag, or a
        host bool) and set the next step's lr on the optimizer; returns it (device)."""
        self._count = self._count + applied
        self._apply()
        return self.lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps,
                "decay_style": self.decay_style, "wsd_decay_steps": self.wsd_decay_steps,
                "wsd_decay_style": self.wsd_decay_style}

    def load_state_dict(self, sd: dict) -> None:
        # The schedule's shape comes from this run's flags (so a resumed run may change it, as in
        # Megatron with --override-opt-param-scheduler); only the position is restored.
        self._count = torch.full((), int(sd["num_steps"]), dtype=torch.int64, device=self.device)
        self._apply()
