"""Multi-latent attention's q, k and v (MLA; DeepSeek-V2, arXiv:2405.04434 §2.1, and V3): the
formulas, tensor-parallel layout, parameter counts and FLOPs are docs/models.md's "Multi-latent
attention"; the attention core, recomputation and output projection are ``SelfAttention``'s.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite import collectives as C
from megalite.config import ModelConfig, dtype_from_name
from megalite.models.norms import RMSNorm
from megalite.models.rotary import apply_rotary, yarn_mscale
from megalite.param_meta import set_param_meta
from megalite.tensor_parallel.layers import ColumnParallelLinear
from megalite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megalite.tensor_parallel.utils import divide


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_head_dim + qk_pos_emb_head_dim), times YaRN's temperature squared with
    --rope-type yarn (DeepSeek's mscale_all_dim: HF's ``yarn_apply_mscale``, Megatron's MLA)."""
    scale = (config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5
    if config.rope_type == "yarn":
        scale *= yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2
    return scale


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every TP rank (the down projections). Under SP each rank
    applies it to its own tokens, so its gradient is partial over TP."""

    def __init__(self, input_size: int, output_size: int, sequence_parallel: bool,
                 init_std: float, params_dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype,
                                               device=device))
        set_param_meta(self.weight, init_method=("normal", init_std),
                       grad_partial_over_tp=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MultiLatentQKV(nn.Module):
    """x [s(/t), b, h] -> q, k [s, b, n/t, qk_head_dim + qk_pos_emb_head_dim] and v [s, b, n/t,
    v_head_dim] for this TP rank's heads; names as megatron-core's MLA."""

    def __init__(self, config: ModelConfig, tp_group=None, device=None,
                 sequence_parallel: bool = False, use_apex: bool = False):
        super().__init__()
        c, h, sp = config, config.hidden_size, sequence_parallel
        dtype, std = dtype_from_name(c.params_dtype), c.init_method_std
        self.tp_group, self.sequence_parallel = tp_group, sp
        self.heads = divide(c.num_attention_heads, C.group_size(tp_group), "--num-attention-heads")
        self.dims = (c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, c.kv_lora_rank)
        n, (dn, dr, dv, rkv) = c.num_attention_heads, self.dims

        def column(rows_in: int, out: int) -> ColumnParallelLinear:  # heads split over TP
            return ColumnParallelLinear(rows_in, out, bias=False, tp_group=tp_group,
                                        sequence_parallel=sp, init_std=std, params_dtype=dtype,
                                        device=device)

        def norm(width: int) -> RMSNorm:
            return RMSNorm(width, c.norm_epsilon, grad_partial_over_tp=sp, params_dtype=dtype,
                           device=device, use_apex=use_apex)

        self.linear_q_proj = self.linear_q_down_proj = self.q_layernorm = None
        if c.q_lora_rank is None:
            self.linear_q_proj = column(h, n * (dn + dr))
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, c.q_lora_rank, sp, std, dtype, device)
            self.q_layernorm = norm(c.q_lora_rank)
            self.linear_q_up_proj = column(c.q_lora_rank, n * (dn + dr))
        self.linear_kv_down_proj = ReplicatedLinear(h, rkv + dr, sp, std, dtype, device)
        self.kv_layernorm = norm(rkv)
        self.linear_kv_up_proj = column(rkv, n * (dn + dv))

    def forward(self, x: torch.Tensor, rope):
        """``rope(s, device, dtype)``: the cos, sin_signed tables [s, 1, 1, d_rope] of this
        rank's positions (SelfAttention's, context-parallel aware)."""
        dn, dr, dv, rkv = self.dims
        if self.linear_q_proj is not None:
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        s, b = q.shape[0], q.shape[1]  # the whole sequence (SP: gathered by the up projection)
        q_nope, q_pe = q.view(s, b, self.heads, dn + dr).split([dn, dr], dim=-1)
        latent, k_pe = self.linear_kv_down_proj(x).split([rkv, dr], dim=-1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent)).view(s, b, self.heads, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        # k_pe reaches this rank's heads without an up projection: its own f (or SP's g), so
        # that its gradient is summed over the TP ranks' heads
        if self.sequence_parallel:
            k_pe = gather_from_sequence_parallel_region(k_pe, self.tp_group)
        else:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        cos, sin = rope(s, x.device, x.dtype)
        q = torch.cat([q_nope, apply_rotary(q_pe, cos, sin)], dim=-1)
        k_pe = apply_rotary(k_pe.unsqueeze(2), cos, sin)  # [s, b, 1, d_rope]: one shared head
        k = torch.cat([k_nope, k_pe.expand(s, b, self.heads, dr)], dim=-1)
        return q, k, v
