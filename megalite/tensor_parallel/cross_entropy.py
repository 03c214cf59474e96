"""Cross entropy on logits sharded over the vocab (docs/theory.md, "Vocab-parallel cross entropy").

Forward, with the vocab split across the TP group and only three scalar-per-token all-reduces:
  1. all-reduce MAX of each row's local max (numerical stability);
  2. all-reduce SUM of the target logit (zero on ranks that do not own the target id);
  3. all-reduce SUM of sum(exp(logit - max));
  loss = log(sum exp) - target logit.
Backward needs no communication: grad = softmax - onehot(target), on the local shard.

Padded vocab entries (ids >= the tokenizer's vocab size) never count: they are set to -inf before
the max, so their probability is exactly 0. Optional label smoothing mixes in the mean negative
log-probability over the real vocab (as torch.nn.functional.cross_entropy does).
"""

from __future__ import annotations

from typing import Optional

import torch

from megalite import collectives as C


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing):
        rank = C.group_rank(group)
        part = logits.shape[-1]
        start = rank * part
        logits = logits.float()
        # Mask the padded tail of the vocab (only the last ranks can hold padding).
        num_real_local = max(0, min(part, vocab_size - start))
        if num_real_local < part:
            logits = logits.clone()
            logits[..., num_real_local:] = float("-inf")

        row_max = logits.max(dim=-1)[0]
        C.all_reduce(row_max, group=group, op=C.ReduceOp.MAX, tag="tp_all_reduce")
        shifted = logits - row_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        C.all_reduce(target_logit, group=group, tag="tp_all_reduce")

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        C.all_reduce(sum_exp, group=group, tag="tp_all_reduce")
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        if label_smoothing > 0:
            # mean over the real vocab of -log p = log_sum_exp - mean(shifted)
            real = shifted[..., :num_real_local]
            sum_shifted = real.sum(dim=-1)
            C.all_reduce(sum_shifted, group=group, tag="tp_all_reduce")
            smooth_loss = log_sum_exp - sum_shifted / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth_loss

        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.num_real_local = num_real_local
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reuse the saved buffer: backward runs once
        eps = ctx.label_smoothing
        onehot_weight = (1.0 - eps) * (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_weight.unsqueeze(-1))
        if eps > 0:
            grad[..., : ctx.num_real_local] -= eps / ctx.vocab_size
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 vocab_size: Optional[int] = None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss (same shape as ``target``) from logits whose last dim is this rank's shard.

    ``vocab_size`` is the real (unpadded) vocab; entries at or beyond it are ignored.
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * C.group_size(group)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, label_smoothing)
