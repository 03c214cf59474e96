"""Full (unsharded) state dict <-> one rank's tensor-parallel slices, vocab tensors re-padded for
the TP size (docs/checkpoints.md, "How: one canonical form, by parameter name")."""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
import torch.nn as nn

from megalite.models.init import full_shape
from megalite.param_meta import param_meta
from megalite.tensor_parallel.utils import shard_tensor

EMBEDDING_WEIGHT_NAME = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT_NAME = "output_layer.weight"
VOCAB_PARAMETER_NAMES = (EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME)


def pad_vocab(tensor: torch.Tensor, vocab_size: int, padded_rows: int) -> torch.Tensor:
    """Keep the first ``vocab_size`` rows and append zero rows up to ``padded_rows`` (padded ids
    are never produced and are masked out of the loss)."""
    if tensor.shape[0] < vocab_size:
        raise ValueError(f"vocab tensor has {tensor.shape[0]} rows, fewer than the vocab size "
                         f"{vocab_size}")
    real = tensor[:vocab_size]
    if padded_rows == vocab_size:
        return real
    pad = real.new_zeros((padded_rows - vocab_size,) + tuple(real.shape[1:]))
    return torch.cat([real, pad], dim=0)


@torch.no_grad()
def load_full_state_dict_into(model: nn.Module, full_sd: Mapping[str, torch.Tensor],
                              tp_rank: Optional[int] = None, tp_size: Optional[int] = None) -> None:
    """Copy this rank's slice of every parameter a GPTModel (any TP size, any stage) owns, and its
    persistent buffers, from a full state dict; a tied output layer is filled from the word
    embedding. ``tp_rank`` / ``tp_size`` default to the model's own parallel state."""
    cfg = model.config
    ps = getattr(model, "parallel_state", None)
    tp_rank = tp_rank if tp_rank is not None else (ps.tp_rank if ps is not None else 0)
    tp_size = tp_size if tp_size is not None else (ps.tp_size if ps is not None else 1)
    missing = []
    for name, param in model.named_parameters():
        src = full_sd.get(name)
        if src is None and name == OUTPUT_WEIGHT_NAME and cfg.tie_embeddings:
            src = full_sd.get(EMBEDDING_WEIGHT_NAME)
        if src is None:
            missing.append(name)
            continue
        shape = full_shape(param, tp_size)
        if name in VOCAB_PARAMETER_NAMES:
            src = pad_vocab(src, cfg.vocab_size, shape[0])
        if list(src.shape) != shape:
            raise ValueError(f"full state dict tensor {name} has shape {tuple(src.shape)}, "
                             f"the model expects {tuple(shape)} before TP sharding")
        if (m := param_meta(param)).tp_split:
            src = shard_tensor(src, m.partition_dim, tp_rank, tp_size, m.partition_stride)
        param.copy_(src.to(device=param.device, dtype=param.dtype))
    # persistent buffers (the MoE expert bias): replicated, copied whole
    params = dict(model.named_parameters())
    for name, buf in model.state_dict(keep_vars=True).items():
        if name in params:
            continue
        if name not in full_sd:
            missing.append(name)
            continue
        if tuple(full_sd[name].shape) != tuple(buf.shape):
            raise ValueError(f"full state dict tensor {name} has shape "
                             f"{tuple(full_sd[name].shape)}, the model expects {tuple(buf.shape)}")
        buf.copy_(full_sd[name].to(device=buf.device, dtype=buf.dtype))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise ValueError(f"full state dict is missing {len(missing)} parameter(s) the model owns: "
                         f"{shown}")


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full state dict of a single-process model (tp=1, one pipeline stage), detached."""
    whole = tuple(getattr(model, "layer_range", (0, model.config.num_layers))) == (
        0, model.config.num_layers)
    if getattr(model, "tp_size", 1) != 1 or not whole or not (
            getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError("expected a single-process GPTModel (tensor- and pipeline-parallel size "
                         "1); gather a sharded model into a full state dict first")
    return {k: v.detach() for k, v in model.state_dict().items()}
