"""Local token permutation for MoE (docs/moe.md): group a rank's tokens by expert so each expert
runs one dense matmul on a contiguous block, and scatter the weighted outputs back. What crosses
ranks (the all-to-all of expert parallelism) is not here; it moves these blocks as they are.
"""

from __future__ import annotations

import torch


def assignment_order(routing_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The positions in the flattened [E, T] map of its ``num_rows`` True entries, in row-major
    order (experts in order, tokens in order within each), when the host already knows how many
    there are: dropless routing has exactly k per token, capacity padding C per expert. A stable
    sort of (not chosen, position) keys, a fixed shape: no host read (a masked_select would need
    one to size its output)."""
    flat = routing_map.t().reshape(-1)
    return torch.argsort((~flat).to(torch.int8), stable=True)[:num_rows]


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, num_rows: int | None = None):
    """tokens [T, h], routing_map bool [T, E] -> (permuted [N, h], sorted_indices [N],
    tokens_per_expert [E]), N the number of (token, expert) assignments.

    Rows are grouped by expert, expert 0 first; within an expert tokens keep their order (what a
    stable sort by expert would give), so the layout is deterministic and position-based dropping
    upstream stays meaningful. ``sorted_indices[j]`` is the token that row j came from.
    ``num_rows``: N when the host knows it (``assignment_order``): the same result, no host read.
    """
    num_tokens, num_experts = routing_map.shape
    if num_rows is not None:
        sorted_indices = assignment_order(routing_map, num_rows) % num_tokens
    else:
        token_ids = torch.arange(num_tokens, device=tokens.device).expand(num_experts, num_tokens)
        # masked_select walks the [E, T] map row-major: experts in order, tokens in order within
        sorted_indices = token_ids.masked_select(routing_map.t())
    return tokens.index_select(0, sorted_indices), sorted_indices, routing_map.sum(0)


def unpermute(expert_out: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None,
              routing_map: torch.Tensor, num_rows: int | None = None):
    """Inverse of :func:`permute`: out[t] = Σ over t's rows of probs[t, e] · expert_out[row].

    ``probs`` [T, E] dense (None: unweighted sum); its weights are read through the same
    ``routing_map`` walk as the permutation, so each row meets its own gate. The result has
    ``expert_out``'s dtype.
    """
    num_tokens = routing_map.shape[0]
    rows = expert_out
    if probs is not None:
        weights = (probs.t().reshape(-1)[assignment_order(routing_map, num_rows)]
                   if num_rows is not None else probs.t().masked_select(routing_map.t()))
        rows = expert_out * weights.unsqueeze(-1)
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, sorted_indices, rows).to(expert_out.dtype)
