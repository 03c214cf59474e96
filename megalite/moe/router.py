"""MoE routing as pure functions (docs/moe.md, "Routing"): no process groups (a caller sums
``tokens_per_expert`` over its ranks first); ``logits``, ``probs``, ``routing_map`` are [tokens,
experts]. The options are those ModelConfig.validate accepted: nothing is checked per call."""

from __future__ import annotations

import math

import torch


def _topk_indices(scores, topk, num_groups, group_topk, group_score):
    """Indices [tokens, topk] of the chosen experts; group-limited when ``group_topk`` is set."""
    if not group_topk:
        return scores.topk(topk, dim=-1).indices
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    # Megatron scores a group by its best topk/group_topk experts (what the token could take from
    # it if the picks spread evenly); DeepSeek-V3 and GLM in Hugging Face by its best two.
    per_group = topk // group_topk if group_score == "topk_sum" else 2
    group_scores = grouped.topk(per_group, dim=-1).values.sum(-1)
    chosen = group_scores.topk(group_topk, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return masked.topk(topk, dim=-1).indices


def route(logits: torch.Tensor, topk: int, score_function: str = "softmax",
          pre_softmax: bool = False, num_groups: int | None = None, group_topk: int | None = None,
          scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None,
          group_score: str = "topk_sum", normalize: bool = True):
    """Top-k routing -> (probs [tokens, experts] in fp32, zero off the chosen experts;
    routing_map, bool, True on them); each option is docs/moe.md, "Routing"."""
    logits = logits.float()  # routing decisions and gates in fp32 whatever the model's dtype
    if score_function == "softmax":
        scores = logits.softmax(-1) if pre_softmax else logits
    else:
        scores = logits.sigmoid()
    choice = scores if expert_bias is None else scores + expert_bias.float()
    idx = _topk_indices(choice, topk, num_groups, group_topk, group_score)
    gates = scores.gather(1, idx)
    if score_function == "softmax" and not pre_softmax:
        gates = gates.softmax(-1)
    elif score_function == "sigmoid" and normalize and topk > 1:
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)  # the epsilon guards all-zero rows
    if scaling_factor:
        gates = gates * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, idx, gates)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str = "softmax"):
    """(scores over all experts, their plain top-k map): what the balancing losses measure,
    without the group limit, bias or capacity (docs/moe.md, "Load-balancing losses")."""
    logits = logits.float()
    if score_function == "softmax":
        scores = logits.softmax(-1)
    else:
        scores = logits.sigmoid()
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    idx = scores.topk(topk, dim=-1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                               total_tokens: int, topk: int, num_experts: int, coeff: float):
    """Switch-Transformer balancing loss coeff·E/(k·T²)·Σᵢ (Σ_t scores[t, i])·countᵢ (docs/moe.md);
    ``scores`` may be this rank's tokens while the counts and ``total_tokens`` cover the scope,
    so the partial losses sum over ranks to the scope's loss."""
    aggregated = scores.float().sum(0)
    scale = num_experts * coeff / (topk * total_tokens ** 2)
    return (aggregated * tokens_per_expert).sum() * scale


def seq_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                            seq_length: int, topk: int, coeff: float):
    """The same loss per sequence, averaged over the b sequences (seq_aux_loss): ``scores``
    [s, b, E] (s may be this rank's part), ``tokens_per_expert`` [b, E] over the whole sequence."""
    num_experts = scores.shape[-1]
    per_seq = (scores.float().sum(0) * tokens_per_expert).sum(-1)
    return per_seq.mean() * (num_experts * coeff / (topk * seq_length ** 2))


def z_loss(logits: torch.Tensor, coeff: float):
    """ST-MoE router z-loss, coeff · mean_t (logsumexp_i logits[t, i])²."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens one expert takes: ⌈k·T/E · capacity_factor⌉ (k·T assignments spread over E)."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                       policy: str = "probs", pad_to_capacity: bool = False):
    """Keep at most ``capacity`` tokens per expert -> (probs, routing_map), by highest
    probability or earliest position; ``pad_to_capacity`` fills every expert to exactly
    ``capacity`` rows with unrouted tokens (docs/moe.md, "Dropless and capacity")."""
    tokens, experts = routing_map.shape
    key = probs if policy == "probs" else routing_map.to(probs.dtype)
    # rank of each token within its expert's column; the stable sort breaks ties by position
    order = key.argsort(dim=0, descending=True, stable=True)
    positions = torch.arange(tokens, device=key.device).unsqueeze(1).expand(tokens, experts)
    rank = torch.empty_like(order).scatter_(0, order, positions)
    keep = rank < capacity
    kept = keep if pad_to_capacity else keep & routing_map
    return probs * kept, kept


@torch.no_grad()
def expert_bias_update(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float):
    """Loss-free balancing: bias + rate·sign(mean load − load); ``tokens_per_expert`` summed
    over every rank that routed different tokens."""
    load = tokens_per_expert.float()
    mean = load.sum(-1, keepdim=True) / load.shape[-1]
    return bias + torch.sign(mean - load) * rate
