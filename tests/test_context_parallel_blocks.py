"""The block kernels of context-parallel attention (megalite/context_parallel/blocks.py).

MATH is the reference: it is checked against torch's SDPA and autograd, and every other kernel
against it on the device it runs on. Here that is the CPU kernel, and of the CUDA kernels all
that runs without a GPU: their lse-layout and GQA glue (on emulated ops that return each kernel's
own layouts), their calls against the ops' registered schemas (on meta tensors), the choice among
them and the self-check's fallback (forced on CPU). benchmarks/gpu_check.sh checks the CUDA
kernels themselves ("cp_blocks").
"""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from megalite.context_parallel import blocks as B

SCALE = 0.3
# (query rows, keys, causal): a square causal block and unmasked ones of fewer and more queries
SHAPES = ((6, 6, True), (4, 10, False), (10, 4, False))


def _inputs(sq, sk, dtype=torch.float32, heads=4, groups=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, heads, sq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, groups, sk, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


def _worst(kernel, dtype, groups=2):
    return max(float(e) for sq, sk, causal in SHAPES
               for e in B.block_errors(kernel, *_inputs(sq, sk, dtype, groups=groups), causal,
                                       SCALE))


@pytest.mark.parametrize("groups", [4, 2])
def test_math_is_sdpa_and_its_autograd(groups):
    """MATH's out and lse are SDPA's and the log-sum-exp of the scores; its backward, given its
    own out and lse, is autograd's gradient of SDPA (the block is then the whole attention)."""
    for sq, sk, causal in SHAPES:
        q, k, v, dout = _inputs(sq, sk, groups=groups)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE,
                                             enable_gqa=groups != 4)
        kk = k.detach().repeat_interleave(4 // groups, 1)
        s = q.detach() @ kk.transpose(-1, -2) * SCALE
        if causal:
            s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
        out, lse = B.MATH.fwd(q.detach(), k.detach(), v.detach(), causal, SCALE)
        assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(lse, s.logsumexp(-1),
                                                                     atol=1e-6)
        grads = B.MATH.bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, causal, SCALE)
        for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def test_cpu_kernel_matches_math():
    assert _worst(B.CPU_FLASH, torch.float32) < 1e-5
    assert _worst(B.CPU_FLASH, torch.float32, groups=4) < 1e-5
    assert _worst(B.CPU_FLASH, torch.bfloat16) < 2e-2  # bf16's epsilon: 7.8e-3


# Each CUDA kernel's lse layout (torch/_meta_registrations.py), written out independently of
# blocks.py: what its forward returns, and the check its backward makes of what it is given.
def _ceil32(n):
    return -(-n // 32) * 32


def _padded_with_nan(lse):  # efficient on CUDA: rows padded to a multiple of 32 (here NaN)
    pad = lse.new_full(lse.shape[:2] + (_ceil32(lse.shape[-1]) - lse.shape[-1],), float("nan"))
    return torch.cat([lse, pad], -1)


def _given_padded(lse, sq):
    assert lse.is_contiguous() and lse.shape[-1] == _ceil32(sq)
    return lse[..., :sq]


def _given_dense(lse, sq):
    assert lse.is_contiguous() and lse.shape[-1] == sq
    return lse


def _given_trailing_one(lse, sq):
    assert lse.is_contiguous() and lse.shape[2:] == (sq, 1)
    return lse[..., 0]


LAYOUTS = {"flash": (lambda lse: lse, _given_dense),
           "efficient": (_padded_with_nan, _given_padded),
           "cudnn": (lambda lse: lse.unsqueeze(-1), _given_trailing_one)}


def _emulated(kernel, seen):
    """``kernel`` with its raw CUDA ops replaced by MATH in the kernel's own lse layout and head
    count: what the glue of blocks.py does around the real ops, on CPU tensors."""
    out_layout, given = LAYOUTS[kernel.name]

    def heads(q, k):
        seen.append((k.dtype, k.shape[1]))
        assert k.dtype == q.dtype  # K/V reach the kernel in the compute dtype, never fp32
        assert kernel.gqa or k.shape[1] == q.shape[1]

    def fwd_op(q, k, v, causal, scale):
        heads(q, k)
        out, lse = B.MATH.fwd(q, k, v, causal, scale)
        return out, out_layout(lse)

    def bwd_op(dout, q, k, v, out, lse, causal, scale):
        heads(q, k)
        return B.MATH.bwd(dout, q, k, v, out, given(lse, q.shape[2]), causal, scale)

    return dataclasses.replace(kernel, fwd_op=fwd_op, bwd_op=bwd_op)


@pytest.mark.parametrize("kernel", B.CUDA_KERNELS, ids=lambda k: k.name)
def test_cuda_kernel_glue_on_emulated_ops(kernel):
    """Layout conversions and GQA: the CUDA kernels' glue gives MATH's results back from ops in
    each kernel's layout; K/V are expanded (in the compute dtype) only for a kernel without GQA."""
    seen = []
    emulated = _emulated(kernel, seen)
    assert _worst(emulated, torch.float32) < 1e-6
    assert _worst(emulated, torch.bfloat16) < 1e-2  # dK/dV summed over a group in bf16
    assert {h for _, h in seen} == ({2} if kernel.gqa else {4})
    assert {dt for dt, _ in seen} == {torch.float32, torch.bfloat16}


def test_lse_layout_conversions():
    lse = torch.randn(2, 3, 40)[..., 3:36]  # a strided view of 33 rows, as the ring passes it
    padded = B.lse_pad(lse)
    assert padded.shape == (2, 3, 64) and padded.is_contiguous()
    assert torch.equal(B.lse_unpad(padded, 33), lse) and not padded[..., 33:].any()
    assert B.lse_pad(lse[..., :32]).shape == (2, 3, 32) and B.lse_pad(lse, 1).shape == (2, 3, 33)
    one = B.lse_unsqueeze(lse)
    assert one.shape == (2, 3, 33, 1) and one.is_contiguous()
    assert torch.equal(B.lse_squeeze(one, 33), lse)


@pytest.mark.parametrize("kernel", B.CUDA_KERNELS, ids=lambda k: k.name)
def test_cuda_kernel_calls_match_the_op_schemas(kernel):
    """The real ops, on meta tensors (torch's shape functions): every argument is accepted and
    the results have the block contract's shapes and dtypes, dK/dV at the K/V head count."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 8, 48, 64, **meta), torch.empty(2, 2, 80, 64, **meta)
    for causal, kv in ((False, k), (True, k[:, :, :48])):
        out, lse = kernel.fwd(q, kv, kv, causal, SCALE)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (2, 8, 48) and lse.dtype == torch.float32
        dq, dk, dv = kernel.bwd(out, q, kv, kv, out, lse, causal, SCALE)
        assert dq.shape == q.shape and dk.shape == dv.shape == kv.shape


def test_which_kernels_fit():
    """flash and cuDNN take fp16/bf16 up to head dim 256 and 128, efficient also fp32 and any
    head dim; all need d a multiple of 8 (none fits: MATH)."""
    def fitting(dtype, d):
        q = torch.empty(1, 4, 8, d, dtype=dtype)
        return [c.name for c in B.CUDA_KERNELS if c.fits(q, q[:, :2])]

    assert fitting(torch.bfloat16, 128) == fitting(torch.float16, 64) == [
        "flash", "cudnn", "efficient"]
    assert fitting(torch.bfloat16, 192) == ["flash", "efficient"]
    assert fitting(torch.bfloat16, 320) == fitting(torch.float32, 64) == ["efficient"]
    assert fitting(torch.bfloat16, 60) == []


def test_select_by_setting_and_device():
    q, k, _, _ = _inputs(4, 4)
    assert B.select(q, k) is B.CPU_FLASH and B.select(q, k, "math") is B.MATH
    assert B.select(q.to("meta"), k.to("meta")) is B.MATH  # no fused kernel there


def _broken(name, **change):
    return dataclasses.replace(_emulated(B.EFFICIENT, []), name=name, **change)


def test_self_check_falls_back_with_one_warning_each():
    """Forced on CPU: a kernel that raises, one that returns the wrong numbers (the mask
    ignored) and one whose lse is not unpadded each fail the self-check with one warning line,
    and the first good kernel is taken; with none good, MATH. The choice is made once."""
    def raises(*a):
        raise RuntimeError("no kernel image is available for execution on the device\nmore")

    good = _emulated(B.EFFICIENT, [])
    ignores_mask = _broken("ignores_mask", fwd_op=lambda q, k, v, causal, scale: good.fwd_op(
        q, k, v, False, scale))
    candidates = (_broken("raises", fwd_op=raises), ignores_mask,
                  _broken("padded_lse", lse_from=lambda lse, sq: lse), good)
    q, k, _, _ = _inputs(8, 8, groups=1)
    for call in range(2):  # the second call is the cached choice: no warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert B.checked(q, k, candidates) is good
        lines = [str(w.message) for w in caught]
        if call == 0:
            assert len(lines) == 3 and all("\n" not in m for m in lines)
            assert "raises kernel failed its self-check on float32, head dim 8 (RuntimeError: " \
                   "no kernel image" in lines[0] and lines[0].endswith("using ignores_mask")
            assert "max relative error" in lines[1] and "lse has shape" in lines[2]
            assert lines[2].endswith("using efficient")
        else:
            assert lines == []
    with pytest.warns(RuntimeWarning, match="using math$"):
        assert B.checked(q, k, candidates[:1]) is B.MATH
    assert B.self_check(good, q, k) is None and B.self_check(B.CPU_FLASH, q, k) is None


def test_a_missing_private_op_names_itself_and_the_cpu_falls_back_to_math(monkeypatch):
    """megalite/torch_private.py: an op this torch lacks raises naming itself and the tested
    range; on the CPU the kernel's self-check then picks MATH, with one warning line."""
    from megalite import torch_private as P

    assert P._release("2.15.0+cu132") == (2, 15, 0) and P._release("2.16.0a0") == (2, 16, 0)
    with pytest.raises(RuntimeError, match=r"has no aten\._no_such_op .*tested with torch 2\.13"):
        P._aten("_no_such_op")
    missing = B.BlockKernel("cpu_flash", lambda *a: P._aten("_no_such_op")(*a), B.CPU_FLASH.bwd)
    monkeypatch.setattr(B, "CPU_FLASH", missing)
    q, k, _, _ = _inputs(8, 8)
    with pytest.warns(RuntimeWarning, match=r"cpu_flash kernel failed .*_no_such_op.*using math$"):
        assert B.select(q, k) is B.MATH
