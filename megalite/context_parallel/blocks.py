"""One block of context-parallel attention and the kernels that compute it
(docs/context_parallel.md, "Kernels").

The ring and all-gather paths (``attention.py``) cut a rank's attention into blocks of queries
against a range of keys, each either square-causal or unmasked, and merge the blocks' partial
outputs by their log-sum-exp. Every kernel here has the same two functions:

* ``fwd(q, k, v, causal, scale) -> (out, lse)``: q [b, n, sq, d], k and v [b, g, sk, d] (g divides
  n: grouped-query attention, K/V at their own head count); out [b, n, sq, d] in q's dtype, lse
  [b, n, sq] in fp32.
* ``bwd(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` given the *merged* out and lse
  of the rows, so that P = exp(S - lse) is this block's share of the whole softmax and the
  blocks' gradients sum to those of the whole attention; dk and dv at k's head count.

The kernels: ``MATH`` (q·kᵀ and an fp32 softmax: exact, the reference of every test and
``--cp-attention-kernel math``), ``CPU_FLASH`` (torch's fused CPU kernel, for CPU tensors) and,
on CUDA, ``FLASH``, ``CUDNN`` and ``EFFICIENT`` (the SDPA kernels that return the log-sum-exp;
each has its own lse layout, converted here). ``select`` picks one; on CUDA the first that fits
the dtype and head dim and passes ``self_check`` on first use, one warning line for each that
does not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

_aten = torch.ops.aten


@dataclass(frozen=True)
class BlockKernel:
    """A kernel given as its two functions (see the module doc for their contract)."""

    name: str
    fwd: Callable
    bwd: Callable


# ---- MATH: the exact reference ----

def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, n, ...] -> [b, g, n/g, ...] in fp32: query head h belongs to K/V group h // (n/g)."""
    return t.float().unflatten(1, (groups, -1))


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """[b, g, n/g, sq, sk] fp32 scores; each group's K broadcasts over its query heads, so K is
    never copied per query head. ``causal``: the top-left aligned mask (square blocks only)."""
    s = _grouped(q, k.shape[1]) @ k.float().unsqueeze(2).transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


def _math_fwd(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    out = (s - lse.unsqueeze(-1)).exp() @ v.float().unsqueeze(2)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _math_bwd(dout, q, k, v, out, lse, causal, scale):
    g = k.shape[1]
    p = (_scores(q, k, causal, scale) - _grouped(lse, g).unsqueeze(-1)).exp()
    do = _grouped(dout, g)
    dp = do @ v.float().unsqueeze(2).transpose(-1, -2)
    ds = p * (dp - (do * _grouped(out, g)).sum(-1, keepdim=True)) * scale
    dq = ds @ k.float().unsqueeze(2)
    # a group's K/V gradient is the sum over its query heads
    dk, dv = (ds.transpose(-1, -2) @ _grouped(q, g)).sum(2), (p.transpose(-1, -2) @ do).sum(2)
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


MATH = BlockKernel("math", _math_fwd, _math_bwd)


# ---- CPU_FLASH: returns lse [b, n, sq] fp32 (also for bf16) and takes fewer K/V heads ----

def _cpu_fwd(q, k, v, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_bwd(dout, q, k, v, out, lse, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


CPU_FLASH = BlockKernel("cpu_flash", _cpu_fwd, _cpu_bwd)


# ---- the CUDA SDPA kernels that return the log-sum-exp ----

@dataclass(frozen=True)
class FusedKernel:
    """A CUDA SDPA kernel: its raw forward and backward ops and what adapts them to the block
    contract (lse layout, GQA). ``fwd_op(q, k, v, causal, scale) -> (out, lse in the kernel's
    layout)``; ``bwd_op(dout, q, k, v, out, lse in the kernel's layout, causal, scale) ->
    (dq, dk, dv)``. ``gqa``: the kernel takes fewer K/V heads itself; otherwise K/V are expanded to
    one head per query head in the compute dtype (never fp32) and dK/dV summed back per group."""

    name: str
    fwd_op: Callable
    bwd_op: Callable
    lse_from: Callable  # (kernel's lse, sq) -> [b, n, sq]
    lse_to: Callable  # [b, n, sq] -> the kernel's layout
    gqa: bool
    dtypes: tuple
    max_head_dim: Optional[int]

    def fits(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """The kernel's dtype and head-dim rule (16-byte aligned rows: d a multiple of 8)."""
        d = q.shape[-1]
        return (q.dtype in self.dtypes and d % 8 == 0
                and (self.max_head_dim is None or d <= self.max_head_dim))

    def _kv(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        if self.gqa or rep == 1:
            return k, v
        return k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def fwd(self, q, k, v, causal, scale):
        out, lse = self.fwd_op(q, *self._kv(q, k, v), causal, scale)
        return out, self.lse_from(lse, q.shape[2])

    def bwd(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = self.bwd_op(dout, q, *self._kv(q, k, v), out, self.lse_to(lse), causal,
                                 scale)
        if dk.shape[1] != k.shape[1]:  # expanded: sum each group's query heads
            dk, dv = (t.unflatten(1, (k.shape[1], -1)).sum(2) for t in (dk, dv))
        return dq, dk, dv


# lse layouts (torch/_meta_registrations.py gives each kernel's): flash [b, n, sq]; efficient
# [b, n, ceil(sq/32)*32] on CUDA (sq on ROCm); cuDNN [b, n, sq, 1]. A merged lse arrives as a
# strided view (some of a rank's rows); the kernels index it as dense.
_EFFICIENT_ROWS = 1 if torch.version.hip else 32


def lse_unpad(lse: torch.Tensor, sq: int) -> torch.Tensor:
    """The first ``sq`` rows of a row-padded lse (efficient's layout) -> [b, n, sq]."""
    return lse[..., :sq]


def lse_pad(lse: torch.Tensor, multiple: int = _EFFICIENT_ROWS) -> torch.Tensor:
    """[b, n, sq] -> dense [b, n, ceil(sq/multiple)*multiple], the padding rows 0."""
    return torch.nn.functional.pad(lse, (0, -lse.shape[-1] % multiple))  # a new dense tensor


def lse_squeeze(lse: torch.Tensor, sq: int) -> torch.Tensor:
    """cuDNN's [b, n, sq, 1] -> [b, n, sq]."""
    return lse.reshape(lse.shape[0], lse.shape[1], sq)


def lse_unsqueeze(lse: torch.Tensor) -> torch.Tensor:
    """[b, n, sq] -> dense [b, n, sq, 1] (cuDNN's)."""
    return lse.contiguous().unsqueeze(-1)


def _no_rng(device, flash: bool):
    """The philox seed and offset a backward takes; dropout is 0, so they are never read. Shaped
    as the forward returns them (flash on CUDA: uint64 [2] and []; otherwise int64 scalars)."""
    if flash and not torch.version.hip:
        return (torch.empty(2, dtype=torch.uint64, device=device),
                torch.empty((), dtype=torch.uint64, device=device))
    return tuple(torch.empty((), dtype=torch.long, device=device) for _ in range(2))


def _flash_fwd(q, k, v, causal, scale):
    out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _flash_bwd(dout, q, k, v, out, lse, causal, scale):
    # not varlen: no cumulative sequence lengths, max lengths the block's own
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
        *_no_rng(q.device, True), scale=scale)


def _efficient_fwd(q, k, v, causal, scale):
    out, lse, *_ = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                 scale=scale)
    return out, lse


def _efficient_bwd(dout, q, k, v, out, lse, causal, scale):
    return _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, *_no_rng(q.device, False), 0.0, [True, True, True, False],
        causal, scale=scale)[:3]


def _cudnn_fwd(q, k, v, causal, scale):
    out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False,
        scale=scale)
    return out, lse


def _cudnn_bwd(dout, q, k, v, out, lse, causal, scale):
    # dense inputs: cuDNN's backward wants out and dout laid out alike
    return _aten._scaled_dot_product_cudnn_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse,
        *_no_rng(q.device, False), None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale)


_HALF = (torch.float16, torch.bfloat16)
FLASH = FusedKernel("flash", _flash_fwd, _flash_bwd, lambda lse, sq: lse,
                    lambda lse: lse.contiguous(), gqa=True, dtypes=_HALF, max_head_dim=256)
CUDNN = FusedKernel("cudnn", _cudnn_fwd, _cudnn_bwd, lse_squeeze, lse_unsqueeze, gqa=False,
                    dtypes=_HALF, max_head_dim=128)
EFFICIENT = FusedKernel("efficient", _efficient_fwd, _efficient_bwd, lse_unpad, lse_pad,
                        gqa=False, dtypes=_HALF + (torch.float32,), max_head_dim=None)
CUDA_KERNELS = (FLASH, CUDNN, EFFICIENT)  # the order of preference


# ---- choosing one ----

# Self-check tolerance, max |error| over max |reference|: a wrong layout or mask is off by O(1).
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def block_errors(kernel, q, k, v, dout, causal: bool, scale: float) -> list:
    """(out, lse, dq, dk, dv) of ``kernel`` against MATH on the same inputs, each as max |error|
    over max |reference| (a 0-d fp32 tensor each, no host read); both backwards are given MATH's
    out and lse, as strided views. A shape that differs raises ValueError."""
    ref = MATH.fwd(q, k, v, causal, scale)
    got = kernel.fwd(q, k, v, causal, scale)
    sq = q.shape[2]  # out and lse as the ring passes them: some rows of larger tensors
    merged = (torch.cat([ref[0]] * 2, 2)[:, :, :sq], torch.cat([ref[1]] * 2, 2)[:, :, :sq])
    got += tuple(kernel.bwd(dout, q, k, v, *merged, causal, scale))
    ref += tuple(MATH.bwd(dout, q, k, v, *merged, causal, scale))
    errs = []
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if a.shape != b.shape:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, want {tuple(b.shape)}")
        errs.append((a.float() - b.float()).abs().max() / b.float().abs().max())
    return errs


@torch.no_grad()
def self_check(kernel, q: torch.Tensor, k: torch.Tensor) -> Optional[str]:
    """None if ``kernel`` matches MATH on small random tensors of q's device, dtype and head dim and
    q/k's heads per K/V group, forward and backward, on a causal square block and on unmasked
    blocks of fewer and of more queries than keys, each a strided view as the ring passes them;
    else why not. One host read."""
    d, rep, dev = q.shape[-1], q.shape[1] // k.shape[1], q.device
    gen = torch.Generator(device=dev).manual_seed(0)
    # 80 rows: not a multiple of 32, so a row-padded lse (efficient's) shows if left padded
    qq, do = (torch.randn(1, 2 * rep, 80, d, device=dev, generator=gen).to(q.dtype)
              for _ in range(2))
    kk, vv = (torch.randn(1, 2, 80, d, device=dev, generator=gen).to(q.dtype) for _ in range(2))
    try:
        errs = []
        for rows, keys, causal in ((slice(None), slice(None), True),
                                   (slice(16, None), slice(None), False),
                                   (slice(None), slice(8, 56), False)):
            errs += block_errors(kernel, qq[:, :, rows], kk[:, :, keys], vv[:, :, keys],
                                 do[:, :, rows], causal, d ** -0.5)
        worst = float(torch.stack(errs).max())
    except Exception as e:  # noqa: BLE001 - any failure of the kernel means: do not use it
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    tol = _TOLERANCE.get(q.dtype, 1e-3)
    return None if worst <= tol else f"max relative error {worst:.1e} > {tol:.0e}"


def first_passing(candidates: Sequence, q: torch.Tensor, k: torch.Tensor, fallback=MATH):
    """The first of ``candidates`` that passes ``self_check`` on tensors like q, k, else
    ``fallback``; one warning line for each candidate that fails."""
    for i, kernel in enumerate(candidates):
        why = self_check(kernel, q, k)
        if why is None:
            return kernel
        then = candidates[i + 1].name if i + 1 < len(candidates) else fallback.name
        warnings.warn(f"context-parallel attention: the {kernel.name} kernel failed its "
                      f"self-check on {str(q.dtype).removeprefix('torch.')}, head dim "
                      f"{q.shape[-1]} ({why}); using {then}", RuntimeWarning, stacklevel=2)
    return fallback


_CHOSEN: dict = {}  # (device, dtype, head dim, heads per K/V group, candidates) -> a kernel


def select(q: torch.Tensor, k: torch.Tensor, setting: str = "auto"):
    """The kernel for blocks of this q, k. ``setting`` (--cp-attention-kernel): ``math``, or
    ``auto``: CPU_FLASH on the CPU, on CUDA the first of CUDA_KERNELS that fits and passes its
    self-check (``checked``), MATH on any other device."""
    if setting == "math":
        return MATH
    if q.device.type == "cpu":
        return CPU_FLASH
    return checked(q, k, CUDA_KERNELS) if q.device.type == "cuda" else MATH


def checked(q: torch.Tensor, k: torch.Tensor, candidates: tuple):
    """The first of ``candidates`` that fits q, k and passes ``self_check``, else MATH: decided
    once per device, dtype, head dim and heads per K/V group (the self-check's one host read and
    any warning come on first use only)."""
    key = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1], candidates)
    if key not in _CHOSEN:
        _CHOSEN[key] = first_passing([c for c in candidates if c.fits(q, k)], q, k)
    return _CHOSEN[key]
