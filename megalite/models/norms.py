"""LayerNorm and RMSNorm, in the compute dtype (statistics in fp32 inside the kernel,
docs/performance.md), or apex's fused kernels with ``--use-apex`` on CUDA (imported only then).
Under SP a norm sees only this rank's tokens: its weight is marked ``grad_partial_over_tp`` and
summed over TP after backward (``finalize_model_grads``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite import collectives as C
from megalite.config import ConfigError
from megalite.param_meta import set_param_meta
from megalite.tensor_parallel.mappings import sum_over_tensor_model_parallel_region


def _apex_norm_functions(device):
    if torch.device(device if device is not None else "cpu").type != "cuda":
        raise ConfigError("--use-apex needs a CUDA device (--device cuda): apex's norms are "
                          "CUDA kernels")
    try:
        import fused_layer_norm_cuda  # noqa: F401  (apex's CUDA extension, not a Python stub)
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine as ln
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine as rms
    except ImportError as e:
        raise ConfigError(f"--use-apex: NVIDIA apex with its CUDA extensions is not importable "
                          f"({e}); build apex with --cuda_ext or drop the flag") from e
    return ln, rms


class _Norm(nn.Module):
    has_bias, default_eps = False, 1e-6

    def __init__(self, hidden_size: int, eps: Optional[float] = None,
                 grad_partial_over_tp: bool = False, params_dtype=torch.float32, device=None,
                 use_apex: bool = False, one_plus: bool = False):
        super().__init__()
        self.eps, self.shape = self.default_eps if eps is None else eps, (hidden_size,)
        self.one_plus = one_plus  # --apply-layernorm-1p: the scale is 1 + weight
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        set_param_meta(self.weight, init_method=("zeros",) if one_plus else ("ones",),
                       grad_partial_over_tp=grad_partial_over_tp)
        self.bias = None
        if self.has_bias:
            self.bias = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
            set_param_meta(self.bias, init_method=("zeros",),
                           grad_partial_over_tp=grad_partial_over_tp)
        self.apex = _apex_norm_functions(device) if use_apex else None

    def scale(self) -> torch.Tensor:
        return self.weight + 1 if self.one_plus else self.weight


class LayerNorm(_Norm):
    has_bias, default_eps = True, 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.apex is not None:
            return self.apex[0](x, self.scale(), self.bias, self.shape, self.eps)
        return F.layer_norm(x, self.shape, self.scale(), self.bias, self.eps)


class RMSNorm(_Norm):
    """y = w * x / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019; Llama), statistics in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_plus:  # 1 + w in fp32: 16 bits would round a small w away (HF does the same)
            return F.rms_norm(x.float(), self.shape, self.weight.float() + 1, self.eps).to(x.dtype)
        if self.apex is not None:
            return self.apex[1](x, self.scale(), self.shape, self.eps)
        return F.rms_norm(x, self.shape, self.scale(), self.eps)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a token's whole q (or k) projection, every head at once (OLMoE's q/k norm),
    the weight split over TP with the heads and the statistic summed over TP (docs/models.md,
    "OLMoE's q/k norm"). Input [..., groups, heads, d] of this rank; statistics in fp32."""

    def __init__(self, size: int, eps: float, tp_group=None, params_dtype=torch.float32,
                 device=None):
        super().__init__()
        tp = C.group_size(tp_group)
        self.size, self.eps, self.tp_group = size, eps, tp_group  # size: all ranks' values
        self.weight = nn.Parameter(torch.empty(size // tp, dtype=params_dtype, device=device))
        # split at any TP (as the linears): the converter reads the split off a tp=1 model
        set_param_meta(self.weight, init_method=("ones",), tp_split=True, partition_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-3).float()
        squares = sum_over_tensor_model_parallel_region(
            flat.square().sum(-1, keepdim=True), self.tp_group)
        y = flat * torch.rsqrt(squares / self.size + self.eps)
        return (self.weight * y.to(x.dtype)).view_as(x)


def build_norm(config, sequence_parallel: bool, params_dtype, device=None,
               use_apex: bool = False) -> nn.Module:
    cls = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    return cls(config.hidden_size, eps=config.norm_epsilon, grad_partial_over_tp=sequence_parallel,
               params_dtype=params_dtype, device=device, use_apex=use_apex,
               one_plus=config.apply_layernorm_1p)
