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
        "--no-log-throughput", "--no-log-memory-peak"]  # (the memory tests measure it)


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


def _cli_rank(rank: int, world_size: int, argv: List[str]):
    """One rank of :func:`run_cli`: pretrain.py's main in strict mode (emulating a GPU: a
    collective on a tensor its group cannot carry on NCCL fails), its output captured."""
    import contextlib
    import io

    import strict_collectives

    strict_collectives.enable()
    import pretrain

    os.chdir(ROOT)
    sys.argv = [PRETRAIN] + argv
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = pretrain.main(argv)
    return rc, out.getvalue(), err.getvalue()


def run_cli(argv: List[str], nproc: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    """pretrain.py on ``nproc`` ranks, as ``torchrun --nproc-per-node nproc`` would run it under
    tests/strict_collectives.py; returns the exit code (0, or the first rank's failing one) and
    the ranks' stdout and stderr, in rank order.

    One rank is a fresh interpreter. Several are forked by dist_utils.run_distributed (with the
    RANK/WORLD_SIZE/MASTER_* environment torchrun sets): the launcher and an interpreter per rank
    would each import torch again, seconds of CPU apiece. (The launcher itself is run by
    test_multinode.py.)"""
    argv = [str(a) for a in argv]
    if nproc == 1:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        return subprocess.run([sys.executable, PRETRAIN] + argv, cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    from dist_utils import run_distributed

    cmd = ["torchrun", f"--nproc-per-node={nproc}", STRICT, PRETRAIN] + argv
    try:
        ranks = run_distributed(_cli_rank, nproc, argv, timeout=timeout)
    except AssertionError as e:  # a rank raised: what the launcher would report, exit 1
        return subprocess.CompletedProcess(cmd, 1, "", str(e))
    rc = next((r for r, _, _ in ranks if r != 0), 0)
    return subprocess.CompletedProcess(cmd, rc, "".join(o for _, o, _ in ranks),
                                       "".join(e for _, _, e in ranks))


def pretrain_cases(rank: int, world_size: int, runs: List[List[str]]) -> bool:
    """A run_distributed worker: every run of one world size, one after another in the same
    processes, in strict mode (multi-rank runs emulate a GPU: docs/design.md, contract 1)."""
    import strict_collectives

    from megalite import collectives as C
    from megalite.arguments import parse_args
    from megalite.training import pretrain

    strict_collectives.enable()
    for argv in runs:
        pretrain(parse_args(argv))
        C.barrier()
    return True


def train_in_worker(argv: List[str]):
    """pretrain(argv) in a run_distributed worker (strict mode on): its training losses and
    what it printed, once every rank is done."""
    import io

    from megalite import collectives as C
    from megalite.arguments import parse_args
    from megalite.training import pretrain

    out = io.StringIO()
    summary = pretrain(parse_args([str(a) for a in argv]), stream=out)
    C.barrier()
    return summary["train_losses"], out.getvalue()


def single_process_refs(models, argv_of, directory) -> Dict[tuple, str]:
    """The reference of a layout parity test: one single-process pretrain run per distinct model
    flags in ``models``, ``argv_of(model flags, metrics file)`` its command line; model flags
    (a tuple) -> its metrics file."""
    refs = {}
    for model in dict.fromkeys(tuple(m) for m in models):
        refs[model] = directory / f"single_{len(refs)}.jsonl"
        assert run_main(argv_of(list(model), refs[model])) == 0
    return refs


def read_metrics(path: str, split: str = "train") -> List[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r.get("split") == split]


def train_losses(path: str) -> Dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(path)}


def assert_same_run(ref: List[dict], got: List[dict], iters: int, keys=("lm_loss", "grad_norm"),
                    rel: float = 1e-5, name: str = "") -> None:
    """A parallel run's training records equal one process's: every iteration 1..iters logged,
    each of ``keys`` within ``rel`` (docs/design.md, contract 5)."""
    assert [r["iteration"] for r in ref] == list(range(1, iters + 1))
    assert [r["iteration"] for r in got] == [r["iteration"] for r in ref]
    for a, b in zip(ref, got):
        for key in keys:
            err = abs(b[key] - a[key]) / abs(a[key])
            assert err <= rel, (f"{name} iteration {a['iteration']} {key}: {b[key]} vs one "
                                f"process {a[key]} (rel {err:.2e})")
