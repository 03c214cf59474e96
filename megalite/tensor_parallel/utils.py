"""Slicing full tensors into tensor-parallel shards and back: the one definition of "rank r's
slice", used by initialization, tests, checkpoints and conversion. A stride k > 1 means the full
tensor is k blocks stacked along ``dim`` (SwiGLU's fused [gate; up]) and each rank keeps its chunk
of every block (docs/tensor_parallel.md).
"""

from __future__ import annotations

from typing import List, Sequence

import torch


def shard_tensor(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    if size == 1:
        return full
    if full.shape[dim] % (size * stride) != 0:
        raise ValueError(f"cannot split dim {dim} of size {full.shape[dim]} into {size} TP shards "
                         f"(stride {stride})")
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard_tensors(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    per_rank_blocks: List[Sequence[torch.Tensor]] = [s.chunk(stride, dim=dim) for s in shards]
    blocks = [torch.cat([blocks[i] for blocks in per_rank_blocks], dim=dim) for i in range(stride)]
    return torch.cat(blocks, dim=dim).contiguous()


def divide(numerator: int, denominator: int, what: str = "") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what or numerator} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator
