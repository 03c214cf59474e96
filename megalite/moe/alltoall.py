"""Expert parallelism's token exchange (docs/moe.md, "Token dispatch: the all-to-all"); every
all-to-all goes through the overlap hook ``overlap.exchange``, blocking as seen from here."""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from megalite import collectives as C
from megalite.overlap import exchange


def exchange_counts(tokens_per_expert_local: torch.Tensor, ep_group) -> torch.Tensor:
    """This rank's tokens per global expert [E] -> counts [EP, E_local]: row s holds what source
    rank s sends here for each local expert (one equal-split all-to-all of E ints)."""
    ep = C.group_size(ep_group)
    counts = torch.empty_like(tokens_per_expert_local)
    exchange(counts, tokens_per_expert_local, None, None, ep_group, "moe_counts")
    return counts.view(ep, -1)


def gather_counts(rows_per_local_expert: torch.Tensor, etp_group) -> torch.Tensor:
    """Rows per local expert [E_local] on each ETP rank -> [ETP, E_local], ETP ranks in order."""
    etp = C.group_size(etp_group)
    out = rows_per_local_expert.new_empty(etp * rows_per_local_expert.numel())
    C.all_gather_into_tensor(out, rows_per_local_expert, group=etp_group, tag="moe_counts")
    return out.view(etp, -1)


class AllToAll(torch.autograd.Function):
    """Rows ``input_splits[j]`` of x go to rank j, ``output_splits[j]`` rows come from rank j;
    the gradient takes the way back (the same exchange with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, output_splits: List[int], input_splits: List[int], group,
                tag: str = "moe_all_to_all"):
        ctx.splits, ctx.group, ctx.tag = (output_splits, input_splits), group, tag
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        exchange(out, x, output_splits, input_splits, group, ctx.tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty(sum(input_splits), *grad.shape[1:])
        exchange(out, grad, input_splits, output_splits, ctx.group, ctx.tag)
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


class Exchange(NamedTuple):
    """One of dispatch's exchanges, as ``combine`` undoes it: the splits both ways and the
    regrouping of the received rows by local expert. ``copies`` > 1: an all-gather (each rank
    sent its rows to all ``copies`` ranks), undone by a sum of the returned copies."""
    group: object
    input_splits: List[int]
    output_splits: List[int]
    order: torch.Tensor  # received row -> expert-grouped row
    inverse: torch.Tensor
    copies: int


def _regroup_order(counts: torch.Tensor, total: int):
    """Received rows run (source, local expert)-major, ``counts`` [sources, E_local] rows each; a
    stable sort by local expert regroups them with source order kept -> (order, inverse), from
    the counts on the device (the total is already known on the host)."""
    sources, num_local = counts.shape
    dev = counts.device
    expert_of_row = torch.arange(num_local, device=dev).repeat(sources).repeat_interleave(
        counts.reshape(-1), output_size=total)
    order = torch.argsort(expert_of_row, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(total, device=dev))
    return order, inverse


def _exchange(rows: torch.Tensor, counts: torch.Tensor, input_splits: List[int],
              output_splits: List[int], group, tag: str, copies: int):
    out = AllToAll.apply(rows.repeat(copies, 1) if copies > 1 else rows, output_splits,
                         input_splits, group, tag)
    order, inverse = _regroup_order(counts, sum(output_splits))
    return _Reorder.apply(out, order, inverse), Exchange(group, input_splits, output_splits,
                                                         order, inverse, copies)


def dispatch(tokens_sorted_by_expert: torch.Tensor, tokens_per_expert_local: torch.Tensor,
             ep_group, num_local_experts: int, etp_group=None,
             padded_to: Optional[int] = None):
    """Each row to its expert's EP rank, then (ETP > 1) shared over the ETP group -> (rows grouped
    by local expert, source ranks in order inside each; rows per local expert [E_local]; the
    exchanges made, in order, for ``combine``: none at EP = ETP = 1). ``padded_to`` C (capacity
    padding): C rows to every expert, so no count exchange and no host read."""
    ep, etp = C.group_size(ep_group), C.group_size(etp_group)
    num_experts = tokens_per_expert_local.numel()
    if num_experts != ep * num_local_experts:
        raise ValueError(f"--num-experts: {num_experts} experts cannot be {num_local_experts} "
                          f"per rank on --expert-model-parallel-size {ep}; need "
                          f"{ep * num_local_experts} (EP x experts per rank)")
    if ep == 1 and etp == 1:
        return tokens_sorted_by_expert, tokens_per_expert_local, ()
    if padded_to is not None:
        counts = tokens_per_expert_local.new_full((ep, num_local_experts), padded_to)
        etp_counts = counts.sum(0).repeat(etp, 1) if etp > 1 else None
        block = num_local_experts * padded_to  # rows to (and from) each EP rank
        splits = [block] * 2 * ep + ([ep * block] * etp if etp > 1 else [])
    else:
        # counts [EP, E_local]: what each EP source sends here; at EP 1 this rank's own rows
        counts = (exchange_counts(tokens_per_expert_local, ep_group) if ep > 1
                  else tokens_per_expert_local.view(1, -1))
        etp_counts = gather_counts(counts.sum(0), etp_group) if etp > 1 else None
        # the one host read: rows to each EP destination, from each EP source, from each ETP peer
        sizes = [tokens_per_expert_local.view(ep, -1).sum(1), counts.sum(1)]
        if etp_counts is not None:
            sizes.append(etp_counts.sum(1))
        splits = torch.cat(sizes).tolist()
    rows, exchanges = tokens_sorted_by_expert, []
    if ep > 1:
        rows, ex = _exchange(rows, counts, splits[:ep], splits[ep:2 * ep], ep_group,
                             "moe_dispatch", 1)
        exchanges.append(ex)
    if etp_counts is not None:
        rows, ex = _exchange(rows, etp_counts, [rows.shape[0]] * etp, splits[2 * ep:],
                             etp_group, "moe_etp_gather", etp)
        exchanges.append(ex)
        counts = etp_counts
    return rows, counts.sum(0), tuple(exchanges)


def combine(expert_outputs: torch.Tensor, handle: Tuple[Exchange, ...]) -> torch.Tensor:
    """Expert outputs (rows as ``dispatch`` returned them) -> back on their source ranks, in the
    order of the sorted tokens ``dispatch`` was given; ETP's partial outputs summed."""
    rows = expert_outputs
    for ex in reversed(handle):
        back = _Reorder.apply(rows, ex.inverse, ex.order)
        tag = "moe_combine" if ex.copies == 1 else "moe_etp_reduce"
        rows = AllToAll.apply(back, ex.input_splits, ex.output_splits, ex.group, tag)
        if ex.copies > 1:  # the copies each ETP peer computed with its weight slice
            rows = rows.view(ex.copies, -1, *rows.shape[1:]).sum(0)
    return rows
