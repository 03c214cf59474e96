"""The fast paths (docs/performance.md) against their reference formulas: values and gradients.

Each reference is written here the plain way (the way the model computed it before), so a fast
path that drifts from the math fails here rather than only in a throughput table.
"""

import pytest
import torch
import torch.nn.functional as F

from megalite.models.norms import RMSNorm
from megalite.models.rotary import RotaryEmbedding, apply_rotary
from megalite.masks import sliding_window_attention
from megalite.models.transformer import swiglu, swiglu_fused
from megalite.tensor_parallel import cross_entropy as ce
from model_utils import tiny_config

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _value_and_grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    weights = torch.linspace(0.5, 1.5, out.numel()).view(out.shape).to(out.dtype)
    (out.float() * weights.float()).sum().backward()
    return [out.detach()] + [t.grad for t in inputs if t.requires_grad]


def _assert_all_close(got, ref, dtype):
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_in_compute_dtype_matches_fp32_formula(dtype):
    norm = RMSNorm(64, eps=1e-6, params_dtype=dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g).to(dtype) * 3
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)

    def reference(x, w):  # upcast, normalise in fp32, cast back, scale
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    ref = _value_and_grads(reference, x, w)
    got = _value_and_grads(lambda x, w: F.rms_norm(x, (64,), w, 1e-6), x, w)
    assert got[0].dtype == dtype  # no fp32 activation is handed on
    if dtype == torch.float32:
        _assert_all_close(got, ref, dtype)
    else:  # bf16: at least as close to the float64 truth as the reference is
        truth = _value_and_grads(reference, x.double(), w.double())
        for g, r, t in zip(got, ref, truth):
            err = lambda a: (a.double() - t).abs().max().item()  # noqa: E731
            assert err(g) <= 1.5 * err(r) + 1e-3, (err(g), err(r))
    with torch.no_grad():
        norm.weight.copy_(w)
    torch.testing.assert_close(norm(x), got[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_without_concatenation_matches_rotate_half(dtype):
    rope = RotaryEmbedding(16, base=500.0)
    s = 12
    x = torch.randn(s, 2, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    pos = torch.arange(s, dtype=torch.float32)
    freqs = torch.outer(pos, rope.inv_freq)
    emb = torch.cat([freqs, freqs], -1)[:, None, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def reference(x):  # Hugging Face Llama's form
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    got = _value_and_grads(lambda x: apply_rotary(x, *rope(s, x.device, dtype)), x)
    _assert_all_close(got, _value_and_grads(reference, x), dtype)
    # cached per (device, dtype): a shorter sequence is a slice of the longer table
    c4, s4 = rope(4, x.device, dtype)
    assert c4.shape[0] == 4 and c4.data_ptr() == rope(s, x.device, dtype)[0].data_ptr()
    assert rope(s, x.device, torch.float64)[0].dtype == torch.float64
    # one table per model, not per layer: every layer's instance with the same frequencies reads
    # the same storage; other frequencies get their own
    assert RotaryEmbedding(16, base=500.0)(s, x.device, dtype)[0].data_ptr() == c4.data_ptr()
    other = RotaryEmbedding(16, base=1000.0)(s, x.device, dtype)[0]
    assert other.data_ptr() != c4.data_ptr() and not torch.equal(other[:4], c4)


def test_swiglu_matches_its_formula():
    """swiglu_fused (the reference on CPU) against silu(g) u = g sigmoid(g) u, written out;
    gradients included (on a GPU the fused kernel is held to the reference just below)."""
    h = torch.randn(4, 3, 20, generator=torch.Generator().manual_seed(3))
    formula = lambda h: h[..., :10] * torch.sigmoid(h[..., :10]) * h[..., 10:]  # noqa: E731
    _assert_all_close(_value_and_grads(swiglu_fused, h), _value_and_grads(formula, h),
                      torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused SwiGLU kernel is CUDA-only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_matches_reference_on_cuda(dtype):
    h = torch.randn(64, 4, 256, device="cuda").to(dtype)
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: TOL[torch.bfloat16]}[dtype]
    for g, r in zip(_value_and_grads(swiglu_fused, h), _value_and_grads(swiglu, h)):
        torch.testing.assert_close(g.float(), r.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_cross_entropy_matches_torch_and_keeps_only_the_logits(dtype, monkeypatch):
    monkeypatch.setattr(ce, "BLOCK_ELEMENTS", 3 * 48)  # 3 rows per block: 5 blocks of 13 rows
    vocab, padded = 45, 48
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(13, 1, padded, generator=g) * 4).to(dtype)
    logits[..., vocab:] = 1000.0  # padding must not count
    target = torch.randint(0, vocab, (13, 1), generator=g)
    x = logits.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = ce.vocab_parallel_cross_entropy(x, target, vocab_size=vocab, label_smoothing=0.1)
    (loss * torch.linspace(0.5, 1.5, 13).view(13, 1)).sum().backward()
    # Saved for backward: the logits themselves (no fp32 copy) plus per-token vectors.
    assert sum(t.numel() for t in saved if t.dim() > 1) == logits.numel()
    assert all(t.data_ptr() == x.data_ptr() for t in saved if t.dim() > 1)
    assert x.grad.dtype == dtype and (x.grad[..., vocab:] == 0).all()
    ref_x = logits[..., :vocab].float().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_x.view(-1, vocab), target.view(-1), reduction="none",
                          label_smoothing=0.1).view(13, 1)
    (ref * torch.linspace(0.5, 1.5, 13).view(13, 1)).sum().backward()
    # The loss is fp32 from exactly upcast logits in both dtypes; a bf16 gradient is rounded once.
    torch.testing.assert_close(loss, ref.detach(), **TOL[torch.float32])
    torch.testing.assert_close(x.grad[..., :vocab].float(), ref_x.grad, **TOL[dtype])


def test_use_apex_needs_cuda_and_is_never_imported_on_cpu():
    import sys

    from megalite.config import ConfigError, ExecutionConfig
    from megalite.models.gpt import GPTModel
    from megalite.parallel_state import ParallelState

    with pytest.raises(ConfigError, match="^--use-apex needs a CUDA device"):
        GPTModel(tiny_config("llama"), ParallelState(device=torch.device("cpu")),
                 execution=ExecutionConfig(use_apex=True))
    assert "apex" not in sys.modules


@pytest.mark.parametrize("family,backend", [("llama", "aot_eager"), ("gpt2", "inductor")])
def test_compiled_layers_match_eager(family, backend):
    """--torch-compile: the same model with each layer compiled gives the eager losses and
    gradients. aot_eager runs the traced graphs op by op (same kernels as eager, so tight
    agreement); inductor generates fused kernels (fp32 rounding differs slightly)."""
    from megalite.config import ExecutionConfig
    from megalite.models.gpt import GPTModel
    from megalite.parallel_state import ParallelState

    ps = ParallelState(device=torch.device("cpu"))
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(4))
    out = []
    for compile_backend in (None, backend):
        model = GPTModel(tiny_config(family, num_layers=1), ps, seed=7,
                         execution=ExecutionConfig(torch_compile=compile_backend))
        for _ in range(2):  # the second call runs the cached graph
            model.zero_grad()
            loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
            loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = out
    tol = dict(rtol=1e-6, atol=1e-7) if backend == "aot_eager" else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, **tol)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-side init draw needs CUDA")
def test_cuda_init_is_deterministic_and_distributed_like_the_cpu_draw():
    """megalite/models/init.py draws on the parameter's device: on CUDA a different sample from
    the CPU's, but the same on every build (every rank) and with the same spread."""
    from megalite.models.gpt import GPTModel
    from megalite.parallel_state import ParallelState

    def build(dev):
        dev = torch.device(dev)
        model = GPTModel(tiny_config("llama", hidden_size=256, ffn_hidden_size=512), ParallelState(
            device=dev), seed=3, device=dev)
        return {n: p.detach().float().cpu() for n, p in model.named_parameters()}

    a, b, cpu = build("cuda"), build("cuda"), build("cpu")
    for name in cpu:
        assert torch.equal(a[name], b[name]), name
        if cpu[name].numel() >= 10000:
            assert abs(a[name].std() / cpu[name].std() - 1) < 0.05, name


@pytest.mark.parametrize("s,window,heads,groups", [(70, 5, 4, 2), (64, 16, 2, 2), (33, 6, 4, 4),
                                                   (12, 6, 2, 1)])
def test_blocked_sliding_window_attention_matches_the_masked_formula(s, window, heads, groups):
    """Query i sees keys i - W < j <= i: the blocked kernel (s x 2W scores; s not a multiple of W,
    GQA, and s <= 2W, where it is one masked SDPA) against SDPA with the full [s, s] mask."""
    g = torch.Generator().manual_seed(s)
    q = torch.randn(2, heads, s, 8, generator=g)
    k, v = (torch.randn(2, groups, s, 8, generator=g) for _ in range(2))
    i = torch.arange(s)
    mask = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < window)

    def reference(q, k, v):
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def blocked(q, k, v):
        return sliding_window_attention(q, k, v, window, enable_gqa=heads != groups)

    _assert_all_close(_value_and_grads(blocked, q, k, v), _value_and_grads(reference, q, k, v),
                      torch.float32)
