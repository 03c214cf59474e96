"""Sliding-window attention: the blocked kernel against SDPA with the full [s, s] band mask.

    python benchmarks/sliding_window.py                        # CPU defaults below
    python benchmarks/sliding_window.py --device cuda --seq 32768 --window 4096 --heads 32

Times forward + backward of ``megalite.masks.sliding_window_attention`` and of one
SDPA call with the [s, s] boolean mask it replaces (what windowed layers ran before), on the same
random q, k, v (fp32 on CPU, bf16 on CUDA), and checks that both give the same output. Prints the
median over --rounds of each, their ratio and the bytes of each mask (docs/models.md, "Sliding
window").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megalite.masks import sliding_window_attention  # noqa: E402


def _masked(q, k, v, window):
    i = torch.arange(q.shape[2], device=q.device)
    gap = i[:, None] - i[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < window))


def _time(fn, q, k, v, window, rounds):
    times = []
    for _ in range(rounds + 1):  # the first is warm-up
        q.grad = k.grad = v.grad = None
        if q.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(q, k, v, window).float().sum().backward()
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.batch, a.heads, a.seq, a.head_dim, generator=g).to(a.device, dtype)
               .requires_grad_() for _ in range(3))
    with torch.no_grad():
        diff = (sliding_window_attention(q, k, v, a.window) - _masked(q, k, v, a.window)).abs()
    blocked = _time(sliding_window_attention, q, k, v, a.window, a.rounds)
    masked = _time(_masked, q, k, v, a.window, a.rounds)
    s, w = a.seq, a.window
    print(f"s {s} W {w} heads {a.heads} d {a.head_dim} b {a.batch} {dtype} on {a.device}: "
          f"max |blocked - masked| {diff.max().item():.1e}")
    print(f"forward+backward: blocked {blocked * 1e3:.1f} ms, full band mask {masked * 1e3:.1f} ms, "
          f"ratio {blocked / masked:.3f}; masks: blocked {w * 2 * w if s > 2 * w else s * s} "
          f"bytes, full {s * s} bytes")


if __name__ == "__main__":
    main()
