"""The load-balanced split of a sequence across C context-parallel ranks: of 2C equal chunks,
rank r keeps r and 2C-1-r, in that order (docs/context_parallel.md, "The load-balanced chunk
assignment")."""

from __future__ import annotations

import torch


def chunk_ids(cp_rank: int, cp_size: int) -> tuple:
    """The two global chunk indices (of 2C) that CP rank ``cp_rank`` keeps, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def chunk_owner(chunk: int, cp_size: int) -> tuple:
    """(CP rank, 0 or 1: first or second of its chunks) that keeps global chunk ``chunk``."""
    return (chunk, 0) if chunk < cp_size else (2 * cp_size - 1 - chunk, 1)


def positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions [s/C] of the tokens CP rank ``cp_rank`` keeps, in local order."""
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in chunk_ids(cp_rank, cp_size)])


def shard(t: torch.Tensor, cp_rank: int, cp_size: int, dim: int) -> torch.Tensor:
    """The part of ``t`` (whole sequence along ``dim``) that CP rank ``cp_rank`` keeps."""
    if cp_size == 1:
        return t
    chunks = t.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp_rank, cp_size)], dim=dim)
