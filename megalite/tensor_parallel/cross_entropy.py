"""Cross entropy on logits sharded over the vocab (docs/theory.md, "Vocab-parallel cross entropy").

Forward, with the vocab split across the TP group and only three scalar-per-token all-reduces:
  1. all-reduce MAX of each row's local max (numerical stability);
  2. all-reduce SUM of the target logit (zero on ranks that do not own the target id);
  3. all-reduce SUM of sum(exp(logit - max));
  loss = log(sum exp) - target logit.
Backward needs no communication: grad = softmax - onehot(target), on the local shard.

Memory. The logits ``[s, b, V/t]`` are the largest activation of a large-vocab model (V = 128k:
gigabytes per micro-batch), so they are never copied whole: every pass walks blocks of rows,
upcasting one block at a time to fp32, and the only tensor kept for backward is the logits
themselves, in their own dtype (plus per-token max and log-sum-exp). Backward recomputes the
softmax block by block and writes the gradient straight into one buffer of the logits' dtype.
Peak: the logits, their gradient and one fp32 block, instead of several fp32 copies.

Padded vocab entries (ids >= the tokenizer's vocab size) never count: every pass reads only the
real columns, so their probability (and gradient) is exactly 0. Optional label smoothing mixes in
the mean negative log-probability over the real vocab (as torch.nn.functional.cross_entropy does).
"""

from __future__ import annotations

from typing import Optional

import torch

from megalite import collectives as C

BLOCK_ELEMENTS = 1 << 24  # logits upcast to fp32 at a time (64 MiB)


def _blocks(n_rows: int, n_cols: int):
    step = max(1, BLOCK_ELEMENTS // max(1, n_cols))
    return [slice(i, i + step) for i in range(0, n_rows, step)]


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
        blocks = _blocks(n, part)

        row_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
        if real > 0:
            for r in blocks:
                row_max[r] = x[r, :real].float().amax(dim=-1)
        C.all_reduce(row_max, group=group, op=C.ReduceOp.MAX, tag="tp_all_reduce")

        outside = (tgt < start) | (tgt >= start + part)
        local_target = (tgt - start).masked_fill(outside, 0)
        target_logit = torch.zeros(n, dtype=torch.float32, device=x.device)
        sum_exp = torch.zeros_like(target_logit)
        sum_shifted = torch.zeros_like(target_logit) if label_smoothing > 0 else None
        if real > 0:
            for r in blocks:
                shifted = x[r, :real].float() - row_max[r, None]
                target_logit[r] = shifted.gather(-1, local_target[r, None]).squeeze(-1)
                if sum_shifted is not None:
                    sum_shifted[r] = shifted.sum(dim=-1)
                sum_exp[r] = shifted.exp_().sum(dim=-1)
        target_logit.masked_fill_(outside, 0.0)
        C.all_reduce(target_logit, group=group, tag="tp_all_reduce")
        C.all_reduce(sum_exp, group=group, tag="tp_all_reduce")
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            # mean over the real vocab of -log p = log_sum_exp - mean(shifted)
            C.all_reduce(sum_shifted, group=group, tag="tp_all_reduce")
            smooth_loss = log_sum_exp - sum_shifted / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth_loss

        ctx.save_for_backward(logits, row_max, log_sum_exp, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size, ctx.real = label_smoothing, vocab_size, real
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, row_max, log_sum_exp, local_target, outside = ctx.saved_tensors
        eps, real = ctx.label_smoothing, ctx.real
        part = logits.shape[-1]
        x = logits.reshape(-1, part)
        grad = torch.empty_like(x)
        grad[:, real:] = 0.0  # padded columns: probability exactly 0
        g = grad_loss.reshape(-1).float()
        onehot_weight = ((1.0 - eps) * (~outside).float() * g).unsqueeze(-1)
        if real > 0:
            shift = row_max + log_sum_exp  # softmax = exp(x - max - log sum exp)
            for r in _blocks(x.shape[0], part):
                block = (x[r, :real].float() - shift[r, None]).exp_()
                if eps > 0:
                    block.sub_(eps / ctx.vocab_size)
                block.mul_(g[r, None])
                block.scatter_add_(-1, local_target[r, None], -onehot_weight[r])
                grad[r, :real] = block
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 vocab_size: Optional[int] = None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss (same shape as ``target``) from logits whose last dim is this rank's shard.

    ``vocab_size`` is the real (unpadded) vocab; entries at or beyond it are ignored.
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * C.group_size(group)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, label_smoothing)
