"""Shared by the pretrain/checkpoint/logging tests: tiny flags, running main, reading logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "pretrain.py")
STRICT = os.path.join(ROOT, "tests", "strict_collectives.py")  # runs a script in strict mode

# 2 layers, hidden 32, sequence 16: a few ms per step on one core.
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "300", "--make-vocab-size-divisible-by", "8",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "1", "--lr", "1e-2", "--lr-warmup-iters", "2",
        "--no-log-throughput"]


def flags(*extra, **kw) -> List[str]:
    out = list(TINY)
    for k, v in kw.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out + [str(e) for e in extra]


def run_main(argv: List[str]) -> int:
    """pretrain.py's main in this process (a single-process run needs no torch.distributed)."""
    sys.path.insert(0, ROOT)
    import pretrain

    return pretrain.main(argv)


def run_cli(argv: List[str], nproc: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if nproc == 1:
        cmd = [sys.executable, PRETRAIN] + argv
    else:  # emulating a GPU: a collective on a tensor its group cannot carry on NCCL fails
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", STRICT, PRETRAIN] + argv
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_metrics(path: str, split: str = "train") -> List[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r.get("split") == split]


def train_losses(path: str) -> Dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(path)}
