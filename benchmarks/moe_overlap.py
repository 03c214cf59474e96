"""Exposed all-to-all time of the combined 1F1B (--overlap-moe-expert-parallel-comm, and with
--delay-wgrad-compute) at EP 2 x PP 1.

    OMP_NUM_THREADS=1 python benchmarks/moe_overlap.py [--json PATH]      # docs/moe.md's table

Two gloo CPU processes (EP 2 folded over DP 2), one thread each, run the same MoE GPT's
forward-backward (the no-pipelining schedule, m micro-batches) without the overlap, with it, and
with it and the experts' deferred weight gradients (W), one step of each in turn per round, so
load from other jobs hits all alike. Each step records the executor's op timeline
(``timing_log_level`` 1): F and B spans, and "A" events, the intervals the computing side spent
blocked on an all-to-all (the whole call without the overlap; its issue and its final wait with
it, "I" and "A", ``overlap.exchange``), and "W" events, the deferred weight
gradients' runs (compute, not exposed time). Exposed all-to-all time is the sum of a step's A and
I (issue) events; per step, the slower rank's; medians over the timed rounds. The gradients of
the three variants are checked equal (bit for bit) after the first round.
--trace PATH writes rank 0's last timeline of each variant as a Chrome trace for
tools/plot_pipeline.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]


# --overlap-moe-expert-parallel-comm off, on, and on with --delay-wgrad-compute
VARIANTS = ("plain", "overlap", "overlap+delay_wgrad")


def argument_parser(description: str, **defaults) -> argparse.ArgumentParser:
    """The model, batch and rounds flags (with this benchmark's defaults, or ``defaults``), the
    routing, --json and --trace: shared with benchmarks/moe_overlap_pipeline.py."""
    p = argparse.ArgumentParser(description=description)
    base = {"num-layers": 2, "hidden-size": 512, "num-attention-heads": 4, "num-experts": 8,
            "moe-router-topk": 2, "moe-ffn-hidden-size": 1024, "seq-length": 256,
            "micro-batch-size": 2, "micro-batches": 16, "vocab-size": 1024, "warmup": 2,
            "rounds": 8, "seed": 1234}
    for name, default in base.items():
        p.add_argument(f"--{name}", type=int, default=defaults.get(name.replace("-", "_"), default))
    p.add_argument("--imbalanced", dest="balanced", action="store_false",
                   help="route as the router says (default: evenly, as published MoE "
                        "benchmarks force it, so the ranks' expert compute is equal)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--trace", metavar="PATH", help="Chrome traces, PATH.{plain,overlap,"
                   "overlap+delay_wgrad}.json")
    return p


def parse_args(argv=None):
    p = argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--all-timelines", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_config(args):
    from megalite.config import ModelConfig

    return ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                       vocab_size=args.vocab_size, make_vocab_size_divisible_by=128,
                       hidden_dropout=0.0, attention_dropout=0.0, num_experts=args.num_experts,
                       moe_router_topk=args.moe_router_topk,
                       moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                       moe_router_force_load_balancing=args.balanced).validate()


def worker(rank, world_size, args):
    import torch

    from megalite.models import GPTModel
    from megalite.parallel_state import initialize_model_parallel
    from megalite.pipeline_parallel.executor import get_forward_backward_func
    from megalite.pipeline_parallel.timeline import exposed_a2a_seconds

    torch.set_num_threads(1)
    ps = initialize_model_parallel(1, 1, expert_model_parallel_size=world_size, backend="gloo",
                                   device="cpu", set_default=False)
    model = GPTModel(model_config(args), ps, seed=args.seed).train()
    fb = get_forward_backward_func(1)
    m, b, s = args.micro_batches, args.micro_batch_size, args.seq_length
    g = torch.Generator().manual_seed(args.seed + rank)  # each DP rank its own tokens
    ids = torch.randint(0, args.vocab_size, (m * b, s + 1), generator=g)
    batches = [(ids[j * b:(j + 1) * b, :-1], ids[j * b:(j + 1) * b, 1:]) for j in range(m)]
    ntok = m * b * s

    def forward_step(it, chunk):
        tokens, labels = next(it)
        out = chunk(tokens, labels=labels)
        return out, lambda t: (t.sum() / ntok, {})

    def step(name: str):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(args.seed + rank)  # the balanced router's draws: alike in all
        fb(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
           num_microbatches=m, parallel_state=ps, timing_log_level=1,
           overlap_moe_expert_parallel_comm=name != "plain",
           delay_wgrad_compute=name == "overlap+delay_wgrad")
        tl = fb.last_timeline()
        wait = sum(e.end - e.start for e in tl.events if e.kind == "A")
        return {"step_s": tl.end, "exposed_a2a_s": exposed_a2a_seconds(tl), "wait_s": wait,
                "issue_s": exposed_a2a_seconds(tl) - wait, "a2a_calls": sum(e.kind == "A" for e in tl.events),
                "w_s": sum(e.end - e.start for e in tl.events if e.kind == "W")}, tl

    out = {name: [] for name in VARIANTS}
    last, grads = {}, {}
    for r in range(args.warmup + args.rounds):
        shift = r % len(VARIANTS)  # each variant first in turn
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            rec, last[name] = step(name)
            if r == 0:
                grads[name] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            if r >= args.warmup:
                out[name].append(rec)
    same = all(len(grads[name]) == len(grads["plain"]) and all(
        torch.equal(x, y) for x, y in zip(grads["plain"], grads[name])) for name in VARIANTS)
    return {**out, "grads_bit_identical": same,
            "timelines": {name: last[name].to_dict() for name in VARIANTS}
            if rank == 0 or args.all_timelines else None}


def summarise(per_rank):
    """Per variant: medians over rounds of the slower rank's step and exposed time."""
    res = {}
    for name in VARIANTS:
        rounds = list(zip(*[r[name] for r in per_rank]))
        res[name] = {k: statistics.median(max(x[k] for x in rnd) for rnd in rounds)
                     for k in ("step_s", "exposed_a2a_s", "wait_s", "issue_s", "w_s")}
        res[name]["a2a_calls_per_step"] = rounds[0][0]["a2a_calls"]
    for name in VARIANTS[1:]:
        res[name]["exposed_ratio"] = res[name]["exposed_a2a_s"] / res["plain"]["exposed_a2a_s"]
        res[name]["step_ratio"] = res[name]["step_s"] / res["plain"]["step_s"]
    res["exposed_ratio"] = res["overlap"]["exposed_ratio"]
    res["step_ratio"] = res["overlap"]["step_ratio"]
    res["grads_bit_identical"] = all(r["grads_bit_identical"] for r in per_rank)
    return res


def main(argv=None):
    from dist_utils import run_distributed
    from megalite.pipeline_parallel.timeline import StageTimeline, write_chrome_trace

    args = parse_args(argv)
    per_rank = run_distributed(worker, 2, args, timeout=900)
    res = summarise(per_rank)
    res["args"] = vars(args)
    print(f"EP2 x PP1, 2 processes, m={args.micro_batches}, medians of {args.rounds} rounds "
          f"(slower rank per step)")
    print(f"{'variant':20s} {'step ms':>9s} {'exposed a2a ms':>15s} {'of it wait':>11s} "
          f"{'issue':>7s} {'W ms':>7s} {'a2a calls':>10s} {'exposed/plain':>14s}")
    for name in VARIANTS:
        r = res[name]
        ratio = f"{r['exposed_ratio']:.2f}" if "exposed_ratio" in r else "-"
        print(f"{name:20s} {1e3 * r['step_s']:9.1f} {1e3 * r['exposed_a2a_s']:15.2f} "
              f"{1e3 * r['wait_s']:11.2f} {1e3 * r['issue_s']:7.2f} {1e3 * r['w_s']:7.2f} "
              f"{r['a2a_calls_per_step']:10d} {ratio:>14s}")
    print(f"exposed/plain: overlap {res['exposed_ratio']:.2f}, overlap+delay_wgrad "
          f"{res['overlap+delay_wgrad']['exposed_ratio']:.2f} (target <= 0.5); gradients "
          f"bit-identical: {res['grads_bit_identical']}")
    if args.trace:
        for name, d in per_rank[0]["timelines"].items():
            write_chrome_trace([StageTimeline.from_dict(d)], f"{args.trace}.{name}.json")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
