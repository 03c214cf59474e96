"""Single-device training throughput: megalite GPTModel vs Hugging Face GPT2LMHeadModel.

Both models get the identical GPT-2 configuration and the identical weights (megalite's are
exported to HF through megalite.convert), and run the same training step: forward, next-token
cross entropy, backward, torch.optim.AdamW step, fp32, dropout 0. HF uses
``attn_implementation="sdpa"`` (the same fused attention kernel megalite calls) and its own loss
path (``labels=``), as an HF user trains. Steps alternate between the two models step by step,
so drift in machine load (the benchmark box is shared) hits both alike; each figure is the median
over the timed steps (the best step and the median of per-round ratios are printed too).
Tokens/s = micro-batch x sequence length / step time.

    OMP_NUM_THREADS=2 python benchmarks/single_device.py            # defaults: docs/performance.md
    python benchmarks/single_device.py --num-layers 2 --rounds 4     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import ModelConfig  # noqa: E402
from megalite.convert.hf import megalite_to_hf_state_dict, model_config_to_hf_config  # noqa: E402
from megalite.convert.sharding import full_state_dict  # noqa: E402
from megalite.models import GPTModel  # noqa: E402
from megalite.parallel_state import ParallelState  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-attention-heads", type=int, default=6)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch.set_num_threads (default: all cores)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model before timing")
    p.add_argument("--rounds", type=int, default=10,
                   help="timed rounds; each runs one step of each model, alternating the order")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--profile", action="store_true",
                   help="print a torch.profiler table of one megalite step and one HF step")
    p.add_argument("--json", action="store_true", help="also print one JSON line of the results")
    args = p.parse_args(argv)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "vocab_size", "threads", "rounds"):
        if getattr(args, name) is None or getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    return args


def build_models(args):
    cfg = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        vocab_size=args.vocab_size, activation="gelu_tanh", hidden_dropout=0.0,
        attention_dropout=0.0)
    megalite_model = GPTModel(cfg, ParallelState(), seed=args.seed)

    from transformers import GPT2LMHeadModel

    hf_config = model_config_to_hf_config(cfg, attn_implementation="sdpa")
    hf_model = GPT2LMHeadModel(hf_config)
    hf_sd = megalite_to_hf_state_dict(full_state_dict(megalite_model), cfg)
    missing, unexpected = hf_model.load_state_dict(hf_sd, strict=False)
    # lm_head.weight is tied to wte (re-tied by HF), so it is the only acceptable "missing" key.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weight copy to HF failed: missing {missing}, unexpected {unexpected}")
    assert hf_model.config._attn_implementation == "sdpa"
    return cfg, megalite_model.train(), hf_model.train()


def timed_rounds(steps: dict, rounds: int, warmup: int = 0, profile: bool = False) -> dict:
    """name -> seconds of each of its steps: one step of every model per round, the order
    rotated each round (AB BA AB ... for two), so adjacent steps see nearly the same machine load
    and the per-round ratios are robust to load drift on a shared box. First ``warmup`` untimed
    steps of each, and with ``profile`` one profiled step of each (profile_step)."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    if profile:
        for name, step in steps.items():
            profile_step(name, step)
    times = {name: [] for name in steps}
    order = list(steps)
    for r in range(rounds):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def make_step(name, model, tokens, labels):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    if name == "megalite":
        def loss_fn():
            return model(tokens, labels=labels).mean()
    else:
        def loss_fn():  # HF shifts labels internally: the loss covers s-1 positions
            return model(input_ids=tokens, labels=tokens).loss

    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def profile_step(name, step):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"\n== profile: {name} ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg, ml, hf = build_models(args)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                        generator=g)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    # Same weights, same data: the first losses must agree (a check that the comparison is fair).
    # HF's loss covers the s-1 positions whose target is inside `tokens`.
    with torch.no_grad():
        l_ml = ml(tokens, labels=labels)[:, :-1].mean().item()
        l_hf = hf(input_ids=tokens, labels=tokens).loss.item()
    steps = {"megalite": make_step("megalite", ml, tokens, labels),
             "hf": make_step("hf", hf, tokens, labels)}
    times = timed_rounds(steps, args.rounds, args.warmup, args.profile)
    order = list(steps)

    tokens_per_step = args.micro_batch_size * args.seq_length
    result = {"threads": args.threads, "torch": torch.__version__,
              "params": cfg.num_parameters(), "tokens_per_step": tokens_per_step,
              "initial_loss": {"megalite": l_ml, "hf": l_hf}}
    print(f"config: L={args.num_layers} h={args.hidden_size} a={args.num_attention_heads} "
          f"s={args.seq_length} b={args.micro_batch_size} V={args.vocab_size} fp32 dropout=0 "
          f"AdamW; threads={args.threads}; params={cfg.num_parameters() / 1e6:.2f}M; "
          f"HF attn_implementation=sdpa")
    print(f"initial loss (same weights, same batch): megalite {l_ml:.6f}  HF {l_hf:.6f}")
    print(f"{'model':<10} {'median step s':>14} {'tokens/s':>10} {'best step s':>12} "
          f"{'best tokens/s':>14}   ({args.rounds} timed steps each)")
    for name in order:
        med, best = statistics.median(times[name]), min(times[name])
        result[name] = {"median_step_s": med, "tokens_per_s": tokens_per_step / med,
                        "best_step_s": best, "best_tokens_per_s": tokens_per_step / best,
                        "steps_s": times[name]}
        print(f"{name:<10} {med:>14.4f} {tokens_per_step / med:>10.1f} {best:>12.4f} "
              f"{tokens_per_step / best:>14.1f}")
    ratio = result["megalite"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    paired = statistics.median(h / m for h, m in zip(times["hf"], times["megalite"]))
    best_ratio = result["megalite"]["best_tokens_per_s"] / result["hf"]["best_tokens_per_s"]
    result.update(ratio_megalite_over_hf=ratio, paired_ratio_median=paired, best_ratio=best_ratio)
    print(f"ratio megalite/HF (tokens/s): {ratio:.3f}x of medians, {paired:.3f}x median of "
          f"per-round ratios, {best_ratio:.3f}x of best steps")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
