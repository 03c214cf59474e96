"""Exposed all-to-all time of the pipelined F&B pairs (--overlap-moe-expert-parallel-comm) at
EP 2 x PP 2.

    OMP_NUM_THREADS=1 python benchmarks/moe_overlap_pipeline.py [--schedule dualpipev] [--json P]

Four gloo CPU processes (two pipeline stages, each an EP 2 group folded over its DP 2), one
thread each, run the same MoE GPT's pipelined forward-backward without and with the pairs (and with
--delay-wgrad-compute), one step of each in turn per round. Exposed all-to-all time is, as in benchmarks/moe_overlap.py
(EP 2 x PP 1), the time the compute thread spends blocked in all-to-alls: the A (waiting) and I
(issuing) events of the executor's op timeline; per step the slowest rank's, medians over the
timed rounds. Four processes share two cores here, so the figures show that the pairs hide their
exchanges at PP > 1, not what a GPU would gain. The gradients of the two variants are checked
equal bit for bit. --trace PATH writes every stage's last timeline of each variant as a Chrome
trace (PATH.{plain,overlap,overlap+delay_wgrad}.json) for tools/plot_pipeline.py.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests"), HERE]

# the same model, flags and variants as at PP 1
from moe_overlap import VARIANTS, argument_parser, model_config  # noqa: E402

WORLD = 4  # PP 2 x (EP 2 over DP 2)


def parse_args(argv=None):
    p = argument_parser(__doc__.split("\n\n")[0], num_layers=4, hidden_size=256,
                        moe_ffn_hidden_size=512, seq_length=128, micro_batches=8, warmup=1,
                        rounds=4)
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "dualpipev", "zb-v"))
    return p.parse_args(argv)


def worker(rank, world_size, args):
    import torch

    from megalite.config import V_SCHEDULES
    from megalite.distributed.finalize_model_grads import finalize_model_grads
    from megalite.parallel_state import initialize_model_parallel
    from megalite.pipeline_parallel.executor import get_forward_backward_func
    from megalite.pipeline_parallel.partition import build_model_chunks
    from megalite.pipeline_parallel.timeline import exposed_a2a_seconds

    torch.set_num_threads(1)
    ps = initialize_model_parallel(1, 2, expert_model_parallel_size=2, backend="gloo",
                                   device="cpu", set_default=False)
    chunks = build_model_chunks(model_config(args), ps, seed=args.seed,
                                v_shape=args.schedule in V_SCHEDULES)
    for c in chunks:
        c.train()
    fb = get_forward_backward_func(2, ps.vpp_size, args.schedule)
    m, b, s = args.micro_batches, args.micro_batch_size, args.seq_length
    g = torch.Generator().manual_seed(args.seed + ps.dp_rank)  # each DP rank its own tokens
    ids = torch.randint(0, args.vocab_size, (m * b, s + 1), generator=g)
    batches = [(ids[j * b:(j + 1) * b, :-1], ids[j * b:(j + 1) * b, 1:]) for j in range(m)]
    ntok = m * b * s

    def forward_step(it, chunk):
        tokens, labels = next(it)
        return chunk(tokens, labels=labels), lambda t: (t.sum() / ntok, {})

    def step(variant: str):
        overlap, delay = variant != "plain", variant == "overlap+delay_wgrad"
        for c in chunks:
            c.zero_grad(set_to_none=True)
        torch.manual_seed(args.seed + rank)  # the balanced router's draws: alike in both
        fb(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks,
           num_microbatches=m, seq_length=s, micro_batch_size=b, parallel_state=ps,
           timing_log_level=1, overlap_moe_expert_parallel_comm=overlap,
           delay_wgrad_compute=delay,
           finalize_model_grads_func=lambda cs: finalize_model_grads(cs, ps))
        tl = fb.last_timeline()
        wait = sum(e.end - e.start for e in tl.events if e.kind == "A")
        return {"step_s": tl.end, "exposed_a2a_s": exposed_a2a_seconds(tl), "wait_s": wait,
                "issue_s": exposed_a2a_seconds(tl) - wait}, tl

    out, last, grads = {v: [] for v in VARIANTS}, {}, {}
    for r in range(args.warmup + args.rounds):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            rec, last[variant] = step(variant)
            if r == 0:
                grads[variant] = [p.grad.clone() for c in chunks for p in c.parameters()
                                  if p.grad is not None]
            if r >= args.warmup:
                out[variant].append(rec)
    same = all(len(grads[v]) == len(grads["plain"]) and all(
        torch.equal(x, y) for x, y in zip(grads[v], grads["plain"])) for v in VARIANTS)
    return {**out, "grads_bit_identical": same, "pp_rank": ps.pp_rank, "dp_rank": ps.dp_rank,
            "timelines": {v: last[v].to_dict() for v in VARIANTS}}


def summarise(per_rank):
    """Per variant: medians over rounds of the slowest rank's step and exposed time."""
    res = {}
    for name in VARIANTS:
        rounds = list(zip(*[r[name] for r in per_rank]))
        res[name] = {k: statistics.median(max(x[k] for x in rnd) for rnd in rounds)
                     for k in ("step_s", "exposed_a2a_s", "wait_s", "issue_s")}
    for name in VARIANTS[1:]:
        res[f"{name}_exposed_ratio"] = res[name]["exposed_a2a_s"] / res["plain"]["exposed_a2a_s"]
        res[f"{name}_step_ratio"] = res[name]["step_s"] / res["plain"]["step_s"]
    res["grads_bit_identical"] = all(r["grads_bit_identical"] for r in per_rank)
    return res


def main(argv=None):
    from dist_utils import run_distributed
    from megalite.pipeline_parallel.timeline import StageTimeline, write_chrome_trace

    args = parse_args(argv)
    per_rank = run_distributed(worker, WORLD, args, timeout=900)
    res = summarise(per_rank)
    res["args"] = vars(args)
    print(f"EP2 x PP2 ({args.schedule}), 4 processes, m={args.micro_batches}"
          f", medians of {args.rounds} rounds (slowest rank per step)")
    print(f"{'variant':20s} {'step ms':>9s} {'exposed a2a ms':>15s} {'of it wait':>11s} "
          f"{'issue':>7s}")
    for name in VARIANTS:
        r = res[name]
        print(f"{name:20s} {1e3 * r['step_s']:9.1f} {1e3 * r['exposed_a2a_s']:15.2f} "
              f"{1e3 * r['wait_s']:11.2f} {1e3 * r['issue_s']:7.2f}")
    for name in VARIANTS[1:]:
        print(f"{name}/plain: exposed {res[f'{name}_exposed_ratio']:.2f}, step "
              f"{res[f'{name}_step_ratio']:.2f}")
    print(f"gradients bit-identical: {res['grads_bit_identical']}")
    if args.trace:
        for name in VARIANTS:  # DP rank 0 of each stage, stages in order
            stages = sorted((r for r in per_rank if r["dp_rank"] == 0), key=lambda r: r["pp_rank"])
            write_chrome_trace([StageTimeline.from_dict(r["timelines"][name]) for r in stages],
                               f"{args.trace}.{name}.json")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
