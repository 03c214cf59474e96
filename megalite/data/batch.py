"""From a micro-batch of samples to the model's inputs (Megatron's get_batch)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from megalite.masks import Documents, document_ids


class Batch(NamedTuple):
    """A micro-batch's model inputs, each ``[b, s]`` on the host (docs/data.md, "get_batch")."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: Optional[torch.Tensor]  # None: 0..s-1 (--reset-position-ids: per document)
    documents: Optional[Documents]  # --reset-attention-mask: where the documents are


def get_batch(micro_batch, eod_token: int, eod_mask_loss: bool, reset_position_ids: bool = False,
              reset_attention_mask: bool = False) -> Batch:
    """The loss is masked where the *input* is EOD (``eod_mask_loss``): the prediction made from
    an EOD crosses into an unrelated document. Documents and positions come from the tokens on
    the host, so no stage and no CP rank reads the device for them."""
    data = micro_batch["tokens"] if isinstance(micro_batch, dict) else micro_batch
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    data = data.long()
    if data.dim() != 2 or data.size(1) < 2:
        raise ValueError(f"a micro-batch of tokens must be [b, seq_length + 1], got "
                         f"{tuple(data.shape)}")
    tokens = data[:, :-1].contiguous()
    labels = data[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = documents = None
    if reset_position_ids or reset_attention_mask:
        ids, positions = document_ids(tokens.numpy(), eod_token)
        if reset_position_ids:
            position_ids = torch.from_numpy(positions)
        if reset_attention_mask:
            documents = Documents.of(ids)
    return Batch(tokens, labels, loss_mask, position_ids, documents)
