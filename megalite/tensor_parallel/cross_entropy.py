"""Cross entropy on logits sharded over the vocab: the formula is docs/theory.md's "Vocab-parallel
embedding and cross entropy", the fast path docs/performance.md's.

The logits ``[s, b, V/t]`` are the largest activation of a large-vocab model (V = 128k: gigabytes
per micro-batch), so they are never copied whole: both directions walk blocks of rows, upcasting
one block at a time to fp32, and backward keeps only the logits and a per-token fp32 log-sum-exp.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from megalite import collectives as C
from megalite.compiled import compile_or_eager
from megalite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_first_dim,
    gather_from_sequence_parallel_region,
)

BLOCK_ELEMENTS = 1 << 24  # logits upcast to fp32 at a time (64 MiB) at most
# On the CPU, blocks small enough to stay in a core's L2 cache (4 MiB in fp32) through the eager
# passes over them: 2-3x faster than 64 MiB blocks (docs/performance.md).
CPU_BLOCK_ELEMENTS = 1 << 20
# Compile the per-block functions: None = on CUDA only (the CPU runs them eagerly, as the
# reference); True/False force it (tests compile them on the CPU to check the CUDA path's code).
COMPILE_BLOCKS: Optional[bool] = None


def _blocks(x: torch.Tensor):
    n_rows, n_cols = x.shape
    limit = BLOCK_ELEMENTS if x.is_cuda else min(BLOCK_ELEMENTS, CPU_BLOCK_ELEMENTS)
    step = max(1, limit // max(1, n_cols))
    return [slice(i, i + step) for i in range(0, n_rows, step)]


def block_stats(x: torch.Tensor, local_target: torch.Tensor, with_sum: bool):
    """Per row of one block of real columns, in fp32, stacked: max, sum exp(x - max), target
    logit and, ``with_sum`` (label smoothing), sum x."""
    xf = x.float()
    m = xf.amax(dim=-1)
    target = xf.gather(-1, local_target[:, None]).squeeze(-1)
    total = (xf.sum(dim=-1),) if with_sum else ()
    return torch.stack((m, (xf - m[:, None]).exp_().sum(dim=-1), target) + total)


def block_grad(out: torch.Tensor, x: torch.Tensor, log_sum_exp: torch.Tensor, g: torch.Tensor,
               local_target: torch.Tensor, onehot: torch.Tensor, smooth: float) -> torch.Tensor:
    """Write (softmax - smooth) * g into ``out`` for one block; return the target column's value
    (the same minus its one-hot weight, fp32), for the caller to scatter (a scatter inside would
    make a fused kernel keep an fp32 copy of the block)."""
    # the target column first: ``out`` may be ``x`` (the chunked loss head's in-place gradient)
    at_target = (x.gather(-1, local_target[:, None]).float() - log_sum_exp[:, None]).exp_()
    p = (x.float() - log_sum_exp[:, None]).exp_()
    if smooth:
        p.sub_(smooth)
    out.copy_(p.mul_(g[:, None]))
    return (at_target - smooth) * g[:, None] - onehot[:, None]


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    # dynamic: no recompile per block shape; eager if this machine cannot compile (compiled.py)
    return compile_or_eager(fn, dynamic=True, fullgraph=True)


def _maybe_compiled(fn, x: torch.Tensor):
    use = x.is_cuda if COMPILE_BLOCKS is None else COMPILE_BLOCKS
    return _compiled(fn) if use and not torch.compiler.is_compiling() else fn


def _local_targets(target: torch.Tensor, start: int, part: int):
    """(target column on this rank, 0 where another rank holds it; that mask) per token."""
    outside = (target < start) | (target >= start + part)
    return (target - start).masked_fill(outside, 0), outside


def _shard(part: int, target: torch.Tensor, group, vocab_size: int):
    """(real columns of this rank's ``part`` vocab columns, local targets, outside mask): only
    the last ranks can hold padding, and a rank may hold none of the real vocab at all."""
    start = C.group_rank(group) * part
    return (max(0, min(part, vocab_size - start)), *_local_targets(target.reshape(-1), start, part))


def _local_stats(x: torch.Tensor, local_target: torch.Tensor, real: int, k: int) -> torch.Tensor:
    """[k, rows] fp32 of this rank's logit rows ``x``: block_stats over its ``real`` columns."""
    if real == 0:  # no real column on this rank
        stats = torch.zeros(k, x.shape[0], dtype=torch.float32, device=x.device)
        stats[0] = float("-inf")
        return stats
    stats_fn = _maybe_compiled(block_stats, x)
    parts = [stats_fn(x[r, :real], local_target[r], k == 4) for r in _blocks(x)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _combine(stats, outside, group, vocab_size: int, label_smoothing: float):
    """(per-token loss, log-sum-exp) from every rank's stats: the two all-reduces."""
    local_max, sums = stats[0], stats[1:]
    sums[1].masked_fill_(outside, 0.0)
    row_max = local_max.clone()
    C.all_reduce(row_max, group=group, op=C.ReduceOp.MAX, tag="tp_all_reduce")
    sums[0].mul_((local_max - row_max).exp_())  # exp(-inf) = 0 where a rank has no real vocab
    C.all_reduce(sums, group=group, tag="tp_all_reduce")
    log_sum_exp = row_max + sums[0].log()
    loss = log_sum_exp - sums[1]
    if label_smoothing > 0:  # mean over the real vocab of -log p = log_sum_exp - mean(x)
        smooth_loss = log_sum_exp - sums[2] / vocab_size
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth_loss
    return loss, log_sum_exp


def _grad_logits(out, x, log_sum_exp, g, local_target, onehot, real: int, smooth: float):
    """Write the gradient of logit rows ``x`` into ``out`` (which may be ``x`` itself)."""
    out[:, real:] = 0.0  # padded columns: probability exactly 0
    if real == 0:
        return
    grad_fn = _maybe_compiled(block_grad, x)
    for r in _blocks(x):
        o = out[r, :real]
        at_target = grad_fn(o, x[r, :real], log_sum_exp[r], g[r], local_target[r], onehot[r],
                            smooth)
        o.scatter_(-1, local_target[r, None], at_target.to(o.dtype))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing):
        real, local_target, outside = _shard(logits.shape[-1], target, group, vocab_size)
        x = logits.reshape(-1, logits.shape[-1])
        # rows: local max, sum exp(x - local max), target logit[, sum x]
        stats = _local_stats(x, local_target, real, 4 if label_smoothing > 0 else 3)
        loss, log_sum_exp = _combine(stats, outside, group, vocab_size, label_smoothing)
        ctx.save_for_backward(logits, log_sum_exp, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size, ctx.real = label_smoothing, vocab_size, real
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_sum_exp, local_target, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        x = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(x)
        g = grad_loss.reshape(-1).float()
        onehot = (1.0 - eps) * (~outside).float() * g
        _grad_logits(grad, x, log_sum_exp, g, local_target, onehot, ctx.real,
                     eps / ctx.vocab_size)
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 vocab_size: Optional[int] = None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss (``target``'s shape) from logits whose last dim is this rank's shard;
    columns at or beyond the real ``vocab_size`` are ignored."""
    if vocab_size is None:
        vocab_size = logits.shape[-1] * C.group_size(group)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, label_smoothing)


def _chunk_grads(logits, x, weight, r, grad_x, grad_w, log_sum_exp, g, local_target, onehot,
                 real: int, smooth: float):
    """Turn one chunk's logits (rows ``r``) into their gradient in place and from it write the
    chunk's rows of dX into ``grad_x`` and add its part of dW to ``grad_w`` (either may be None;
    dW summed in the weight's dtype: 16-bit weights take one rounding per chunk rather than a
    dW-sized fp32 buffer)."""
    if grad_x is None and grad_w is None:
        return
    _grad_logits(logits, logits, log_sum_exp, g, local_target, onehot, real, smooth)
    if grad_x is not None:
        torch.matmul(logits, weight, out=grad_x[r])
    if grad_w is not None:
        grad_w.addmm_(logits.t(), x[r])


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, chunk: int):
    """(rows, their logits) chunk by chunk, in one reused buffer: a chunk's logits are gone
    when the next one's are made (and the CPU does not page in a fresh buffer per chunk)."""
    buf = x.new_empty(min(chunk, x.shape[0]), weight.shape[0])
    for i in range(0, x.shape[0], chunk):
        r = slice(i, i + chunk)
        yield r, torch.matmul(x[r], weight.t(), out=buf[:x[r].shape[0]])


class _LinearCrossEntropy(torch.autograd.Function):
    """logits = x W^T and their cross entropy, ``chunk`` token rows at a time: forward keeps x
    (this rank's SP shard of it) and the per-token log-sum-exp; backward recomputes the logits
    chunk by chunk (docs/tensor_parallel.md, "The chunked loss head")."""

    @staticmethod
    def forward(ctx, x, weight, target, local_x, group, vocab_size, label_smoothing, chunk,
                store):
        real, local_target, outside = _shard(weight.shape[0], target, group, vocab_size)
        xs = x.reshape(-1, x.shape[-1])
        k = 4 if label_smoothing > 0 else 3
        # every chunk's local stats first, then the same two all-reduces as unchunked
        stats = torch.cat([_local_stats(logits, local_target[r], real, k)
                           for r, logits in _chunk_logits(xs, weight, chunk)], dim=1)
        loss, log_sum_exp = _combine(stats, outside, group, vocab_size, label_smoothing)
        ctx.gathered = local_x is not None
        ctx.save_for_backward(local_x if ctx.gathered else x, weight, log_sum_exp, local_target,
                              outside)
        ctx.args = (chunk, real, label_smoothing, vocab_size)
        ctx.group, ctx.store, ctx.weight = group, store, weight
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        saved, weight, log_sum_exp, local_target, outside = ctx.saved_tensors
        chunk, real, eps, vocab_size = ctx.args
        x = gather_first_dim(saved, ctx.group) if ctx.gathered else saved
        xs = x.reshape(-1, x.shape[-1])
        g = grad_loss.reshape(-1).float()
        onehot = (1.0 - eps) * (~outside).float() * g

        @torch.no_grad()  # a deferred W runs outside backward: no graph
        def recompute(grad_x, grad_w):
            for r, logits in _chunk_logits(xs, weight, chunk):
                _chunk_grads(logits, xs, weight, r, grad_x, grad_w, log_sum_exp[r], g[r],
                             local_target[r], onehot[r], real, eps / vocab_size)
            return grad_w

        want_w = ctx.needs_input_grad[1]
        defer = want_w and ctx.store is not None and ctx.store.capturing  # a B: W recomputes
        grad_x = torch.empty_like(xs)
        grad_w = recompute(grad_x, torch.zeros_like(weight) if want_w and not defer else None)
        if defer:
            ctx.store.put(ctx.weight, lambda: recompute(None, torch.zeros_like(weight)))
        return grad_x.view(x.shape), grad_w, None, None, None, None, None, None, None


class _WeightedLinearCrossEntropy(torch.autograd.Function):
    """sum_t w_t loss_t of logits = x W^T, ``chunk`` token rows at a time, with both gradients
    formed in forward: the per-token weights w (loss mask / token count) are known before the
    loss is, so each chunk's logits turn into their gradient and meet x and W at once (three
    GEMMs, as whole logits; no recompute). Backward scales them by the incoming scalar, 1 in
    training: the weights carry the fp16 loss scale (docs/tensor_parallel.md, "The chunked loss
    head")."""

    @staticmethod
    def forward(ctx, x, weight, target, weights, group, vocab_size, label_smoothing, chunk,
                want_x, want_w):
        real, local_target, outside = _shard(weight.shape[0], target, group, vocab_size)
        xs = x.reshape(-1, x.shape[-1])
        w = weights.reshape(-1).float()
        k, eps = (4 if label_smoothing > 0 else 3), label_smoothing
        onehot = (1.0 - eps) * (~outside).float() * w
        grad_x = torch.empty_like(xs) if want_x else None
        grad_w = torch.zeros_like(weight) if want_w else None
        losses = []
        for r, logits in _chunk_logits(xs, weight, chunk):
            # the vocab-parallel all-reduces per chunk: its gradient needs the global
            # log-sum-exp before the next chunk's logits overwrite the buffer
            stats = _local_stats(logits, local_target[r], real, k)
            loss, log_sum_exp = _combine(stats, outside[r], group, vocab_size, eps)
            losses.append(loss)
            _chunk_grads(logits, xs, weight, r, grad_x, grad_w, log_sum_exp, w[r],
                         local_target[r], onehot[r], real, eps / vocab_size)
        token_loss = torch.cat(losses).view(target.shape)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.x_shape = x.shape
        ctx.mark_non_differentiable(token_loss)
        return (token_loss.view(-1) * w).sum(), token_loss

    @staticmethod
    def backward(ctx, grad_total, _grad_token_loss):
        grad_x, grad_w = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x.mul_(grad_total.to(grad_x.dtype)).view(ctx.x_shape)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_total.to(grad_w.dtype))
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         group=None, vocab_size: Optional[int] = None, *, chunk_tokens: int,
                         label_smoothing: float = 0.0, sequence_parallel: bool = False,
                         store=None, loss_weights: Optional[torch.Tensor] = None):
    """The output layer (a ColumnParallelLinear without bias, ``weight`` [V/t, h]) fused with
    vocab_parallel_cross_entropy: x [s, b, h] ([s/t, b, h] gathered, ``sequence_parallel``) to
    the per-token loss [s, b], never more than ``chunk_tokens`` rows of logits at once; ``store``:
    a WeightGradStore its weight gradient may be deferred to. With ``loss_weights`` [s, b]: (sum
    of weight x loss, the differentiable scalar; the per-token loss, detached), the gradients
    formed in forward (the training path: no recompute, nothing deferred)."""
    if vocab_size is None:
        vocab_size = weight.shape[0] * C.group_size(group)
    sp = sequence_parallel and C.group_size(group) > 1
    if sp:  # as ColumnParallelLinear: all-gather along s, reduce-scatter dX in backward
        total, local_x = gather_from_sequence_parallel_region(x, group), x
    else:  # all-reduce dX in backward
        total, local_x = copy_to_tensor_model_parallel_region(x, group), None
    if loss_weights is not None:
        grad = torch.is_grad_enabled()  # Function.forward runs without it: ask here
        return _WeightedLinearCrossEntropy.apply(
            total, weight, target, loss_weights, group, vocab_size, label_smoothing,
            chunk_tokens, grad and total.requires_grad, grad and weight.requires_grad)
    return _LinearCrossEntropy.apply(total, weight, target, local_x, group, vocab_size,
                                     label_smoothing, chunk_tokens, store)
