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
    p = (x.float() - log_sum_exp[:, None]).exp_()
    if smooth:
        p.sub_(smooth)
    out.copy_(p.mul_(g[:, None]))
    at_target = (x.gather(-1, local_target[:, None]).float() - log_sum_exp[:, None]).exp_()
    return (at_target - smooth) * g[:, None] - onehot[:, None]


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    # dynamic: no recompile per block shape; eager if this machine cannot compile (compiled.py)
    return compile_or_eager(fn, dynamic=True, fullgraph=True)


def _maybe_compiled(fn, x: torch.Tensor):
    use = x.is_cuda if COMPILE_BLOCKS is None else COMPILE_BLOCKS
    return _compiled(fn) if use and not torch.compiler.is_compiling() else fn


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing):
        rank = C.group_rank(group)
        part = logits.shape[-1]
        start = rank * part
        # Only the last ranks can hold padding; a rank may hold none of the real vocab at all.
        real = max(0, min(part, vocab_size - start))
        x, tgt = logits.reshape(-1, part), target.reshape(-1)
        n = x.shape[0]
        outside = (tgt < start) | (tgt >= start + part)
        local_target = (tgt - start).masked_fill(outside, 0)

        # rows: local max, sum exp(x - local max), target logit[, sum x]
        k = 4 if label_smoothing > 0 else 3
        if real > 0:
            stats_fn = _maybe_compiled(block_stats, x)
            parts = [stats_fn(x[r, :real], local_target[r], k == 4) for r in _blocks(x)]
            stats = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        else:  # no real column on this rank
            stats = torch.zeros(k, n, dtype=torch.float32, device=x.device)
            stats[0] = float("-inf")
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

        ctx.save_for_backward(logits, log_sum_exp, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size, ctx.real = label_smoothing, vocab_size, real
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_sum_exp, local_target, outside = ctx.saved_tensors
        eps, real = ctx.label_smoothing, ctx.real
        part = logits.shape[-1]
        x = logits.reshape(-1, part)
        grad = torch.empty_like(x)
        grad[:, real:] = 0.0  # padded columns: probability exactly 0
        g = grad_loss.reshape(-1).float()
        onehot = (1.0 - eps) * (~outside).float() * g
        if real > 0:
            grad_fn = _maybe_compiled(block_grad, x)
            for r in _blocks(x):
                out = grad[r, :real]
                at_target = grad_fn(out, x[r, :real], log_sum_exp[r], g[r], local_target[r],
                                    onehot[r], eps / ctx.vocab_size)
                out.scatter_(-1, local_target[r, None], at_target.to(out.dtype))
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 vocab_size: Optional[int] = None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss (``target``'s shape) from logits whose last dim is this rank's shard;
    columns at or beyond the real ``vocab_size`` are ignored."""
    if vocab_size is None:
        vocab_size = logits.shape[-1] * C.group_size(group)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, label_smoothing)
