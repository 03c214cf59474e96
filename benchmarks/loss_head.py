"""The loss head, output layer + vocab-parallel cross entropy, whole logits against chunked
(tensor_parallel/cross_entropy.py's linear_cross_entropy): the peak tensor memory of forward +
backward over what was live before (x and the output weight excluded; measured without the
weight gradient, a [V, h] tensor in both), and the time of one step with it. Rounds alternate
the two paths, so drift in the shared machine's load hits both; each time is the median.

    OMP_NUM_THREADS=2 python benchmarks/loss_head.py        # V 128,256, s 2048, h 2048: ~2 min
    python benchmarks/loss_head.py --vocab 32000 --seq 512 --hidden 512 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.memory import PeakTensorMemory  # noqa: E402
from megalite.tensor_parallel import cross_entropy as ce  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-memory", action="store_true", help="time only (the probe is slow)")
    return p.parse_args(argv)


def step(path: str, x, w, target, chunk: int) -> None:
    """The training path: per-token weights (loss mask / token count) known up front."""
    weights = torch.full(target.shape, 1.0 / target.numel())
    if path == "whole":
        loss = (ce.vocab_parallel_cross_entropy(x.matmul(w.t()), target) * weights).sum()
    else:
        loss, _ = ce.linear_cross_entropy(x, w, target, chunk_tokens=chunk, loss_weights=weights)
    loss.backward()


def main(argv=None) -> dict:
    args = parse_args(argv)
    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.seq, args.batch, args.hidden, generator=g).to(dt).requires_grad_()
    w = (0.02 * torch.randn(args.vocab, args.hidden, generator=g)).to(dt).requires_grad_()
    target = torch.randint(args.vocab, (args.seq, args.batch), generator=g)
    paths = ("whole", "chunked")
    peak = {}
    w.requires_grad_(False)  # memory without the weight gradient, a [V, h] tensor either way
    for path in paths[:0] if args.no_memory else paths:
        x.grad = None
        with PeakTensorMemory("cpu") as probe:
            step(path, x, w, target, args.chunk_tokens)
        peak[path] = probe.peak_bytes - probe.baseline
    w.requires_grad_(True)
    times = {p: [] for p in paths}
    for _ in range(args.rounds):
        for path in paths:
            x.grad = None
            t0 = time.perf_counter()
            step(path, x, w, target, args.chunk_tokens)
            times[path].append(time.perf_counter() - t0)
    out = {"shape": dict(vocab=args.vocab, seq=args.seq, batch=args.batch, hidden=args.hidden,
                         dtype=args.dtype, chunk_tokens=args.chunk_tokens),
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    for path in paths:
        out[path] = {"peak_MiB": round(peak[path] / 2**20, 1) if peak else None,
                     "median_s": round(statistics.median(times[path]), 3),
                     "best_s": round(min(times[path]), 3),
                     "times_s": [round(t, 3) for t in times[path]]}
    if peak:
        out["memory_ratio"] = round(peak["chunked"] / peak["whole"], 4)
    # per-round ratios: each round runs both paths back to back, under much the same load
    out["time_ratio_median_of_rounds"] = round(statistics.median(
        c / w for c, w in zip(times["chunked"], times["whole"])), 3)
    out["time_ratio_best"] = round(out["chunked"]["best_s"] / out["whole"]["best_s"], 3)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
