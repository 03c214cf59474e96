"""Vocab-parallel cross entropy equals torch.nn.functional.cross_entropy, value and gradient."""

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from megalite.parallel_state import initialize_model_parallel
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

VOCAB = 37  # not divisible by tp: the last rank holds padded columns


def _reference(logits_full, target, smoothing):
    x = logits_full[..., :VOCAB].clone().requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
                           label_smoothing=smoothing).view(target.shape)
    weights = torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)  # non-uniform upstream grad
    (loss * weights).sum().backward()
    return loss.detach(), x.grad, weights


def _ce_worker(rank, world_size, smoothing):
    g = torch.Generator().manual_seed(0)
    padded = 48  # multiple of 4 and of 2
    logits_full = torch.randn(5, 3, padded, generator=g) * 3
    # garbage in the padded columns must not matter
    logits_full[..., VOCAB:] = 1000.0
    target = torch.randint(0, VOCAB, (5, 3), generator=g)
    ref_loss, ref_grad, weights = _reference(logits_full, target, smoothing)
    for tp in (1, 2, 4):
        ps = initialize_model_parallel(tp, 1, backend="gloo", device="cpu", set_default=False)
        shard = logits_full.chunk(tp, dim=-1)[ps.tp_rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(shard, target, ps.tp_group, vocab_size=VOCAB,
                                            label_smoothing=smoothing)
        (loss * weights).sum().backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"tp={tp} loss")
        full_grad = torch.zeros(5, 3, padded)
        full_grad[..., :VOCAB] = ref_grad
        expect = full_grad.chunk(tp, dim=-1)[ps.tp_rank]
        torch.testing.assert_close(shard.grad, expect, rtol=1e-5, atol=1e-6, msg=f"tp={tp} grad")
    return True


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_matches_torch(smoothing):
    assert all(run_distributed(_ce_worker, 4, smoothing))


def test_single_process_cross_entropy_needs_no_process_group():
    logits = torch.randn(4, 2, VOCAB, requires_grad=True)
    target = torch.randint(0, VOCAB, (4, 2))
    loss = vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref)
