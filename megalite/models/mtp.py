"""DeepSeek-V3's multi-token prediction (docs/models.md, "Multi-token prediction"): D depths on
the head's stage, run by GPTModel with its own embedding and loss head; their targets shifted
while the sequence is whole (``mtp_targets``), so each context-parallel rank holds its own."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megalite.config import ExecutionConfig, ModelConfig, dtype_from_name
from megalite.masks import Documents
from megalite.models.norms import build_norm
from megalite.models.transformer import TransformerLayer
from megalite.moe.layer import MoEGroups
from megalite.param_meta import set_param_meta


def mtp_targets(labels: torch.Tensor, loss_mask: torch.Tensor, depths: int):
    """Depth k's labels and loss mask ([b, s, D] each, column k - 1): those of the main loss k
    positions further, 0 past the sequence's end (the shifted mask drops those tokens)."""
    b, s = labels.shape
    out_labels, out_mask = labels.new_zeros(b, s, depths), loss_mask.new_zeros(b, s, depths)
    for k in range(1, min(depths, s) + 1):
        out_labels[:, : s - k, k - 1] = labels[:, k:]
        out_mask[:, : s - k, k - 1] = loss_mask[:, k:]
    return out_labels, out_mask


class MTPLayer(nn.Module):
    """h_k = layer(eh_proj([enorm(embedding), hnorm(h_{k-1})])) and final_layernorm(h_k), from
    one call (a ZeRO-3 unit is gathered around a module's call)."""

    def __init__(self, config: ModelConfig, layer_number: int, ps, device,
                 sequence_parallel: bool, execution: ExecutionConfig):
        super().__init__()
        dtype = dtype_from_name(config.params_dtype)
        self.enorm, self.hnorm, self.final_layernorm = (build_norm(
            config, sequence_parallel, dtype, device, execution.use_apex) for _ in range(3))
        h = config.hidden_size
        # Replicated over TP (2h^2 per token, small beside the layer): every rank projects the
        # tokens it holds, so under SP its gradient is partial over TP, as a norm's
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        set_param_meta(self.eh_proj.weight, init_method=("normal", config.init_method_std),
                       grad_partial_over_tp=sequence_parallel)
        self.transformer_layer = TransformerLayer(config, layer_number, ps.tp_group, device,
                                                  sequence_parallel, ps.cp_group,
                                                  ps.cp_comm_type, MoEGroups.of(ps), execution)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None, documents: Optional[Documents] = None):
        """(h_k, final_layernorm(h_k)) from h_{k-1} and the embedded tokens, [s(/t), b, h]."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x = self.transformer_layer(x, position_ids, documents)
        return x, self.final_layernorm(x)


class MultiTokenPrediction(nn.Module):
    """``layers[k]``, k = 0..D-1: depth k + 1, its transformer layer numbered L + k (of the
    last layer's kind: ModelConfig.is_moe_layer)."""

    def __init__(self, config: ModelConfig, ps, device, sequence_parallel: bool,
                 execution: ExecutionConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            MTPLayer(config, config.num_layers + k, ps, device, sequence_parallel, execution)
            for k in range(config.mtp_num_layers))
