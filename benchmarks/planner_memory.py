"""The planner's memory estimate against the measured peak of tensor memory, for pretrain runs.

    python benchmarks/planner_memory.py [--only NAME ...] [--out DIR]

Each case runs pretrain.py (torchrun on CPU/gloo when it needs several processes) for two
iterations of a model big enough that model states and activations dominate (8 layers, hidden
512, 8 heads, sequence 256, vocab 8192, fp32 unless noted), and reads the ``memory`` record of
metrics.jsonl: ``estimated_memory_bytes`` (megalite/planner.py, rank 0's stage) beside
``measured_memory_bytes`` (megalite.memory.PeakTensorMemory: on CPU the storages live at the
start plus the CPU allocator's highest count of live bytes, as torch.profiler's memory events
stamp it; ``torch.cuda.max_memory_allocated`` on GPU). Prints a markdown table.

pretrain.py logs rank 0 only, whose stage holds the loss head (output layer and cross entropy)
only without pipeline parallelism; each pipeline case therefore runs a second time with the
first rank of the last stage as the writer of metrics.jsonl (a row "... last stage").

The mixture-of-experts cases (a second table; EP 1 and 2 also under PP 2) add the estimate with no
dropless imbalance headroom (planner.MOE_IMBALANCE replaced by 1: every EP rank receives the
mean) beside the planner's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--mock-data", "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
        "--seq-length", "256", "--vocab-size", "8192", "--micro-batch-size", "2",
        "--train-iters", "2", "--log-interval", "2", "--eval-iters", "0", "--lr", "1e-4"]
PP = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512"]
CASES = [  # name, processes, flags
    ("single", 1, ["--global-batch-size", "4"]),
    ("TP2", 2, ["--tensor-model-parallel-size", "2", "--global-batch-size", "4"]),
    ("TP2+SP", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--global-batch-size", "4"]),
    ("PP2 1F1B", 2, PP),
    ("PP2 interleaved v=2", 2, PP + ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ("PP2 ZB-H1", 2, PP + ["--pipeline-schedule", "zb-h1"]),
    ("PP2 1F1B 5 + 3 layers", 2, PP + ["--decoder-first-pipeline-num-layers", "5"]),
    ("PP2 ZB-V", 2, PP + ["--pipeline-schedule", "zb-v"]),  # loss head on rank 0
    ("PP2 DualPipeV", 2, PP + ["--pipeline-schedule", "dualpipev"]),
    ("DP2 ZeRO-1", 2, ["--zero-stage", "1", "--global-batch-size", "8"]),
    ("DP2 ZeRO-2", 2, ["--zero-stage", "2", "--global-batch-size", "8"]),
    ("DP2 ZeRO-3", 2, ["--zero-stage", "3", "--global-batch-size", "8"]),
    # HSDP: ZeRO inside each of 2 instances of DP/2 ranks (the states of DP2's ZeRO per rank)
    *[(f"DP4 ZeRO-{z} HSDP R2", 4, ["--zero-stage", str(z), "--global-batch-size", "8",
                                     "--num-distributed-optimizer-instances", "2"])
      for z in (1, 3)],
    ("selective recompute", 1, ["--recompute-granularity", "selective",
                                "--global-batch-size", "4"]),
    ("full recompute", 1, ["--recompute-granularity", "full", "--global-batch-size", "4"]),
    # partial recompute: block keeps the first k layers' inputs, the rest whole; uniform one
    # input per group of k layers, recomputed k at once
    ("block recompute 2 of 8", 1, ["--recompute-granularity", "full", "--recompute-method",
                                   "block", "--recompute-num-layers", "2",
                                   "--global-batch-size", "4"]),
    ("uniform recompute groups of 4", 1, ["--recompute-granularity", "full",
                                          "--recompute-method", "uniform",
                                          "--recompute-num-layers", "4",
                                          "--global-batch-size", "4"]),
    ("TP2+SP selective, DP2 ZeRO-1", 4, ["--tensor-model-parallel-size", "2",
                                         "--sequence-parallel", "--recompute-granularity",
                                         "selective", "--zero-stage", "1",
                                         "--global-batch-size", "8"]),
    ("TP2+SP PP2 full recompute", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--recompute-granularity", "full"] + PP),
    # context parallelism: s/C tokens per rank plus the K/V in flight (planner.cp_kv_bytes)
    *[(f"CP{c} {ct}", c, ["--context-parallel-size", str(c), "--cp-comm-type", ct,
                          "--global-batch-size", "4"])
      for c in (2, 4) for ct in ("p2p", "allgather", "a2a")],
    ("bf16 TP2 PP2 interleaved", 4, ["--bf16", "--tensor-model-parallel-size", "2",
                                     "--num-virtual-stages-per-pipeline-rank", "2"] + PP),
]
MOE_CASES = [
    # mixture of experts (8 experts of width 512, top-2, dropless unless noted): experts split
    # over EP, the rest as DP; rank 0's receive buffer is the router's (the planner assumes the
    # busiest rank's, MOE_IMBALANCE over the mean; "est. balanced" assumes none)
    ("MoE EP1", 1, MOE + ["--global-batch-size", "4"]),
    ("MoE EP2", 2, MOE + ["--expert-model-parallel-size", "2", "--global-batch-size", "8"]),
    ("MoE EP4", 4, MOE + ["--expert-model-parallel-size", "4", "--global-batch-size", "16"]),
    ("MoE EP2 DP4 ZeRO-1 (expert-DP 2)", 4, MOE + ["--expert-model-parallel-size", "2",
                                                   "--zero-stage", "1",
                                                   "--global-batch-size", "16"]),
    ("MoE EP2 TP2+SP ETP1", 4, MOE + ["--expert-model-parallel-size", "2",
                                      "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--expert-tensor-parallel-size", "1",
                                      "--global-batch-size", "8"]),
    ("MoE EP2 capacity 1.0 padded", 2, MOE + ["--expert-model-parallel-size", "2",
                                              "--moe-expert-capacity-factor", "1.0",
                                              "--moe-pad-expert-input-to-capacity",
                                              "--global-batch-size", "8"]),
    ("MoE EP2 bf16 SwiGLU, gated shared expert", 2,
     MOE + ["--expert-model-parallel-size", "2", "--bf16", "--swiglu",
            "--moe-shared-expert-intermediate-size", "512", "--moe-shared-expert-gate",
            "--global-batch-size", "8"]),
    # with pipeline parallelism: each stage's own MoE layers, warm-up micro-batches and head
    ("MoE PP2 EP1", 2, MOE + PP),
    ("MoE PP2 EP2", 4, MOE + PP + ["--expert-model-parallel-size", "2"]),
]


# Runs pretrain.py with global rank WRITER_RANK, not 0, as the one process that logs.
WRITER_SHIM = ("import os, runpy, sys; import megalite.logging as L; init = "
               "L.MetricsLogger.__init__; L.MetricsLogger.__init__ = lambda self, cfg, is_writer, "
               "stream=None: init(self, cfg, os.environ['RANK'] == os.environ['WRITER_RANK'], "
               "stream); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def run(name, nproc, extra, out_dir, writer=0):
    path = os.path.join(out_dir, name.replace(" ", "_").replace("/", "") + ".jsonl")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}"] if nproc > 1 else []) \
        + (["--no-python", sys.executable, "-c", WRITER_SHIM] if writer else []) \
        + [os.path.join(ROOT, "pretrain.py")] + BASE + extra + ["--metrics-file", path]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, WRITER_RANK=str(writer))
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    rec = [json.loads(x) for x in open(path) if '"estimated_memory_bytes"' in x][0]
    return rec, time.time() - t0


def balanced_estimate(nproc, extra, stage=0) -> float:
    """The planner's estimate for ``stage`` with no dropless imbalance headroom (moe_imbalance
    1)."""
    from megalite.arguments import parse_args
    from megalite.planner import estimate_for_run

    return estimate_for_run(parse_args(BASE + extra), nproc, "cpu", stage,
                            moe_imbalance=1.0)["total"]


def row(label, nproc, rec, *extra) -> str:
    """One markdown row: estimated (then ``extra`` columns), measured, their ratio, the parts."""
    est, got = rec["estimated_memory_bytes"], rec["measured_memory_bytes"]
    states = sum(rec[f"estimated_{k}_bytes"] for k in ("params", "grads", "optimizer"))
    return (f"| {label} | {nproc} | {est / 2**20:.1f} | "
            + "".join(f"{x / 2**20:.1f} | " for x in extra)
            + f"{got / 2**20:.1f} | {got / est:.3f} | {states / 2**20:.1f} / "
            f"{rec['estimated_activations_bytes'] / 2**20:.1f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "planner_memory"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for moe, cases in ((False, CASES), (True, MOE_CASES)):
        balanced = ["est. balanced MiB"] * moe
        print(" | ".join(["\n| MoE case" if moe else "| case", "processes", "estimated MiB",
                          *balanced, "measured MiB", "measured / estimated",
                          "est. states / activations MiB |"]))
        print("|---" * (6 + moe) + "|")
        for name, nproc, extra in cases:
            if a.only and name not in a.only:
                continue
            # global ranks are pipeline-stage-major: the last of 2 stages starts at nproc / 2
            for writer in (0, nproc // 2) if "--pipeline-model-parallel-size" in extra else (0,):
                label = name + " last stage" * (writer > 0)
                rec = run(label, nproc, extra, a.out, writer)[0]
                print(row(label, nproc, rec, *[balanced_estimate(nproc, extra, int(writer > 0))]
                          * moe),
                      flush=True)


if __name__ == "__main__":
    main()
