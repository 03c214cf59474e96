"""Context-parallel attention on the CPU: step time, CPU time and peak memory per rank, and the
load balance of the chunk assignment (docs/context_parallel.md).

    OMP_NUM_THREADS=1 python benchmarks/context_parallel.py [--seq 4096 8192 16384 32768]
        [--cp 1 2 4] [--comm p2p allgather a2a] [--heads 4] [--kv-heads 4] [--head-dim 32]
        [--repeats 1] [--balance-seq 8192] [--no-torch]

For each CP size C one set of gloo processes (one thread each) runs, for each sequence length
and comm type, forward + backward of ``context_parallel_attention`` on this rank's s/C tokens
(C = 1: plain causal SDPA on the whole sequence). Per configuration it reports the wall time of a
step (slowest rank, median of ``--repeats``), each rank's CPU time of the step
(``time.thread_time``: the compute this rank did, not time spent waiting on a peer; with more
processes than cores wall time mostly measures the sharing) and the peak tensor memory of a step
per rank (megalite.memory.PeakTensorMemory: live storages at the start plus the allocator's
high-water mark).

``--balance-seq``: per-rank CPU time at the largest C of the attention work each rank does under
the load-balanced split (chunks r and 2C-1-r, the p2p call) against the contiguous split
(rank r holds tokens [r s/C, (r+1) s/C) and attends to everything before them: the same blocks
computed without communication), with the spread (max - min) / mean of each.

``torch.distributed.tensor.experimental.context_parallel`` is tried side by side unless
``--no-torch``; where it cannot run (on the CPU in torch 2.13) the error is printed instead.

``--pretrain``: the issue's pretrain-level targets instead, from pretrain.py runs (torchrun, one
thread per process; the pinned shape: 4 layers, hidden 256, 4 heads, ``--seq 8192`` tokens,
micro-batch 1, vocab 300, attention dropout 0, fp32, Adam) at each ``--cp`` and ``--comm``. Per
run it reads metrics.jsonl: the median ``iteration_time_ms`` of the iterations after the second
(the second is the one whose memory is probed, which slows it), and rank 0's peak of tensor
memory on the second iteration (``measured_memory_bytes``, the same PeakTensorMemory as
:func:`measure`) minus the model states (parameters, gradients, Adam moments: 16 bytes per
parameter, ``estimated_{params,grads,optimizer}_bytes``): the activation memory. Prints each
against C = 1 (targets: activations at C = 4 at most 0.30x, p2p step time at C = 2 at most 0.65x).

:func:`measure` times any callable the same way (a pretrain step, for instance).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def measure(step, repeats: int, group=None, device="cpu", warmup: int = 0) -> dict:
    """Run ``step()`` ``warmup`` times, then ``repeats`` times: median wall and CPU (thread) time
    in seconds and the highest peak tensor memory in bytes on this rank. Ranks of ``group`` start
    each repeat together."""
    from megalite import collectives as C
    from megalite.memory import PeakTensorMemory

    for _ in range(warmup):
        step()
    walls, cpus, peak = [], [], 0
    for _ in range(repeats):
        C.barrier(group)
        with PeakTensorMemory(device) as mem:
            w, c = time.perf_counter(), time.thread_time()
            step()
            cpus.append(time.thread_time() - c)
            walls.append(time.perf_counter() - w)
        peak = max(peak, mem.peak_bytes)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "peak_bytes": peak}


def _qkv(args, s_local, gen):
    import torch

    return [torch.randn(1, h, s_local, args.head_dim, generator=gen).requires_grad_()
            for h in (args.heads, args.kv_heads, args.kv_heads)]


def _attention_step(q, k, v, group, comm):
    from megalite.context_parallel.attention import context_parallel_attention

    def step():
        context_parallel_attention(q, k, v, group, comm).sum().backward()
        q.grad = k.grad = v.grad = None  # not alive at the next step's start (its baseline)
    return step


def _torch_cp_step(args, seq, size):
    """torch's experimental CP (ring attention on DTensor) on the same shapes, or its error."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (size,))
    full = [t.detach() for t in _qkv(args, seq, torch.Generator().manual_seed(0))]

    def step():
        with context_parallel(mesh, buffers=full, buffer_seq_dims=[2, 2, 2]):
            a, b, c = (t.detach().requires_grad_() for t in full)
            F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                           enable_gqa=args.heads != args.kv_heads).sum().backward()
    return step


def _contiguous_step(q, k, v, rank, size):
    """The contiguous split's attention work of rank ``rank`` (queries = the rank's s/C tokens,
    keys = everything up to them), forward and backward, computed locally."""
    from megalite.context_parallel import attention as A, blocks

    scale, sl = q.shape[-1] ** -0.5, q.shape[2]
    mine = slice(rank * sl, (rank + 1) * sl)
    kd, vd, kp, vp = k[:, :, mine], v[:, :, mine], k[:, :, :rank * sl], v[:, :, :rank * sl]
    kernel = blocks.select(q, k)  # the one CP's own blocks run here

    def step():
        o, lse = kernel.fwd(q, kd, vd, True, scale)
        out, lse = o.float(), lse.clone()
        if rank:
            A._merge(out, lse, *kernel.fwd(q, kp, vp, False, scale))
        out = out.to(q.dtype)
        kernel.bwd(out, q, kd, vd, out, lse, True, scale)
        if rank:
            kernel.bwd(out, q, kp, vp, out, lse, False, scale)
    return step


def _worker(rank, size, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(list(range(size)))
    rows = []
    for comm in args.comm:  # first calls (connections, kernels) on a small problem
        _attention_step(*_qkv(args, 256 // size, torch.Generator()), group, comm)()
    for seq in args.seq:
        q, k, v = _qkv(args, seq // size, torch.Generator().manual_seed(rank))
        for comm in (args.comm if size > 1 else ["-"]):
            r = measure(_attention_step(q, k, v, group, comm if size > 1 else "p2p"),
                        args.repeats, group)
            rows.append(dict(seq=seq, cp=size, comm=comm, rank=rank, **r))
        if size > 1 and not args.no_torch:
            try:
                r = measure(_torch_cp_step(args, seq, size), args.repeats, group)
                rows.append(dict(seq=seq, cp=size, comm="torch", rank=rank, **r))
            except Exception as e:  # reported, not fatal: it is the comparison, not the subject
                rows.append(dict(seq=seq, cp=size, comm="torch", rank=rank,
                                 error=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
    if args.balance_seq and size == max(args.cp) and size > 1:
        s = args.balance_seq
        q, k, v = _qkv(args, s // size, torch.Generator().manual_seed(rank))
        bal = measure(_attention_step(q, k, v, group, "p2p"), 3, group)
        _, kf, vf = (t.detach() for t in _qkv(args, s, torch.Generator().manual_seed(0)))
        con = measure(_contiguous_step(q.detach(), kf, vf, rank, size), 3, group, warmup=1)
        rows.append(dict(balance=True, seq=s, cp=size, rank=rank, balanced_cpu_s=bal["cpu_s"],
                         contiguous_cpu_s=con["cpu_s"]))
    return rows


def _pretrain_run(args, cp, comm, out_dir):
    """One pretrain.py run at CP ``cp``: (median step seconds, peak bytes, model-state bytes)."""
    import json
    import subprocess

    path = os.path.join(out_dir, f"cp{cp}_{comm}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    flags = ["--mock-data", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads",
             "4", "--seq-length", str(args.seq[0]), "--vocab-size", "300",
             "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", str(args.iters), "--log-interval", "1",
             "--eval-iters", "0", "--attention-dropout", "0", "--no-log-throughput",
             "--context-parallel-size", str(cp), "--cp-comm-type", comm, "--metrics-file", path]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={cp}", os.path.join(ROOT, "pretrain.py")] + flags
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"CP {cp} {comm} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in open(path)]
    mem = next(x for x in recs if "measured_memory_bytes" in x)
    times = [x["iteration_time_ms"] / 1e3 for x in recs
             if x.get("split") == "train" and x["iteration"] > 2]
    states = sum(mem[f"estimated_{k}_bytes"] for k in ("params", "grads", "optimizer"))
    return statistics.median(times), mem["measured_memory_bytes"], states


def pretrain_main(args):
    out_dir = os.path.join(ROOT, "runs", "context_parallel")
    os.makedirs(out_dir, exist_ok=True)
    print(f"pretrain.py, 4 layers, hidden 256, 4 heads, {args.seq[0]} tokens, micro-batch 1, fp32; "
          f"step: median of iterations 3..{args.iters}; memory: rank 0, iteration 2")
    print("| C | type | step s | step / C1 | peak MiB | states MiB | activations MiB "
          "| activations / C1 |\n|---|---|---|---|---|---|---|---|")
    base = None
    for cp in args.cp:
        for comm in (args.comm if cp > 1 else ["p2p"]):
            t, peak, states = _pretrain_run(args, cp, comm, out_dir)
            base = base or (t, peak - states)
            print(f"| {cp} | {comm if cp > 1 else '-'} | {t:.2f} | {t / base[0]:.3f} | "
                  f"{peak / 2**20:.1f} | {states / 2**20:.1f} | {(peak - states) / 2**20:.1f} | "
                  f"{(peak - states) / base[1]:.3f} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--comm", nargs="+", default=["p2p", "allgather", "a2a"])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--balance-seq", type=int, default=8192, help="0: skip")
    p.add_argument("--no-torch", action="store_true", help="skip torch's experimental CP")
    p.add_argument("--pretrain", action="store_true",
                   help="pretrain-level targets (first --seq only; default 8192)")
    p.add_argument("--iters", type=int, default=5, help="--pretrain: iterations per run")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.pretrain:
        if argv is None and "--seq" not in sys.argv:
            args.seq = [8192]
        return pretrain_main(args)
    from dist_utils import run_distributed

    rows = [r for size in args.cp for per in run_distributed(_worker, size, args, timeout=7200)
            for r in per]
    print(f"heads {args.heads}, K/V heads {args.kv_heads}, head dim {args.head_dim}, batch 1; "
          f"forward + backward; per rank: slowest wall, CPU time min..max, peak memory max")
    print(f"{'seq':>6} {'C':>2} {'comm':>9} {'wall ms':>9} {'cpu ms':>17} {'peak MiB':>9}")
    runs = [r for r in rows if not r.get("balance")]
    for key in dict.fromkeys((r["seq"], r["cp"], r["comm"]) for r in runs):
        rs = [r for r in runs if (r["seq"], r["cp"], r["comm"]) == key]
        if "error" in rs[0]:
            print(f"{key[0]:>6} {key[1]:>2} {key[2]:>9}  cannot run: {rs[0]['error']}")
            continue
        cpu = [r["cpu_s"] * 1e3 for r in rs]
        print(f"{key[0]:>6} {key[1]:>2} {key[2]:>9} {max(r['wall_s'] for r in rs) * 1e3:9.0f} "
              f"{min(cpu):8.0f}..{max(cpu):<8.0f}"
              f"{max(r['peak_bytes'] for r in rs) / 2**20:9.1f}")
    bal = sorted((r for r in rows if r.get("balance")), key=lambda r: r["rank"])
    if bal:
        print(f"\nload balance, seq {bal[0]['seq']}, C {bal[0]['cp']}: per-rank CPU ms "
              f"of forward + backward attention")
        for name in ("balanced", "contiguous"):
            t = [r[f"{name}_cpu_s"] * 1e3 for r in bal]
            spread = (max(t) - min(t)) / statistics.mean(t)
            print(f"  {name:>10}: {' '.join(f'{x:7.0f}' for x in t)}   spread {spread:.1%}")


if __name__ == "__main__":
    main()
