"""Collectives as autograd functions: the conjugate operator pairs of Megatron-LM.

Shoeybi et al. (arXiv:1909.08053, Fig. 3) name two operators:

* ``f`` = :func:`copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward.
  It sits in front of a column-parallel layer whose input is replicated.
* ``g`` = :func:`reduce_from_tensor_model_parallel_region`: all-reduce forward, identity backward.
  It sits after a row-parallel layer whose outputs are partial sums.

Sequence parallelism (Korthikanti et al., arXiv:2205.05198 §4.2.2) replaces ``f``/``g`` by
``g-bar``/``g``: an all-gather along the sequence (dim 0 of ``[s, b, h]``) whose backward is a
reduce-scatter, and a reduce-scatter whose backward is an all-gather.

Every function takes the TP group explicitly; ``None`` or a group of one makes it the identity.
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


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    n = C.group_size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[C.group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    n = C.group_size(group)
    if n == 1:
        return x
    # all_gather_into_tensor concatenates along dim 0: gather with the last dim moved to the front
    moved = x.movedim(-1, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather_into_tensor(out, moved, group=group, tag="tp_all_gather")
    return out.movedim(0, -1).contiguous()


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    n = C.group_size(group)
    if n == 1:
        return x
    size = x.shape[0]
    if size % n != 0:
        raise ValueError(f"sequence length {size} is not divisible by the TP size {n}")
    return x.chunk(n, dim=0)[C.group_rank(group)].contiguous()


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
class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone() if C.group_size(group) > 1 else x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's chunk of the last dim; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim; backward keeps this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's chunk of the sequence (dim 0); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g-bar: all-gather along the sequence; backward reduce-scatters (the conjugate)."""

    @staticmethod
    def forward(ctx, x, group, grad_reduce_scatter: bool = True):
        ctx.group = group
        ctx.grad_reduce_scatter = grad_reduce_scatter
        return gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_reduce_scatter:
            return reduce_scatter_first_dim(grad, ctx.group), None, None
        # The consumer's gradient is already identical on every rank: just keep our chunk.
        return _split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first_dim(grad, ctx.group), None


# ---------------------------------------------------------------------------------- public API
def copy_to_tensor_model_parallel_region(x, group):
    return _CopyToRegion.apply(x, group) if C.group_size(group) > 1 else x


def reduce_from_tensor_model_parallel_region(x, group):
    return _ReduceFromRegion.apply(x, group) if C.group_size(group) > 1 else x


def scatter_to_tensor_model_parallel_region(x, group):
    return _ScatterToRegion.apply(x, group) if C.group_size(group) > 1 else x


def gather_from_tensor_model_parallel_region(x, group):
    return _GatherFromRegion.apply(x, group) if C.group_size(group) > 1 else x


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSequenceParallelRegion.apply(x, group) if C.group_size(group) > 1 else x


def gather_from_sequence_parallel_region(x, group, grad_reduce_scatter: bool = True):
    if C.group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, grad_reduce_scatter)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequenceParallelRegion.apply(x, group) if C.group_size(group) > 1 else x
