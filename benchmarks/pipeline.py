"""Pipeline schedules measured: bubble vs theory, ZB-H1 / ZB-V / DualPipeV vs 1F1B, vs torch.

    python benchmarks/pipeline.py --pp 2 [--micro-batches 2,4,8,16] [--trace-dir docs/img]

Spawns --pp CPU processes (gloo, one thread each; refuses more processes than CPUs, since then the
"idle" time of a stage would be time it waited for a core, not for its neighbour). For each schedule
and m it runs warm-up + timed steps of a compute-bound GPT (default 8 layers, hidden 512, seq 256)
and reports (the variants of one m run round-robin, one step each in turn, so that load from other
jobs on a shared machine hits all of them alike):
  * step time (slowest rank, median over timed steps);
  * measured bubble (idle / step time, from the recorded F/B/W timeline) next to the theory:
    1F1B (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), ZB-H1 (p-1)(T_F+T_B-T_W)/step with the
    measured mean op times T_F, T_B, T_W; ZB-V and DualPipeV: the idle time their op orders imply
    with those op times (timeline.schedule_idle_times) over the step;
  * the bubble the executed op orders imply with each op's own measured time and instant p2p
    (``replayed_bubble``): what the gap theory -> replay shows is unequal op times (the last
    chunk's output layer and loss), what is left above the replay is p2p and executor time;
  * each schedule's step time / 1F1B's;
  * with --compare-batched, each schedule again with the batched p2p program that NCCL needs
    (gloo runs the eager program by default: receives posted ahead, outputs sent at once);
  * peak activation memory per stage, in micro-batches: the most bytes of tensors saved for
    backward (each storage once, parameters excluded) held at once during one extra untimed step,
    over one micro-batch's share (all such bytes the step saved / m), next to each schedule's
    claim (activation_claim); output gradients kept by deferred W ops are not counted;
  * torch.distributed.pipelining Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
    and ScheduleDualPipeV on the same model (the same GPTModel chunks, in the same places,
    wrapped as stage modules) and processes: megalite / torch time.
Results go to stdout as a table and, with --json, to a file; --trace-dir writes one Chrome trace
per schedule (largest m that is <= 8) for tools/plot_pipeline.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megalite.config import V_SCHEDULES  # noqa: E402


def _model_config(args):
    from megalite.config import ModelConfig

    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, seq_length=args.seq,
                       vocab_size=args.vocab, make_vocab_size_divisible_by=128,
                       hidden_dropout=0.0, attention_dropout=0.0,
                       untie_embeddings_and_output_weights=True)


def _batches(args, m, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (m * args.mbs, args.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _megalite_runner(args, ps, schedule, m, p2p_mode=None):
    """A closure running one megalite step (timeline recorded), and the chunks it trains.
    ``p2p_mode`` "batched" forces NCCL's p2p program on gloo (for --compare-batched)."""
    from megalite.pipeline_parallel.partition import build_model_chunks
    from megalite.pipeline_parallel.executor import get_forward_backward_func

    per_v = args.layers // (ps.pp_size * args.vpp) if schedule == "interleaved" else None
    chunks = build_model_chunks(_model_config(args), ps, seed=1,
                                num_layers_per_virtual_pipeline_stage=per_v,
                                v_shape=schedule in V_SCHEDULES)
    fb = get_forward_backward_func(ps.pp_size, ps.vpp_size, schedule)
    tokens, labels = _batches(args, m, 0)
    ntok = labels.numel()

    def forward_step(it, model):
        tok, lab = next(it)
        out = model(tok, labels=lab)
        return out, lambda t: (t.sum() / ntok, {"loss_sum": t.sum().detach()})

    def step():
        mbs = [(tokens[j * args.mbs:(j + 1) * args.mbs], labels[j * args.mbs:(j + 1) * args.mbs])
               for j in range(m)]
        fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=chunks,
           num_microbatches=m, seq_length=args.seq, micro_batch_size=args.mbs,
           parallel_state=ps, timing_log_level=1, p2p_mode=p2p_mode)
        return fb.last_timeline()

    return step, chunks


def _torch_pipelining_runner(args, ps, schedule, m):
    """The same GPTModel chunks, driven by torch.distributed.pipelining."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed import pipelining as tp

    from megalite.pipeline_parallel.partition import build_model_chunks, virtual_stage

    per_v = args.layers // (ps.pp_size * args.vpp) if schedule == "interleaved" else None
    v_shape = schedule in V_SCHEDULES
    chunks = build_model_chunks(_model_config(args), ps, seed=1,
                                num_layers_per_virtual_pipeline_stage=per_v, v_shape=v_shape)

    class StageModule(nn.Module):
        def __init__(self, chunk):
            super().__init__()
            self.chunk = chunk

        def forward(self, x):
            if self.chunk.pre_process:
                return self.chunk(x)
            self.chunk.set_input_tensor(x)
            return self.chunk()  # hidden [s, b, h], or logits [b, s, V] on the last stage

    p, r, v = ps.pp_size, ps.pp_rank, len(chunks)
    stages = [tp.PipelineStage(StageModule(c), virtual_stage(p, r, c_idx, v, v_shape), p * v,
                               torch.device("cpu"), group=ps.pp_group)
              for c_idx, c in enumerate(chunks)]
    vocab = args.vocab

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1))

    if schedule == "1f1b":
        sched = tp.Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    else:
        sched = _torch_schedules()[schedule](stages, m, loss_fn=loss_fn)
    tokens, labels = _batches(args, m, 0)

    def step():
        if r == 0 and v_shape:  # the V: rank 0 holds the first and the last stage
            sched.step(tokens, target=labels, losses=[])
        elif r == 0:
            sched.step(tokens)
        elif r == p - 1:
            sched.step(target=labels, losses=[])
        else:
            sched.step()
        return None

    return step, chunks


def _torch_schedules():
    from torch.distributed import pipelining as tp

    names = {"interleaved": "ScheduleInterleaved1F1B", "zb-v": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}
    return {k: getattr(tp, n) for k, n in names.items() if hasattr(tp, n)}


class SavedActivations:
    """Bytes of tensors autograd saves for backward inside the chunks' forwards, each storage
    counted once (parameters excluded): ``peak`` held at once while the ``with`` block runs,
    ``total`` saved in it. Counted until the saved tensor dies, so inputs a deferred W op keeps
    count until that W (the graph a W op may record on the side is not an activation)."""

    def __init__(self, chunks):
        from megalite.memory import _storage_key

        self.key, self.chunks, self.depth = _storage_key, chunks, 0
        self.params = {_storage_key(q) for c in chunks for q in c.parameters()}
        self.live, self.seen, self.peak, self.total = {}, set(), 0, 0

    def _enter_forward(self, *_):
        self.depth += 1

    def _leave_forward(self, *_):
        self.depth -= 1

    def _pack(self, t):
        k = self.key(t)
        if self.depth and k not in self.params and id(t) not in self.seen:
            self.seen.add(id(t))
            n, refs = self.live.get(k, (t.untyped_storage().nbytes(), 0))
            self.live[k] = (n, refs + 1)
            if refs == 0:  # first tensor on this storage: its bytes are new
                self.total += n
            self.peak = max(self.peak, sum(b for b, _ in self.live.values()))
            weakref.finalize(t, self._release, k, id(t))
        return t

    def _release(self, k, tid):
        self.seen.discard(tid)
        n, refs = self.live.pop(k)
        if refs > 1:
            self.live[k] = (n, refs - 1)

    def __enter__(self):
        import torch

        self._handles = [h for c in self.chunks for h in (
            c.register_forward_pre_hook(self._enter_forward),
            c.register_forward_hook(self._leave_forward))]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return self._hooks.__exit__(*exc)


def replayed_bubble(timelines, v_shape):
    """Mean idle fraction when every stage runs the ops it recorded, in the recorded order, each
    taking its recorded time, and every op starts the moment its input exists (instant p2p).
    The measured bubble minus this is time spent outside ops: sends, receives, the executor."""
    from megalite.pipeline_parallel.partition import virtual_stage

    p, v = len(timelines), timelines[0].num_chunks
    queues = [list(t.events) for t in timelines]
    end, clock, busy = {}, [0.0] * p, [sum(e.end - e.start for e in q) for q in queues]
    while any(queues):
        moved = False
        for r, q in enumerate(queues):
            while q:
                e = q[0]
                vs = virtual_stage(p, r, e.chunk, v, v_shape)
                dep = {"F": ("F", vs - 1), "W": ("B", vs),
                       "B": ("B", vs + 1) if vs < p * v - 1 else ("F", vs)}[e.kind]
                if dep[1] >= 0 and (*dep, e.microbatch) not in end:
                    break
                clock[r] = max(clock[r], end.get((*dep, e.microbatch), 0.0)) + e.end - e.start
                end[e.kind, vs, e.microbatch] = clock[r]
                q.pop(0)
                moved = True
        assert moved, "recorded orders wait on each other"
    return sum(1 - b / max(clock) for b in busy) / p


def activation_claim(schedule, p, r, m, v):
    """Micro-batches' worth of activations stage r holds at its peak, as each schedule claims."""
    if schedule == "interleaved":  # Megatron's warm-up: 2(p-r-1) + (v-1)p chunk forwards, +1
        return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) / v
    if schedule == "zb-v":  # the V: every rank holds what 1F1B's stage 0 holds (2p half-chunks)
        return min(m, p)
    if schedule == "dualpipev":  # DeepSeek's DualPipe README: PP + 1
        return p + 1
    return min(m, p - r)  # 1F1B, ZB-H1


def _measure(args, ps, m):
    """Round-robin over the variants, so that load from other jobs hits all of them alike."""
    import torch
    import torch.distributed as dist

    from megalite import collectives as C
    from megalite.pipeline_parallel.timeline import bubble_stats, gather_timelines

    p = ps.pp_size
    variants = {}
    for schedule in args.schedules:
        if schedule == "interleaved" and (m % p or args.layers % (p * args.vpp)):
            continue
        if schedule in V_SCHEDULES and (m < 2 * p or args.layers % (2 * p)):
            continue
        variants[schedule] = _megalite_runner(args, ps, schedule, m)
        if args.compare_batched:
            variants[schedule + " batched"] = _megalite_runner(args, ps, schedule, m, "batched")
        if (schedule == "1f1b" or schedule in _torch_schedules()) and not args.no_torch_pipelining:
            variants["torch " + schedule] = _torch_pipelining_runner(args, ps, schedule, m)
    times = {k: [] for k in variants}
    timelines = {k: [] for k in variants}
    for it in range(args.warmup + args.iters):
        for name, (step, chunks) in variants.items():
            for c in chunks:
                c.zero_grad(set_to_none=True)
            C.barrier(group=ps.pp_group)
            t = time.perf_counter()
            tl = step()
            dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=ps.device)
            C.all_reduce(dt, op=C.ReduceOp.MAX, group=ps.pp_group)
            if it >= args.warmup:
                times[name].append(dt.item())
                if tl is not None:
                    timelines[name].append(gather_timelines(tl, ps))
    mem = {}
    for name, (step, chunks) in variants.items():  # one untimed step each: hooks cost time
        for c in chunks:
            c.zero_grad(set_to_none=True)
        C.barrier(group=ps.pp_group)
        with SavedActivations(chunks) as acts:
            step()
        mem[name] = acts.peak / (acts.total / m)
    out = {}
    for name in variants:
        med = statistics.median(times[name])
        entry = {"step_s": med, "steps_s": times[name], "act_peak": mem[name]}
        if timelines[name]:
            # the timeline of the step closest to the median step time
            i = min(range(len(times[name])), key=lambda j: abs(times[name][j] - med))
            entry["stats"] = bubble_stats(timelines[name][i])
            entry["replay"] = replayed_bubble(timelines[name][i], name.split()[0] in V_SCHEDULES)
            entry["timelines"] = timelines[name][i]
        out[name] = entry
    return out


def _worker(rank, world, port, args, queue):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    from megalite.parallel_state import initialize_model_parallel
    from megalite.pipeline_parallel.timeline import theory_bubble, write_chrome_trace

    ps = initialize_model_parallel(1, world, backend="gloo", device="cpu")
    rows = []
    try:
        for m in args.micro_batches:
            res = _measure(args, ps, m)
            for schedule in args.schedules + [s + " batched" for s in args.schedules]:
                if schedule not in res:
                    continue
                st = res[schedule]["stats"]
                base_schedule = schedule.split()[0]
                v = (args.vpp if base_schedule == "interleaved" else
                     2 if base_schedule in V_SCHEDULES else 1)
                row = {"schedule": schedule, "m": m, "p": world, "v": v,
                       "step_s": res[schedule]["step_s"], "steps_s": res[schedule]["steps_s"],
                       "bubble": st["bubble_fraction"], "replay": res[schedule]["replay"],
                       "theory": theory_bubble(base_schedule, world, m, v, st["t_f"], st["t_b"],
                                               st["t_w"], st["step_time"]),
                       "t_f": st["t_f"], "t_b": st["t_b"], "t_w": st["t_w"],
                       "peak_in_flight_stage0": st["peak_in_flight"][0],
                       "act_peak": res[schedule]["act_peak"],
                       "act_claim": activation_claim(base_schedule, world, rank, m, v)}
                if "torch " + schedule in res:
                    row["torch_step_s"] = res["torch " + schedule]["step_s"]
                    row["torch_act_peak"] = res["torch " + schedule]["act_peak"]
                rows.append(row)
                if rank == 0 and args.trace_dir and m == args.trace_m and " " not in schedule:
                    os.makedirs(args.trace_dir, exist_ok=True)
                    write_chrome_trace(res[schedule]["timelines"], os.path.join(
                        args.trace_dir, f"pipeline_{schedule}_p{world}_m{m}.trace.json"))
                if rank == 0:
                    print(json.dumps(row), flush=True)
        queue.put((rank, rows, None))
    except BaseException as e:  # report to the parent instead of hanging it
        import traceback

        queue.put((rank, None, traceback.format_exc()))
        raise e


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vpp", type=int, default=2, help="chunks per rank for interleaved")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    ap.add_argument("--micro-batches", default="2,4,8,16")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--schedules", default="1f1b,interleaved,zb-h1,zb-v,dualpipev")
    ap.add_argument("--no-torch-pipelining", action="store_true")
    ap.add_argument("--compare-batched", action="store_true",
                    help="also run each schedule with the batched p2p program that NCCL uses "
                         "(gloo runs the eager one by default; docs/pipeline_parallel.md)")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--trace-m", type=int, default=8, help="m whose traces --trace-dir keeps")
    ap.add_argument("--json", default=None, help="write the result rows here")
    args = ap.parse_args(argv)
    args.micro_batches = [int(x) for x in args.micro_batches.split(",")]
    args.schedules = args.schedules.split(",")
    cpus = os.cpu_count() or 1
    if args.pp < 2:
        raise SystemExit("--pp must be >= 2 to measure a pipeline")
    if args.pp > cpus:
        raise SystemExit(f"--pp {args.pp} needs {args.pp} processes but this machine has {cpus} "
                         f"CPUs: stages would wait for cores, not for each other; "
                         f"use --pp <= {cpus}")
    if args.layers % args.pp:
        raise SystemExit(f"--layers ({args.layers}) must be divisible by --pp ({args.pp})")
    if any(m < args.pp for m in args.micro_batches):
        raise SystemExit(f"every --micro-batches value must be >= --pp ({args.pp})")

    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_utils import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.pp, port, args, queue))
             for r in range(args.pp)]
    for pr in procs:
        pr.start()
    results = {}
    for _ in procs:
        rank, rows, err = queue.get()
        if err:
            for pr in procs:
                pr.kill()
            raise SystemExit(f"rank {rank} failed:\n{err}")
        results[rank] = rows
    for pr in procs:
        pr.join()
    rows = results[0]
    base = {r["m"]: r["step_s"] for r in rows if r["schedule"] == "1f1b"}
    print(f"\np={args.pp}, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"micro-batch {args.mbs}, {cpus} CPUs (1 thread per stage)")
    print("| schedule | m | step (s) | measured bubble | theory | replay | vs 1F1B "
          "| torch.pipelining (s) | megalite / torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        torch_s = r.get("torch_step_s")
        name = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        t_col = "-" if torch_s is None else f"{torch_s:.3f}"
        ratio = "-" if torch_s is None else f"{r['step_s'] / torch_s:.3f}"
        print(f"| {name} | {r['m']} | {r['step_s']:.3f} | {100 * r['bubble']:.1f}% | "
              f"{100 * r['theory']:.1f}% | {100 * r['replay']:.1f}% | {r['step_s'] / base[r['m']]:.3f} | {t_col} | "
              f"{ratio} |")
    print("\npeak activations per stage, in micro-batches of that stage's activations "
          "(measured / claimed; torch: measured)")
    print("| schedule | m | " + " | ".join(f"stage {r}" for r in range(args.pp)) +
          " | torch.pipelining |")
    print("|---|---|" + "---|" * (args.pp + 1))
    for i, r in enumerate(rows):
        per_stage = [results[k][i] for k in range(args.pp)]
        torch_col = " / ".join(f"{x['torch_act_peak']:.2f}" for x in per_stage
                               if "torch_act_peak" in x) or "-"
        print(f"| {r['schedule']} | {r['m']} | " + " | ".join(
            f"{x['act_peak']:.2f} / {x['act_claim']:.2f}" for x in per_stage) + f" | {torch_col} |")
    for sched in ("zb-h1", "zb-v", "dualpipev"):
        zb = [r for r in rows if r["schedule"] == sched]
        if zb:
            print(f"{sched} measured op times (s): " + ", ".join(
                f"m={r['m']}: T_F {r['t_f']:.3f} T_B {r['t_b']:.3f} T_W {r['t_w']:.3f}"
                for r in zb))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpus": cpus, "rows": rows,
                       "rows_per_rank": [results[k] for k in range(args.pp)]}, f, indent=1)


if __name__ == "__main__":
    main()
