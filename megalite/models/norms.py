"""LayerNorm and RMSNorm, marked for sequence parallelism.

Under SP a norm runs on this rank's sequence shard, so its weight gradient is a partial sum over
the shard: ``finalize_model_grads`` all-reduces every parameter flagged ``sequence_parallel`` over
the TP group (forgetting this is the classic SP bug; tests/test_tensor_parallel.py checks it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        self.weight.init_method = ("ones",)
        self.bias.init_method = ("zeros",)
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (Zhang & Sennrich 2019; Llama)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, sequence_parallel: bool = False,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        self.weight.init_method = ("ones",)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm") and x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def build_norm(config, sequence_parallel: bool, params_dtype, device=None) -> nn.Module:
    cls = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    return cls(config.hidden_size, eps=config.norm_epsilon, sequence_parallel=sequence_parallel,
               params_dtype=params_dtype, device=device)
