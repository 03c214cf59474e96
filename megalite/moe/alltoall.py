"""Expert parallelism's token exchange (docs/moe.md, "Token dispatch: the all-to-all").

The experts of EP rank r are the global experts r·E_local .. (r+1)·E_local − 1, so a sender
whose tokens are sorted by global expert (``dispatch.permute``) already holds one contiguous block
per destination rank. After the all-to-all a receiver holds, per source rank in rank order, that
source's tokens for its local experts in local-expert order; ``dispatch`` regroups them by local
expert (one block per expert for the expert matmuls) and ``combine`` undoes both steps.

Dropless routing makes the block sizes data-dependent, and the collective needs them on the host:
one read per MoE layer and micro-batch, of the counts ``exchange_counts`` brings in. Everything
else stays on the tokens' device.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from megalite import collectives as C
from megalite.config import ConfigError


def exchange_counts(tokens_per_expert_local: torch.Tensor, ep_group) -> torch.Tensor:
    """This rank's tokens per global expert [E] -> counts [EP, E_local]: row s holds what source
    rank s sends here for each local expert (one equal-split all-to-all of E ints)."""
    ep = C.group_size(ep_group)
    counts = torch.empty_like(tokens_per_expert_local)
    C.all_to_all_single(counts, tokens_per_expert_local, None, None, ep_group, "moe_counts")
    return counts.view(ep, -1)


class AllToAll(torch.autograd.Function):
    """Rows ``input_splits[j]`` of x go to rank j, ``output_splits[j]`` rows come from rank j;
    the gradient takes the way back (the same exchange with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, output_splits: List[int], input_splits: List[int], group,
                tag: str = "moe_all_to_all"):
        ctx.splits, ctx.group, ctx.tag = (output_splits, input_splits), group, tag
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        C.all_to_all_single(out, x, output_splits, input_splits, group, ctx.tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty(sum(input_splits), *grad.shape[1:])
        C.all_to_all_single(out, grad, input_splits, output_splits, ctx.group, ctx.tag)
        return out, None, None, None, None


class _Reorder(torch.autograd.Function):
    """Rows of x taken in ``order``; the gradient goes back through ``inverse`` (a permutation
    moves each row once, so a gather both ways: no scatter-add)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class DispatchHandle(NamedTuple):
    """What ``combine`` needs: the exchange's splits and the regrouping, both ways."""
    group: object
    input_splits: List[int]
    output_splits: List[int]
    order: Optional[torch.Tensor]  # received row -> expert-grouped row; None: nothing moved
    inverse: Optional[torch.Tensor]


def dispatch(tokens_sorted_by_expert: torch.Tensor, tokens_per_expert_local: torch.Tensor,
             ep_group, num_local_experts: int):
    """Send each token to the EP rank of its expert -> (tokens grouped by local expert, expert 0
    first and source-rank order inside each, counts [EP, E_local] per (source, local expert),
    handle for ``combine``). ``tokens_per_expert_local`` [E] counts this rank's rows per global
    expert (the block sizes of the sorted input)."""
    ep = C.group_size(ep_group)
    num_experts = tokens_per_expert_local.numel()
    if num_experts != ep * num_local_experts:
        raise ConfigError(f"--num-experts: {num_experts} experts cannot be {num_local_experts} "
                          f"per rank on --expert-model-parallel-size {ep}; need "
                          f"{ep * num_local_experts} (EP x experts per rank)")
    if ep == 1:
        n = tokens_sorted_by_expert.shape[0]
        return tokens_sorted_by_expert, tokens_per_expert_local.view(1, -1), \
            DispatchHandle(ep_group, [n], [n], None, None)
    counts = exchange_counts(tokens_per_expert_local, ep_group)
    # the one host read: rows to each destination and from each source, in one transfer
    splits = torch.cat([tokens_per_expert_local.view(ep, -1).sum(1), counts.sum(1)]).tolist()
    input_splits, output_splits = splits[:ep], splits[ep:]
    received = AllToAll.apply(tokens_sorted_by_expert, output_splits, input_splits, ep_group,
                              "moe_dispatch")
    # received rows run (source, local expert)-major; a stable sort by local expert regroups
    # them with source order kept, from the counts on the device (the total is already known)
    dev, total = counts.device, sum(output_splits)
    expert_of_row = torch.arange(num_local_experts, device=dev).repeat(ep).repeat_interleave(
        counts.reshape(-1), output_size=total)
    order = torch.argsort(expert_of_row, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(total, device=dev))
    grouped = _Reorder.apply(received, order, inverse)
    return grouped, counts, DispatchHandle(ep_group, input_splits, output_splits, order, inverse)


def combine(expert_outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Expert outputs (rows as ``dispatch`` returned them) -> back on their source ranks, in the
    order of the sorted tokens ``dispatch`` was given."""
    if handle.order is None:
        return expert_outputs
    back = _Reorder.apply(expert_outputs, handle.inverse, handle.order)
    return AllToAll.apply(back, handle.input_splits, handle.output_splits, handle.group,
                          "moe_combine")
