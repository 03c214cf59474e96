"""Collectives as autograd functions: the conjugate operator pairs f, g of Megatron-LM and SP's
g, ḡ (docs/tensor_parallel.md, "The f and g operators"). Every function takes the TP group
explicitly; ``None`` or a group of one makes it the identity.
"""

from __future__ import annotations

import torch

from megalite import collectives as C


# ----------------------------------------------------------------------------- primitive helpers
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if C.group_size(group) == 1:
        return x
    x = x.contiguous()
    C.all_reduce(x, group=group, tag="tp_all_reduce")
    return x


# the last-dim pair is reached only through _op, for groups of more than one rank
def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(C.group_size(group), dim=-1)[C.group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    n = C.group_size(group)
    # all_gather_into_tensor concatenates along dim 0: gather with the last dim moved to the front
    moved = x.movedim(-1, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype,
                      device=x.device)
    C.all_gather_into_tensor(out, moved, group=group, tag="tp_all_gather")
    return out.movedim(0, -1).contiguous()


def gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    n = C.group_size(group)
    if n == 1:
        return x
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather_into_tensor(out, x.contiguous(), group=group, tag="sp_all_gather")
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    n = C.group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n != 0:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the TP size {n}")
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    C.reduce_scatter_tensor(out, x.contiguous(), group=group, tag="sp_reduce_scatter")
    return out


# ------------------------------------------------------------------------------ autograd pairs
def _pair(name: str, forward, backward):
    """An autograd function that runs ``forward(x, group)`` and, in backward, its conjugate
    ``backward(grad, group)``."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd),
                                                   "backward": staticmethod(bwd)})


class _ReduceFromRegion(torch.autograd.Function):
    """g, in place on the partial sums; marked dirty, so a backward that saved them raises
    (docs/tensor_parallel.md)."""

    @staticmethod
    def forward(ctx, x, group):
        # a non-contiguous input: the collective's copy is the output; a leaf that requires grad
        # (a caller's own tensor, never a layer's partial) autograd forbids changing in place
        if not x.is_contiguous() or (x.is_leaf and x.requires_grad):
            return _all_reduce(x, group)
        ctx.mark_dirty(x)
        C.all_reduce(x, group=group, tag="tp_all_reduce")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _op(fn):
    """The operator as the layers call it: for a group of one (or ``None``) the input itself,
    without an autograd node (each costs Python time in every layer's forward and backward)."""
    return lambda x, group: fn.apply(x, group) if C.group_size(group) > 1 else x


# ---------------------------------------------------------------------------------- public API
# Each operator's backward is its forward's conjugate.
copy_to_tensor_model_parallel_region = _op(_pair(  # f
    "_CopyToRegion", lambda x, group: x, _all_reduce))
reduce_from_tensor_model_parallel_region = _op(_ReduceFromRegion)  # g
scatter_to_tensor_model_parallel_region = _op(_pair("_ScatterToRegion", _split_last_dim,
                                                    _gather_last_dim))
gather_from_tensor_model_parallel_region = _op(_pair("_GatherFromRegion", _gather_last_dim,
                                                     _split_last_dim))
gather_from_sequence_parallel_region = _op(_pair(  # g (SP)
    "_GatherFromSequenceParallelRegion", gather_first_dim, reduce_scatter_first_dim))
reduce_scatter_to_sequence_parallel_region = _op(_pair(  # ḡ (SP)
    "_ReduceScatterToSequenceParallelRegion", reduce_scatter_first_dim, gather_first_dim))
# A sum of per-rank partials that every rank then uses (OLMoE's q/k norm statistic over heads
# split by TP, models/norms.py): all-reduce forward; each rank's gradient is one term of the
# sum's, so all-reduce backward too. The forward reduces a copy: its input stays as computed.
sum_over_tensor_model_parallel_region = _op(_pair(
    "_SumOverRegion", lambda x, group: _all_reduce(x.clone(), group), _all_reduce))
