"""The chunked loss head (tensor_parallel/cross_entropy.py, linear_cross_entropy) equals the output
layer followed by vocab_parallel_cross_entropy on whole logits: losses and the gradients into the
hidden states and the output weight, one process and TP2 (+SP), tied and untied embeddings."""

import pytest
import torch

from dist_utils import run_distributed
from model_utils import VOCAB, assert_grads_close, full_grads, tiny_config

from megalite.config import ExecutionConfig
from megalite.distributed.finalize_model_grads import finalize_model_grads
from megalite.models import GPTModel
from megalite.overlap import WeightGradStore
from megalite.parallel_state import ParallelState, initialize_model_parallel
from megalite.tensor_parallel.cross_entropy import (
    linear_cross_entropy,
    vocab_parallel_cross_entropy,
)


def _head(x, w, target, chunk, eps, store=None, weighted=False):
    """(loss, dX, dW) under a non-uniform upstream gradient; chunk 0: whole logits;
    ``weighted``: the training path, the gradient formed in forward from the loss weights."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    weights = torch.linspace(0.5, 1.5, target.numel()).view(target.shape)
    if weighted:
        total, loss = linear_cross_entropy(x, w, target, vocab_size=37, label_smoothing=eps,
                                           chunk_tokens=chunk, loss_weights=weights)
        (2.0 * total).backward()  # an upstream scale (the fp16 loss scale's place)
        return loss, x.grad / 2.0, w.grad / 2.0
    if chunk:
        loss = linear_cross_entropy(x, w, target, vocab_size=37, label_smoothing=eps,
                                    chunk_tokens=chunk, store=store)
    else:
        loss = vocab_parallel_cross_entropy(x @ w.t(), target, vocab_size=37,
                                            label_smoothing=eps)
    (loss * weights).sum().backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_chunks_equal_whole_logits(dtype, tol):
    """Padded vocab (37 real of 48 columns), label smoothing, chunks that do not divide the
    tokens; fp32 at 1e-6, bf16 within its rounding (dW summed in bf16 over chunks)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 32, generator=g).to(dtype)
    w = (0.3 * torch.randn(48, 32, generator=g)).to(dtype)
    w[37:] = 5.0  # padded rows: their logits must not matter
    target = torch.randint(0, 37, (7, 3), generator=g)
    for eps in (0.0, 0.1):
        ref = _head(x, w, target, 0, eps)
        assert ref[2][37:].abs().max() == 0
        for chunk, weighted in ((1, False), (4, False), (21, True), (256, False), (4, True)):
            got = _head(x, w, target, chunk, eps, weighted=weighted)
            for name, a, b in zip(("loss", "dX", "dW"), got, ref):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol,
                                           msg=f"{name} chunk={chunk} eps={eps} {weighted=}")


def test_weight_gradient_deferred_to_the_store():
    """Inside a capturing store the weight gradient is queued (none until its W runs, which
    recomputes the logits) and then equals the inline one; dX comes at once."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 2, 16, generator=g), torch.randn(40, 16, generator=g)
    target = torch.randint(0, 37, (9, 2), generator=g)
    ref = _head(x, w, target, 4, 0.0)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    store = WeightGradStore()
    with store.capture() as queue:
        linear_cross_entropy(xd, wd, target, vocab_size=37, chunk_tokens=4,
                             store=store).mul(torch.linspace(0.5, 1.5, 18).view(9, 2)).sum() \
            .backward()
    assert wd.grad is None and len(queue) == 1
    torch.testing.assert_close(xd.grad, ref[1], rtol=0, atol=0)
    queue[0]()
    torch.testing.assert_close(wd.grad, ref[2], rtol=0, atol=0)


def _tp_worker(rank, world_size):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 17), generator=g)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    done = []
    for family in ("gpt2", "llama"):  # tied and untied output weights
        ref = GPTModel(tiny_config(family), ParallelState(), seed=7,
                       execution=ExecutionConfig(cross_entropy_chunk_tokens=0))
        ref_loss = ref(tokens, labels=labels)
        (ref_loss * torch.linspace(0.5, 1.5, ref_loss.numel()).view(ref_loss.shape)).sum() \
            .backward()
        ref_grads = full_grads(ref, None)
        for sp in (False, True):
            ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
            model = GPTModel(tiny_config(family), ps, seed=7, sequence_parallel=sp,
                             execution=ExecutionConfig(cross_entropy_chunk_tokens=5))
            weights = torch.linspace(0.5, 1.5, labels.numel()).view(labels.shape)
            if sp:  # the training path: a LossOutput, gradients formed in forward
                out = model(tokens, labels=labels, loss_weights=weights)
                loss = out.token_loss
                out.loss.backward()
            else:
                loss = model(tokens, labels=labels)
                (loss * weights).sum().backward()
            finalize_model_grads(model, ps, data_parallel=False)
            where = f"{family} tp=2 sp={sp}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=where)
            assert_grads_close(full_grads(model, ps.tp_group), ref_grads, 1e-5, where)
            done.append(where)
    return done


def test_tp2_chunked_equals_one_process_whole():
    assert all(len(r) == 4 for r in run_distributed(_tp_worker, 2))


@pytest.mark.parametrize("dtype,chunk", [("bfloat16", 64), ("float32", 100)])
def test_planner_loss_head_bytes_chunked_measured(dtype, chunk):
    """planner.loss_head_bytes with chunks against the measured CPU tensor peak of the chunked
    head on the training path (loss weights given), forward and backward (dX and dW made):
    within 10%."""
    from megalite.config import ModelConfig
    from megalite.memory import PeakTensorMemory
    from megalite.planner import Model, loss_head_bytes

    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=256,
                      vocab_size=8000, params_dtype=dtype)
    dt = getattr(torch, dtype)
    x = torch.randn(256, 2, 64, dtype=dt, requires_grad=True)
    w = (0.02 * torch.randn(cfg.padded_vocab_size(1), 64, dtype=dt)).requires_grad_()
    target = torch.randint(8000, (256, 2))
    with PeakTensorMemory("cpu") as probe:
        linear_cross_entropy(x, w, target, vocab_size=8000, chunk_tokens=chunk,
                             loss_weights=torch.full((256, 2), 1 / 512))[0].backward()
    est = loss_head_bytes(Model.from_config(cfg, "cpu", loss_chunk_tokens=chunk), 2, 1, False)
    got = probe.peak_bytes - probe.baseline
    assert abs(got / est - 1) < 0.10, (got, est)
