"""One block of context-parallel attention and the kernels that compute it: the block contract
(``fwd``/``bwd`` with the log-sum-exp), MATH, CPU_FLASH, the CUDA kernels and their self-check
are docs/context_parallel.md, "Kernels"."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megalite import torch_private as P


@dataclass(frozen=True)
class BlockKernel:
    """A kernel given as its two functions (the contract: docs/context_parallel.md, "Kernels")."""

    name: str
    fwd: Callable
    bwd: Callable

    def fits(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        return True


# ---- MATH: the exact reference ----

def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, n, ...] -> [b, g, n/g, ...] in fp32: query head h belongs to K/V group h // (n/g)."""
    return t.float().unflatten(1, (groups, -1))


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """[b, g, n/g, sq, sk] fp32 scores; each group's K broadcasts over its query heads, so K is
    never copied per query head. ``causal``: the top-left aligned mask (square blocks only), or
    a [b, 1, sq, sk] bool tensor, True where a query sees a key (packed documents)."""
    s = _grouped(q, k.shape[1]) @ k.float().unsqueeze(2).transpose(-1, -2) * scale
    if isinstance(causal, torch.Tensor):
        s = s.masked_fill(~causal.unsqueeze(2), float("-inf"))
    elif causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


def _math_fwd(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    # a query that sees no key here (documents): lse -inf, its output 0, not NaN
    out = (s - lse.clamp_min(torch.finfo(lse.dtype).min).unsqueeze(-1)).exp() @ v.float(
        ).unsqueeze(2)
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
CPU_FLASH = BlockKernel("cpu_flash", P.cpu_flash_fwd, P.cpu_flash_bwd)


# ---- a block under a packed-documents mask ([b, 1, sq, sk] bool, True where a query sees a key)

def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def _cpu_flash_masked_fwd(q, k, v, mask, scale):
    # a query that sees no key comes back with out 0 but lse 0, which the merge would count
    out, lse = P.cpu_flash_fwd(q, k, v, False, scale, _additive(mask, q.dtype))
    return out, lse.masked_fill(~mask.any(-1), float("-inf"))


def _cpu_flash_masked_bwd(dout, q, k, v, out, lse, mask, scale):
    return P.cpu_flash_bwd(dout, q, k, v, out, lse, False, scale, _additive(mask, q.dtype))


CPU_FLASH_MASKED = BlockKernel("cpu_flash_masked", _cpu_flash_masked_fwd, _cpu_flash_masked_bwd)


def masked(kernel) -> BlockKernel:
    """The kernel for masked blocks where ``kernel`` runs the others: CPU_FLASH with the mask
    (about 2x faster than MATH here, benchmarks/documents.py), else MATH (the CUDA kernels take
    no mask)."""
    return CPU_FLASH_MASKED if kernel is CPU_FLASH else MATH


# ---- the CUDA SDPA kernels that return the log-sum-exp ----

@dataclass(frozen=True)
class FusedKernel:
    """A CUDA SDPA kernel: its raw ops (torch_private; lse in the kernel's own layout) and what
    adapts them to the block contract. Without ``gqa`` K/V are expanded per query head in the
    compute dtype (never fp32) and dK/dV summed back per group."""

    name: str
    fwd_op: Callable
    bwd_op: Callable
    lse_from: Callable  # (kernel's lse, sq) -> [b, n, sq]
    lse_to: Callable  # [b, n, sq] -> the kernel's layout
    gqa: bool
    dtypes: tuple
    max_head_dim: Optional[int]

    def fits(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        # 16-byte aligned rows: d a multiple of 8
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


# lse layouts: docs/context_parallel.md, "Kernels". A merged lse arrives as a strided view (some
# of a rank's rows); the kernels index it as dense.
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


_HALF = (torch.float16, torch.bfloat16)
FLASH = FusedKernel("flash", P.flash_fwd, P.flash_bwd, lambda lse, sq: lse,
                    lambda lse: lse.contiguous(), gqa=True, dtypes=_HALF, max_head_dim=256)
CUDNN = FusedKernel("cudnn", P.cudnn_fwd, P.cudnn_bwd, lse_squeeze, lse_unsqueeze, gqa=False,
                    dtypes=_HALF, max_head_dim=128)
EFFICIENT = FusedKernel("efficient", P.efficient_fwd, P.efficient_bwd, lse_unpad, lse_pad,
                        gqa=False, dtypes=_HALF + (torch.float32,), max_head_dim=None)
CUDA_KERNELS = (FLASH, CUDNN, EFFICIENT)  # the order of preference


# ---- choosing one ----

# Self-check tolerance, max |error| over max |reference|: a wrong layout or mask is off by O(1).
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def block_errors(kernel, q, k, v, dout, causal: bool, scale: float) -> list:
    """(out, lse, dq, dk, dv) of ``kernel`` against MATH, each max |error| over max |reference|
    (0-d tensors, no host read); both backwards get MATH's out and lse as strided views."""
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
    """None if ``kernel`` matches MATH on small random blocks like q, k (docs/context_parallel.md,
    "Kernels"), else why not. One host read."""
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


_CHOSEN: dict = {}  # (device, dtype, head dim, heads per K/V group, candidates) -> a kernel


def select(q: torch.Tensor, k: torch.Tensor, setting: str = "auto"):
    """The kernel for blocks of this q, k under ``--cp-attention-kernel`` ``setting``."""
    if setting == "math" or q.device.type not in ("cpu", "cuda"):
        return MATH
    return checked(q, k, (CPU_FLASH,) if q.device.type == "cpu" else CUDA_KERNELS)


def checked(q: torch.Tensor, k: torch.Tensor, candidates: tuple):
    """The first of ``candidates`` that fits q, k and passes ``self_check``, else MATH, decided
    once per device, dtype, head dim and heads per K/V group; one warning line for each that
    fails."""
    key = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1], candidates)
    if key not in _CHOSEN:
        fitting = [c for c in candidates if c.fits(q, k)] + [MATH]
        for kernel, then in zip(fitting, fitting[1:]):
            why = self_check(kernel, q, k)
            if why is None:
                break
            warnings.warn(f"context-parallel attention: the {kernel.name} kernel failed its "
                          f"self-check on {str(q.dtype).removeprefix('torch.')}, head dim "
                          f"{q.shape[-1]} ({why}); using {then.name}", RuntimeWarning,
                          stacklevel=3)
        else:
            kernel = MATH
        _CHOSEN[key] = kernel
    return _CHOSEN[key]
