"""From a micro-batch of samples to the model's inputs (Megatron's get_batch)."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch


def get_batch(micro_batch, eod_token: int, eod_mask_loss: bool,
              device: Optional[torch.device] = None
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, loss_mask, position_ids), each ``[b, s]`` (docs/data.md). The loss is
    masked where the *input* is EOD: the prediction made from an EOD crosses into an unrelated
    document. Positions do not reset at document boundaries."""
    data = micro_batch["tokens"] if isinstance(micro_batch, dict) else micro_batch
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    data = data.long()
    if device is not None:
        data = data.to(device)
    if data.dim() != 2 or data.size(1) < 2:
        raise ValueError(f"a micro-batch of tokens must be [b, seq_length + 1], got "
                         f"{tuple(data.shape)}")
    tokens = data[:, :-1].contiguous()
    labels = data[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    return tokens, labels, loss_mask, position_ids.contiguous()
