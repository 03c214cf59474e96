"""Local token permutation for MoE (docs/moe.md, "Permutation"): a rank's tokens grouped by
expert, one contiguous block each, and the weighted outputs scattered back."""

from __future__ import annotations

import torch


def assignment_order(routing_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The positions of the flattened [E, T] map's ``num_rows`` True entries, row-major, when the
    host knows their number (dropless: k per token; padding: C per expert): a stable sort of
    (not chosen, position), a fixed shape, so no host read, which a masked_select needs."""
    flat = routing_map.t().reshape(-1)
    return torch.argsort((~flat).to(torch.int8), stable=True)[:num_rows]


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, num_rows: int | None = None):
    """tokens [T, h], routing_map bool [T, E] -> (permuted [N, h], sorted_indices [N],
    tokens_per_expert [E]): rows grouped by expert, tokens in order within each (a stable sort),
    ``sorted_indices[j]`` the token of row j. ``num_rows``: N when the host knows it."""
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
    """Inverse of :func:`permute`: out[t] = Σ over t's rows of probs[t, e] · expert_out[row]
    (``probs`` [T, E] read through the same walk, None: unweighted), in ``expert_out``'s dtype."""
    num_tokens = routing_map.shape[0]
    rows = expert_out
    if probs is not None:
        weights = (probs.t().reshape(-1)[assignment_order(routing_map, num_rows)]
                   if num_rows is not None else probs.t().masked_select(routing_map.t()))
        rows = expert_out * weights.unsqueeze(-1)
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, sorted_indices, rows).to(expert_out.dtype)
