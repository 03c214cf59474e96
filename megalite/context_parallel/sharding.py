"""The load-balanced split of a sequence across C context-parallel ranks.

Causal attention work grows along the sequence (query i attends to i + 1 keys), so cutting the
sequence into C contiguous pieces gives the last rank ~2C-1 times the work of the first. Instead
the sequence is cut into 2C equal chunks and CP rank r keeps chunks r and 2C-1-r, one cheap and
one expensive: every rank then holds the same number of (query, key) pairs.

    C = 2, chunks 0 1 2 3:   rank 0 keeps [0, 3],  rank 1 keeps [1, 2]

The local sequence is the two chunks concatenated in that order; ``positions`` gives the global
position of each local token (for RoPE and learned absolute positions).
"""

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
