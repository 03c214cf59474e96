"""A sliding window under ring and all-gather context parallelism on the CPU: what the blocks a
window leaves empty save (docs/context_parallel.md, "Sliding window").

    OMP_NUM_THREADS=1 python benchmarks/cp_window.py   # C 4, s 2048, windows 128 and 512

Forward + backward of ``context_parallel_attention`` on --cp gloo processes (one thread each),
[1, --heads, s/C, --head-dim] fp32 per rank, with each --window against the same call without
one (causal), per comm type; medians of --rounds of each rank's CPU time (time.thread_time: its
compute, not its waits), summed over the ranks, and the ring's parts (pairs of chunks) each rank
skips.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]


def _worker(rank, size, a):
    import torch

    from context_parallel import measure
    from megalite import masks
    from megalite.context_parallel.attention import context_parallel_attention
    from megalite.context_parallel.sharding import shard

    torch.set_num_threads(1)
    group = torch.distributed.new_group(list(range(size)))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, a.heads, a.seq, a.head_dim, generator=gen) for _ in range(3)]
    q, k, v = (shard(t, rank, size, 2).requires_grad_() for t in full)
    cpu, skipped = {}, {}
    for comm in a.comm:
        for w in [None] + a.window:
            masks._WINDOW_BLOCKS.clear()

            def step():
                context_parallel_attention(q, k, v, group, comm, window=w).sum().backward()

            cpu[comm, w] = measure(step, a.rounds, group, warmup=1)["cpu_s"]
            skipped[comm, w] = sum(isinstance(x, str) for x in masks._WINDOW_BLOCKS.values())
    return cpu, skipped


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--window", type=int, nargs="+", default=[128, 512])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--comm", nargs="+", default=["p2p", "allgather"])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    from dist_utils import run_distributed

    ranks = run_distributed(_worker, a.cp, a, timeout=3600)
    print(f"CP {a.cp}, s {a.seq}, {a.heads} heads of {a.head_dim}, fp32, forward + backward; CPU "
          f"ms summed over ranks (median of {a.rounds}); decisions skipped, all ranks")
    print("| comm | window | CPU ms | / causal | skipped |\n|---|---|---|---|---|")
    for comm in a.comm:
        causal = sum(r[0][comm, None] for r in ranks)
        for w in [None] + a.window:
            t = sum(r[0][comm, w] for r in ranks)
            print(f"| {comm} | {w or '-'} | {t * 1e3:.0f} | {t / causal:.3f} | "
                  f"{sum(r[1][comm, w] for r in ranks) if w else '-'} |")


if __name__ == "__main__":
    main()
