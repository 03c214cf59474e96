"""What the collective record costs (docs/clusters.md, "When a run hangs"): the step time of a
training run with it on against off.

    OMP_NUM_THREADS=1 python benchmarks/collective_record.py [--tp 2] [--pp 1] [--rounds N]

Starts ``tp x pp`` gloo CPU processes running pretrain's training loop on a small GPT (mock data)
and times each ``Trainer.train_step`` (forward-backward over the global batch and the optimizer
step; wall clock, and the process's CPU time, which load from other processes blurs less); the
record and its labels are switched on and off step by step (``collective_record.enable``, and
``label`` a no-op; on, off, off, on, ...), so load from other processes hits both alike. After
``--warmup`` steps: the median step time of each and their ratio (rank 0; every rank runs the same
steps); and what load cannot blur, the time spent inside the record's functions (``issue``,
``complete``, the labels' enter and exit, each clocked) as a share of the steps with it on, and
the collectives per step times the cost of one entry timed alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _worker(rank, world, argv, warmup):
    import contextlib

    from megalite import collective_record as R
    from megalite import training
    from megalite.arguments import parse_args

    real, seqs = training.Trainer.train_step, []
    times = {(on, clock): [] for on in (True, False) for clock in ("wall", "cpu", "inside")}
    labels = {True: R.label, False: contextlib.nullcontext}  # off: no label either
    inside = [0.0]  # seconds spent in the record's functions, over the timed steps

    def clocked(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start
        return call

    R.issue, R.complete = clocked(R.issue), clocked(R.complete)
    R.label.__enter__, R.label.__exit__ = clocked(R.label.__enter__), clocked(R.label.__exit__)

    def timed(self, batches):
        on = self.iteration % 4 in (0, 3)  # on, off, off, on: a drift in load cancels
        R.enable(on)
        R.label = labels[on]
        seq, before = R._state["seq"], inside[0]
        start, cpu = time.perf_counter(), time.process_time()
        out = real(self, batches)
        if self.iteration >= warmup:
            times[on, "wall"].append(time.perf_counter() - start)
            times[on, "cpu"].append(time.process_time() - cpu)
            if on:
                seqs.append(R._state["seq"] - seq)
                times[on, "inside"].append(inside[0] - before)
        return out

    training.Trainer.train_step = timed
    training.pretrain(parse_args(argv))
    R.enable(True)
    R.label = labels[True]
    return times, seqs


def entry_cost_us(n: int = 200_000) -> float:
    """One ``issue`` + ``complete`` pair, on this process (no collective)."""
    import torch

    from megalite import collective_record as R

    t, group = torch.zeros(4), (0, 1)
    start = time.perf_counter()
    for _ in range(n):
        R.complete(R.issue("all_reduce", "tp_all_reduce", group, t.shape, t.dtype))
    return (time.perf_counter() - start) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20,
                    help="timed steps with the record on (and as many off)")
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dist_utils import run_distributed

    iters = args.warmup + 2 * args.rounds
    flags = ["--mock-data", "--num-layers", args.layers, "--hidden-size", args.hidden,
             "--num-attention-heads", 4, "--seq-length", args.seq, "--vocab-size", 1024,
             "--micro-batch-size", 2, "--global-batch-size", 8, "--train-iters", iters,
             "--log-interval", iters, "--eval-interval", 10 * iters, "--eval-iters", 1, "--lr",
             "1e-3", "--no-log-throughput", "--no-log-planner-estimate",
             "--tensor-model-parallel-size", args.tp, "--pipeline-model-parallel-size", args.pp]
    times, seqs = run_distributed(_worker, args.tp * args.pp, [str(f) for f in flags],
                                  args.warmup, timeout=3600)[0]
    on, off = (statistics.median(times[k, "wall"]) for k in (True, False))
    cpu_on, cpu_off = (statistics.median(times[k, "cpu"]) for k in (True, False))
    inside = sum(times[True, "inside"]) / sum(times[True, "wall"])
    entry, n = entry_cost_us(), statistics.median(seqs)
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, TP{args.tp} x "
          f"PP{args.pp} on gloo CPU, 4 micro-batches of 2; rank 0, median of {len(seqs)} "
          f"steps each, alternated")
    print(f"record on: {1000 * on:.1f} ms/step, off: {1000 * off:.1f} ms/step, on/off "
          f"{on / off:.4f}; the process's CPU time on/off {cpu_on / cpu_off:.4f}; time inside "
          f"the record's functions {100 * inside:.2f}% of the steps; {n:.0f} "
          f"collectives per step x {entry:.2f} us per entry = {100 * n * entry * 1e-6 / off:.3f}% "
          "of the step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
