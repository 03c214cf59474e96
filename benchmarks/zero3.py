"""megalite ZeRO-3 vs PyTorch FSDP2 (``fully_shard`` per layer), side by side, same processes.

    python benchmarks/zero3.py                      # spawns 2 CPU/gloo ranks (dp = 2)
    torchrun --nproc-per-node 2 benchmarks/zero3.py # the same under torchrun
    python benchmarks/zero3.py --hidden 256 --layers 4 --seq 128 --micro-batch 4 --steps 8

Both systems train the same GPTModel (same seed, so the same full model; docs/design.md, contract 3)
on the same batches with the same AdamW hyper-parameters and clipping; their losses are printed side
by side as a cross-check (in fp32 they agree to ~1e-4 after a few steps: the reduction orders
differ, and Adam turns rounding-level differences in near-zero gradients into full-size steps).

Measured per rank:
  * peak memory: live bytes of every CPU allocation made from the start of the system's
    construction (the allocator's count, with frees on gloo's threads, megalite.memory.
    cpu_live_bytes), peak within the training steps — parameters, gradients, optimizer state,
    gathered buffers and activations alike;
  * model-state bytes after a step (params + grads + optimizer state, distinct storages);
  * step time: median over repetitions of the max over ranks, the two systems alternating so
    that drifting load on a shared machine hits both alike.
Ratios are megalite / FSDP2 (<= 1.0 is the target).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite import collectives as C  # noqa: E402
from megalite.config import ModelConfig, OptimizerConfig  # noqa: E402
from megalite.memory import distinct_storage_bytes  # noqa: E402

HP = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


def _config(a) -> ModelConfig:
    return ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       seq_length=a.seq, vocab_size=a.vocab, make_vocab_size_divisible_by=128,
                       hidden_dropout=0.0, attention_dropout=0.0)


def _batch(a, step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(0, a.vocab, (a.micro_batch * world, a.seq + 1), generator=g)
    mine = ids[rank * a.micro_batch:(rank + 1) * a.micro_batch]
    return mine[:, :-1], mine[:, 1:], ids.shape[0] * a.seq


# ----------------------------------------------------------------------------------- systems
def build_megalite(a, ps):
    from megalite.distributed.zero3 import shard_model_zero3
    from megalite.models import GPTModel
    from megalite.optimizer.zero3_optimizer import Zero3Optimizer

    oc = OptimizerConfig(zero_stage=3, zero3_prefetch_depth=a.prefetch_depth, **HP).validate()
    model = shard_model_zero3(GPTModel(_config(a), ps, seed=7), ps, oc)
    opt = Zero3Optimizer(model, oc, ps)

    def step(tokens, labels, n_tokens):
        opt.zero_grad()
        loss = model(tokens, labels=labels).sum() / n_tokens
        loss.backward()
        opt.step()
        return loss.detach()

    def state_bytes():
        ts = [u.shard for u in model.units] + [u.main for u in model.units]
        ts += [u.grad for u in model.units] + opt.exp_avg + opt.exp_avg_sq
        return distinct_storage_bytes(ts)

    return step, state_bytes


def build_fsdp2(a, ps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megalite.models import GPTModel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = GPTModel(_config(a), ps, seed=7)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # root: embedding, final norm, output (the tied weight)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": HP["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=HP["lr"],
                            betas=(HP["adam_beta1"], HP["adam_beta2"]), eps=HP["adam_eps"])

    def step(tokens, labels, n_tokens):
        opt.zero_grad(set_to_none=False)
        loss = model(tokens, labels=labels).sum() / n_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HP["clip_grad"])
        opt.step()
        return loss.detach()

    def state_bytes():
        ts = []
        for p in model.parameters():
            ts.append(p._local_tensor if hasattr(p, "_local_tensor") else p.data)
            if p.grad is not None:
                ts.append(p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad)
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    ts.append(v._local_tensor if hasattr(v, "_local_tensor") else v)
        return distinct_storage_bytes(ts)

    return step, state_bytes


# ---------------------------------------------------------------------------------- measuring
def _loss_sum(loss):
    x = loss.clone().reshape(1)
    C.all_reduce(x, group=C.world_group())
    return x.item()


def measure_memory(a, build, ps, rank, world):
    """Peak live bytes (allocations since construction began) during the training steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from megalite.memory import CountingCPUFrees, cpu_live_bytes

    losses = []
    with CountingCPUFrees(), profile(activities=[ProfilerActivity.CPU],
                                     profile_memory=True) as prof:
        step, state_bytes = build(a, ps)
        with record_function("bench_steps"):
            for k in range(a.memory_steps):
                tokens, labels, n = _batch(a, k, rank, world)
                losses.append(_loss_sum(step(tokens, labels, n)))
    peak = max([0] + [n for _, n in cpu_live_bytes(prof, since="bench_steps")])
    return step, state_bytes, peak, losses


def timed(step, a, rank, world, first_step):
    C.barrier()
    t0 = time.perf_counter()
    for k in range(a.steps):
        tokens, labels, n = _batch(a, first_step + k, rank, world)
        step(tokens, labels, n)
    C.barrier()
    dt = torch.tensor([(time.perf_counter() - t0) / a.steps])  # a host-side measurement
    C.all_reduce(dt, group=C.world_group(), op=C.ReduceOp.MAX, host=True)
    return dt.item()


def run(a):
    from megalite.parallel_state import initialize_model_parallel

    ps = initialize_model_parallel(1, 1, backend="gloo", device="cpu", set_default=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(a.threads)
    results = {}
    systems = {"megalite_zero3": build_megalite, "fsdp2": build_fsdp2}
    steps = {}
    for name, build in systems.items():
        step, state_bytes, peak, losses = measure_memory(a, build, ps, rank, world)
        steps[name] = step
        results[name] = {"peak_bytes": peak, "losses": losses}
        results[name]["state_bytes"] = state_bytes()
    times = {name: [] for name in systems}
    for rep in range(a.reps):  # alternate, so load drift on the machine hits both
        for name in systems:
            times[name].append(timed(steps[name], a, rank, world, a.memory_steps + rep * a.steps))
    for name in systems:
        results[name]["step_time_s"] = statistics.median(times[name])
        results[name]["step_times_s"] = times[name]
    # Peak over ranks (memory) so the ratio compares the worst rank of each.
    for name in systems:
        for key in ("peak_bytes", "state_bytes"):
            t = torch.tensor([results[name][key]], dtype=torch.float64)
            C.all_reduce(t, group=C.world_group(), op=C.ReduceOp.MAX, host=True)
            results[name][key] = int(t.item())
    m, f = results["megalite_zero3"], results["fsdp2"]
    results["ratio"] = {"peak_memory": m["peak_bytes"] / f["peak_bytes"],
                        "state_memory": m["state_bytes"] / f["state_bytes"],
                        "step_time": m["step_time_s"] / f["step_time_s"]}
    results["setup"] = {k: v for k, v in vars(a).items() if k != "output"}
    results["setup"].update(dp=world, params=_config(a).num_parameters(),
                            torch=torch.__version__)
    if rank == 0:
        print(json.dumps(results, indent=1))
        print(_table(results))
        if a.output:
            with open(a.output, "w") as fh:
                json.dump(results, fh, indent=1)
    return results


def _table(r) -> str:
    m, f, q = r["megalite_zero3"], r["fsdp2"], r["ratio"]
    mib = 1 / 2 ** 20
    rows = [
        "| per rank (dp=%d) | megalite ZeRO-3 | FSDP2 | ratio |" % r["setup"]["dp"],
        "| --- | --- | --- | --- |",
        f"| peak memory in a step (MiB) | {m['peak_bytes'] * mib:.1f} | "
        f"{f['peak_bytes'] * mib:.1f} "
        f"| {q['peak_memory']:.3f} |",
        f"| model state after a step (MiB) | {m['state_bytes'] * mib:.1f} | "
        f"{f['state_bytes'] * mib:.1f} | {q['state_memory']:.3f} |",
        f"| step time (ms, median) | {m['step_time_s'] * 1e3:.1f} | {f['step_time_s'] * 1e3:.1f} "
        f"| {q['step_time']:.3f} |",
        f"| losses (first {len(m['losses'])} steps) | "
        f"{', '.join(f'{x:.5f}' for x in m['losses'])} | "
        f"{', '.join(f'{x:.5f}' for x in f['losses'])} | |",
    ]
    return "\n".join(rows)


def _spawned(rank, world, port, a):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(a)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--output", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        run(a)
        dist.destroy_process_group()
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(a.world, port, a), nprocs=a.world, start_method="spawn")


if __name__ == "__main__":
    main()
