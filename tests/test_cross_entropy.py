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


def _ce_worker(rank, world_size):
    g = torch.Generator().manual_seed(0)
    padded = 48  # multiple of 4 and of 2
    logits_full = torch.randn(5, 3, padded, generator=g) * 3
    # garbage in the padded columns must not matter
    logits_full[..., VOCAB:] = 1000.0
    target = torch.randint(0, VOCAB, (5, 3), generator=g)
    for tp in (1, 2, 4):
        ps = initialize_model_parallel(tp, 1, backend="gloo", device="cpu", set_default=False)
        for smoothing in (0.0, 0.1):
            ref_loss, ref_grad, weights = _reference(logits_full, target, smoothing)
            shard = logits_full.chunk(tp, dim=-1)[ps.tp_rank].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(shard, target, ps.tp_group, vocab_size=VOCAB,
                                                label_smoothing=smoothing)
            (loss * weights).sum().backward()
            what = f"tp={tp} smoothing={smoothing}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=what)
            full_grad = torch.zeros(5, 3, padded)
            full_grad[..., :VOCAB] = ref_grad
            expect = full_grad.chunk(tp, dim=-1)[ps.tp_rank]
            torch.testing.assert_close(shard.grad, expect, rtol=1e-5, atol=1e-6, msg=what)
    return True


def test_vocab_parallel_cross_entropy_matches_torch():
    assert all(run_distributed(_ce_worker, 4))


def test_single_process_cross_entropy_needs_no_process_group():
    logits = torch.randn(4, 2, VOCAB, requires_grad=True)
    target = torch.randint(0, VOCAB, (4, 2))
    loss = vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref)


def _tp2_worker(rank, world_size):
    """The one-pass rescaling on two ranks: each rank's share of sum exp is scaled by
    exp(local max - global max), including rows where the other rank holds the max by far and a
    rank that holds only padding (local max -inf: its share must be exactly 0)."""
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    g = torch.Generator().manual_seed(1)
    padded, tokens = 48, 10
    base = torch.randn(tokens, 1, padded, generator=g) * 3
    base[0::2, :, :24] += 40.0  # rank 0 holds every large logit of the even rows,
    base[1::2, :, 24:] += 40.0  # rank 1 of the odd ones
    weights = torch.linspace(0.5, 1.5, tokens).view(tokens, 1)
    for vocab in (37, 20):  # 20: rank 1 holds only padding
        logits = base.clone()
        logits[..., vocab:] = 1000.0  # garbage in the padded columns must not matter
        target = torch.randint(0, vocab, (tokens, 1), generator=g)
        for smoothing in (0.0, 0.1):
            ref_x = logits[..., :vocab].clone().requires_grad_(True)
            ref = F.cross_entropy(ref_x.view(-1, vocab), target.view(-1), reduction="none",
                                  label_smoothing=smoothing).view(tokens, 1)
            (ref * weights).sum().backward()
            shard = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(shard, target, ps.tp_group, vocab_size=vocab,
                                                label_smoothing=smoothing)
            (loss * weights).sum().backward()
            what = f"vocab={vocab} smoothing={smoothing}"
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6, msg=what)
            full_grad = torch.zeros(tokens, 1, padded)
            full_grad[..., :vocab] = ref_x.grad
            torch.testing.assert_close(shard.grad, full_grad.chunk(2, dim=-1)[rank], rtol=1e-5,
                                       atol=1e-6, msg=what)
    return True


def test_tp2_rescaled_sums_with_skewed_maxima_and_a_padding_only_rank():
    assert all(run_distributed(_tp2_worker, 2))


def test_compiled_block_functions_match_the_eager_reference_on_cpu(monkeypatch):
    """The CUDA path (torch.compile'd per-block math, inductor) forced on the CPU: several
    blocks of different row counts, padded columns, label smoothing, bf16 logits."""
    from megalite.tensor_parallel import cross_entropy as ce

    monkeypatch.setattr(ce, "BLOCK_ELEMENTS", 5 * 48)  # blocks of 5, 5 and 3 rows
    vocab, padded = 45, 48
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(13, 1, padded, generator=g) * 4).to(torch.bfloat16)
    logits[..., vocab:] = 1000.0
    target = torch.randint(0, vocab, (13, 1), generator=g)
    weights = torch.linspace(0.5, 1.5, 13).view(13, 1)
    out = {}
    for compiled in (False, True):
        monkeypatch.setattr(ce, "COMPILE_BLOCKS", compiled)
        x = logits.clone().requires_grad_(True)
        loss = ce.vocab_parallel_cross_entropy(x, target, vocab_size=vocab, label_smoothing=0.1)
        (loss * weights).sum().backward()
        out[compiled] = loss.detach(), x.grad
    assert ce._compiled.cache_info().currsize == 2  # both block functions went through compile
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
    # one bf16 rounding of the same fp32 value: equal, or one unit apart where exp differs in ulps
    torch.testing.assert_close(out[True][1], out[False][1], rtol=2 ** -8, atol=1e-6)
    assert (out[True][1][..., vocab:] == 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled cross entropy is CUDA's")
def test_cuda_cross_entropy_matches_the_cpu_reference():
    """CUDA's default path (compiled blocks) against the CPU's eager one: several blocks of a
    padded, bf16 shard, label smoothing; losses in fp32 agree to rounding, gradients to one bf16
    unit."""
    from megalite.tensor_parallel import cross_entropy as ce

    vocab, padded, tokens = 50000, 50048, 700  # 700 rows: 3 CUDA blocks of 335, 335 and 30
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(tokens, 1, padded, generator=g) * 4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens, 1), generator=g)
    weights = torch.linspace(0.5, 1.5, tokens).view(tokens, 1)
    out = []
    for device in ("cpu", "cuda"):
        x = logits.to(device).requires_grad_(True)
        loss = ce.vocab_parallel_cross_entropy(x, target.to(device), vocab_size=vocab,
                                               label_smoothing=0.1)
        (loss * weights.to(device)).sum().backward()
        out.append((loss.detach().cpu(), x.grad.cpu()))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1][1].float(), out[0][1].float(), rtol=2 ** -7, atol=1e-7)
