"""Data parallelism / ZeRO side by side: megalite stages 0/1/2 vs PyTorch DDP and FSDP2.

    OMP_NUM_THREADS=1 python benchmarks/zero.py [--dp 2] [--hidden 128] [--layers 4] [--steps 10]

Spawns ``--dp`` gloo processes on the CPU and, in those same processes and on the same GPTModel
(same seed, same data), trains a few AdamW steps with each of

* megalite ``DistributedDataParallel`` + ``build_optimizer``'s optimizer at ZeRO stages 0, 1, 2;
* ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``;
* FSDP2 (``torch.distributed.fsdp.fully_shard`` per transformer layer and on the root) +
  ``torch.optim.AdamW``.

Per rank it reports the model-state bytes (params, grads, fp32 masters, optimizer states) measured
from tensor storages after a step (megalite/memory.py; DTensors count their local shard), the
docs/theory.md figure for megalite's stages, and the median step time. The ratios are against
PyTorch DDP. Configurations alternate step by step (round-robin) so that load from other processes
on the machine hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _local(t):
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _torch_model_state_bytes(model, optimizer):
    from megalite.memory import _storages

    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    states = [_local(v) for st in optimizer.state.values() for k, v in st.items()
              if k != "step" and hasattr(v, "untyped_storage")]
    seen, out = {}, {}
    for name, tensors in (("params", params), ("grads", grads), ("master_params", []),
                          ("optimizer_states", states)):
        found = _storages(tensors)
        out[name + "_bytes"] = sum(n for k, n in found.items() if k not in seen)
        seen.update(found)
    out["total_bytes"] = sum(out[c + "_bytes"] for c in
                             ("params", "grads", "master_params", "optimizer_states"))
    return out


def _worker(rank, world_size, args):
    import warnings

    import torch
    import torch.distributed as dist

    from megalite import collectives as C

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    from megalite.config import ModelConfig, OptimizerConfig
    from megalite.distributed.ddp import wrap_chunks
    from megalite.memory import memory_report
    from megalite.models import GPTModel
    from megalite.optimizer import build_optimizer
    from megalite.parallel_state import ParallelState, initialize_model_parallel

    mcfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                       seq_length=args.seq, vocab_size=args.vocab, make_vocab_size_divisible_by=8,
                       hidden_dropout=0.0, attention_dropout=0.0)
    ps = initialize_model_parallel(1, 1, backend="gloo", device="cpu", set_default=False)
    n, r = ps.dp_size, ps.dp_rank
    local = args.global_batch // n
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab, (args.steps + args.warmup, args.global_batch,
                                         args.seq + 1), generator=gen)

    def batch(i):
        ids = data[i, r * local:(r + 1) * local]
        return ids[:, :-1], ids[:, 1:], args.global_batch * args.seq

    def adamw_groups(params):
        params = list(params)
        return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]

    runs = {}
    for stage in (0, 1, 2):
        ocfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.0, zero_stage=stage,
                               overlap_grad_reduce=True, overlap_param_gather=stage > 0,
                               ddp_bucket_size=args.bucket).validate()
        chunks, _, finalize = wrap_chunks([GPTModel(mcfg, ps, seed=1)], ocfg, ps)
        opt = build_optimizer(chunks, ocfg, ps)

        def step(i, chunks=chunks, opt=opt, finalize=finalize):
            tokens, labels, ntok = batch(i)
            opt.zero_grad()
            loss = chunks[0](tokens, labels=labels).sum() / ntok
            loss.backward()
            finalize()
            opt.step()
            return loss.item()

        def mem(chunks=chunks, opt=opt, stage=stage):
            rep = memory_report(chunks, opt)
            out = {k[4:]: v for k, v in rep.items() if k.startswith("mem_")}
            return out

        runs[f"megalite ZeRO-{stage}"] = (step, mem, chunks)

    # PyTorch DDP: it averages gradients over ranks, so each rank's loss is its local mean.
    ddp_model = torch.nn.parallel.DistributedDataParallel(GPTModel(mcfg, ParallelState(), seed=1),
                                                          bucket_cap_mb=args.bucket * 4 / 2**20)
    ddp_opt = torch.optim.AdamW(adamw_groups(ddp_model.parameters()), lr=1e-3, foreach=True)

    def ddp_step(i):
        tokens, labels, ntok = batch(i)
        ddp_opt.zero_grad(set_to_none=False)
        loss = ddp_model(tokens, labels=labels).sum() / (ntok // n)
        loss.backward()
        ddp_opt.step()
        return loss.item() / n

    runs["PyTorch DDP"] = (ddp_step, lambda: _torch_model_state_bytes(ddp_model, ddp_opt), None)

    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        fsdp_model = GPTModel(mcfg, ParallelState(), seed=1)
        for layer in fsdp_model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(fsdp_model, mesh=mesh)
        fsdp_opt = torch.optim.AdamW(adamw_groups(fsdp_model.parameters()), lr=1e-3,
                                     foreach=True)

        def fsdp_step(i):
            tokens, labels, ntok = batch(i)
            fsdp_opt.zero_grad()
            loss = fsdp_model(tokens, labels=labels).sum() / (ntok // n)
            loss.backward()
            fsdp_opt.step()
            return loss.item() / n

        runs["PyTorch FSDP2"] = (fsdp_step, lambda: _torch_model_state_bytes(fsdp_model, fsdp_opt),
                                 None)
    except Exception as e:  # report, keep the rest of the table
        if rank == 0:
            print(f"FSDP2 unavailable: {type(e).__name__}: {e}", file=sys.stderr)

    times = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    traffic = {}
    for i in range(args.warmup + args.steps):
        for name, (step, _, _) in runs.items():
            C.barrier()
            C.reset_bytes_sent()
            t0 = time.perf_counter()
            losses[name].append(step(i))
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(dt)
            traffic[name] = sum(C.bytes_sent().values())
    for name, (_, _, chunks) in runs.items():
        if chunks is not None:
            for c in chunks:
                c.finish_param_sync()
    out = {}
    for name, (_, mem, _) in runs.items():
        out[name] = {"memory": mem(), "step_s": statistics.median(times[name]),
                     "loss_first": losses[name][0], "loss_last": losses[name][-1],
                     "megalite_bytes_sent": traffic[name]}
    out["_psi"] = sum(p.numel() for p in runs["megalite ZeRO-0"][2][0].parameters())
    return out


def _fmt_mib(b):
    return f"{b / 2**20:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=250_000, help="elements per bucket")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the raw results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dist_utils import run_distributed

    results = run_distributed(_worker, args.dp, args, timeout=1800)
    res = results[0]
    psi = res.pop("_psi")
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}: "
          f"Ψ = {psi:,} parameters, fp32, dp = {args.dp}, global batch {args.global_batch}; "
          f"rank 0, median of {args.steps} steps")
    print()
    print("| configuration | params MiB | grads MiB | masters+Adam MiB | total MiB | "
          "theory MiB | memory / DDP | step ms | step time / DDP |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = res["PyTorch DDP"]
    for name, r in res.items():
        m = r["memory"]
        theory = _fmt_mib(m["theory_total_bytes"]) if "theory_total_bytes" in m else "—"
        print(f"| {name} | {_fmt_mib(m['params_bytes'])} | {_fmt_mib(m['grads_bytes'])} | "
              f"{_fmt_mib(m['master_params_bytes'] + m['optimizer_states_bytes'])} | "
              f"{_fmt_mib(m['total_bytes'])} | {theory} | "
              f"{m['total_bytes'] / base['memory']['total_bytes']:.2f} | "
              f"{1000 * r['step_s']:.1f} | {r['step_s'] / base['step_s']:.2f} |")
    print()
    for name, r in res.items():
        if name.startswith("megalite"):
            print(f"{name}: bytes sent per step (rank 0) {r['megalite_bytes_sent']:,}; "
                  f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}")
        else:
            print(f"{name}: loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "psi": psi, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
