"""Layout-independent parameter initialization (docs/design.md, contract 3): each full
parameter is drawn, on its own device, from a generator seeded by (seed, its full name), and every
rank keeps its slice. Vocab-sized tensors are drawn for the real vocab and zero-padded, because
the padded size depends on the TP size.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from megalite.param_meta import param_meta
from megalite.tensor_parallel.utils import shard_tensor


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_shape(param: torch.Tensor, tp_size: int):
    shape, meta = list(param.shape), param_meta(param)
    if meta.tp_split:
        shape[meta.partition_dim] *= tp_size
    return shape


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, tp_rank: int, tp_size: int, config,
                          etp_rank: int = 0, etp_size: int = 1) -> None:
    """Expert weights (``meta.expert``) split over the expert-tensor-parallel group (ETP rank and
    size), every other split parameter over TP."""
    for name, param in model.named_parameters():
        meta = param_meta(param)
        method = meta.init_method
        if method is None:
            raise RuntimeError(f"parameter {name} has no init_method")
        kind = method[0]
        if kind in ("zeros", "ones"):
            param.fill_(1.0 if kind == "ones" else 0.0)
            continue
        shape = full_shape(param, tp_size)
        dev = param.device
        gen = torch.Generator(device=dev).manual_seed(
            _name_seed(seed, meta.init_seed_name or name))
        std = method[1]
        if kind == "normal_experts":  # [E_local, ...]: each expert from its global index
            one = full_shape(param, etp_size)[1:]  # one whole expert
            for i in range(param.shape[0]):
                g = torch.Generator(device=dev).manual_seed(
                    _name_seed(seed, f"{meta.init_seed_name or name}[{method[2] + i}]"))
                full = torch.empty(one, device=dev).normal_(0.0, std, generator=g)
                if meta.tp_split:  # dim 0 of the stack is the expert: its slice is one lower
                    full = shard_tensor(full, meta.partition_dim - 1, etp_rank, etp_size,
                                        meta.partition_stride)
                param[i].copy_(full)
            continue
        if kind == "normal_vocab":
            full = torch.zeros(shape, device=dev)
            full[: config.vocab_size].normal_(0.0, std, generator=gen)
        elif kind == "normal":
            full = torch.empty(shape, device=dev).normal_(0.0, std, generator=gen)
        elif kind == "log_uniform":  # log of U(low, high): Gated DeltaNet's A_log
            full = torch.empty(shape, device=dev).uniform_(std, method[2], generator=gen).log()
        else:
            raise RuntimeError(f"unknown init method {kind!r} for {name}")
        if meta.tp_split:
            full = shard_tensor(full, meta.partition_dim, tp_rank, tp_size, meta.partition_stride)
        param.copy_(full)
