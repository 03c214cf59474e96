"""Peak host memory of resharding on load, per rank, against the rank's own share plus one layer.

    OMP_NUM_THREADS=1 python benchmarks/reshard_load_memory.py [--layers 16] [--hidden 256]
        [--world 4] [--tp 2] [--pp 1] [--zero-stage 1]

Trains a GPT one step in one process (TP 1, PP 1, plain optimizer) and saves it; then ``--world``
gloo processes start a run at ``--tp`` x ``--pp`` (DP = world / (tp pp)) with ``--zero-stage``
and ``--load`` that checkpoint, so every rank assembles its own files from the saved ones
(docs/checkpoints.md, "Resharding on load"). Each rank measures the growth of its peak RSS
(Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` just before the load) over its RSS
before it, i.e. with its model and optimizer already allocated: what the load itself holds.

It is compared with the rank's own share, the bytes of the files this rank would read after an
offline reshard to the same layout (its ``model_optim_rng.pt`` and, with ZeRO, its
``distrib_optim_dp{d}.pt``, written by ``convert.py reshard`` for the comparison), plus one layer
(a transformer layer's weights and Adam moments at full TP, fp32: what the source reads at a
time). The target is a ratio <= 1.5.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _flags(a, *extra):
    return ["--mock-data", "--num-layers", a.layers, "--hidden-size", a.hidden,
            "--num-attention-heads", 4, "--seq-length", 32, "--vocab-size", 1024,
            "--micro-batch-size", 1, "--global-batch-size", 4, "--log-interval", 1,
            "--eval-iters", 0, "--lr", 1e-3, "--no-log-throughput", "--train-iters", 2, *extra]


def _load_rank(rank, world, argv, offline, tp, pp):
    from megalite.arguments import parse_args
    from megalite.data import build_tokenizer
    from megalite.logging import MetricsLogger
    from megalite.memory import host_rss_bytes, reset_host_peak_rss
    from megalite.parallel_state import initialize_model_parallel
    from megalite.training import Trainer

    cfg = parse_args([str(x) for x in argv])
    par = cfg.parallel
    ps = initialize_model_parallel(par.tensor_model_parallel_size,
                                   par.pipeline_model_parallel_size)
    tok = build_tokenizer(cfg.data)
    cfg = cfg.resolve(ps.world_size, tok.vocab_size)
    out = {}

    class Measured(Trainer):
        def _load_checkpoint(self):
            before = reset_host_peak_rss()
            super()._load_checkpoint()
            out["growth"] = host_rss_bytes("VmHWM") - before

    Measured(cfg, ps, MetricsLogger(cfg, is_writer=False, stream=io.StringIO()), tok, 0.0)
    shard = os.path.join(offline, "iter_0000001", f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}")
    files = ["model_optim_rng.pt"] + ([f"distrib_optim_dp{ps.dp_cp_rank:03d}.pt"]
                                      if cfg.optimizer.zero_stage else [])
    out["share"] = sum(os.path.getsize(os.path.join(shard, f)) for f in files)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=1)
    a = p.parse_args(argv)
    import torch

    from dist_utils import run_distributed
    from megalite.arguments import parse_args
    from megalite.checkpoint.convert import reshard
    from megalite.checkpoint.layout import Layout
    from megalite.training import pretrain

    dp = a.world // (a.tp * a.pp)
    with tempfile.TemporaryDirectory() as d:
        src, offline = os.path.join(d, "src"), os.path.join(d, "offline")
        pretrain(parse_args([str(x) for x in _flags(a, "--exit-interval", 1, "--save", src)]),
                 stream=io.StringIO())
        reshard(src, offline, Layout(a.tp, a.pp), data_parallel_size=dp,
                zero_stage=a.zero_stage)
        sd = torch.load(os.path.join(src, "iter_0000001", "mp_rank_00_000", "model_optim_rng.pt"),
                        weights_only=True, mmap=True)
        layer = 3 * 4 * sum(t.numel() for k, t in sd["model"].items() if k.startswith("layers.0."))
        del sd
        target = _flags(a, "--tensor-model-parallel-size", a.tp, "--pipeline-model-parallel-size",
                        a.pp, "--zero-stage", a.zero_stage, "--load", src)
        ranks = run_distributed(_load_rank, a.world, target, offline, a.tp, a.pp, timeout=900)
    mib = 2 ** 20
    print(f"reshard on load: {a.layers} layers, hidden {a.hidden}, TP 1 PP 1 plain -> TP {a.tp} "
          f"PP {a.pp} DP {dp} ZeRO {a.zero_stage}; one layer {layer / mib:.1f} MiB")
    rows = []
    for r, m in enumerate(ranks):
        ratio = m["growth"] / (m["share"] + layer)
        rows.append(dict(rank=r, growth_mib=m["growth"] / mib, share_mib=m["share"] / mib,
                         ratio=ratio))
        print(f"  rank {r}: peak RSS growth {m['growth'] / mib:6.1f} MiB, own share "
              f"{m['share'] / mib:6.1f} MiB + one layer -> {ratio:.2f}x")
    result = {"layer_mib": layer / mib, "ranks": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
