"""MoE on the CPU: megalite's MoE GPT train step against HF's MixtralForCausalLM, and expert
memory per rank under expert parallelism.

1. Step time, one process: megalite ``GPTModel`` (``--num-experts``, top-k, SwiGLU experts,
   RMSNorm, RoPE, no biases, untied) with the experts as one grouped GEMM and as a loop, beside
   Hugging Face's ``MixtralForCausalLM`` of the same shape with each of its experts
   implementations (``experts_implementation``: grouped_mm, batched_mm, eager). The step is
   benchmarks/single_device.py's (forward, loss, backward, torch.optim.AdamW), fp32, dropout 0,
   attention through SDPA on both sides; the router's balancing loss is off on both (megalite's
   ``moe_aux_loss_coeff`` 0, HF's ``output_router_logits`` False) and HF's router jitter is 0.
   HF's model holds megalite's weights (exported by megalite/convert/hf.py, read by
   ``from_pretrained``), so both route alike and start from the same loss (checked). Each round
   runs one step of every configuration, the order rotated each round
   so machine load hits all alike; figures are medians.
2. Expert memory per rank, EP 1, 2, 4: EP gloo processes (DP = EP, so EDP = 1), the same model
   through megalite's DDP and ``build_optimizer`` at ZeRO 0, one step, then rank 0's bytes of
   expert parameters, their gradient buffer and their AdamW moments, from tensor storages
   (megalite/memory.py).

    OMP_NUM_THREADS=1 python benchmarks/moe.py --json /tmp/moe.json      # docs/performance.md
    OMP_NUM_THREADS=1 python benchmarks/moe.py --num-layers 1 --rounds 2 --ep 1,2   # a look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE, os.path.join(os.path.dirname(HERE), "tests")]

from single_device import make_step, timed_rounds  # noqa: E402

from megalite.config import ExecutionConfig, ModelConfig  # noqa: E402

HF_EXPERTS = ("grouped_mm", "batched_mm", "eager")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("num-layers", 4), ("hidden-size", 256), ("num-attention-heads", 4),
                          ("num-experts", 8), ("moe-router-topk", 2), ("moe-ffn-hidden-size", 512),
                          ("seq-length", 256), ("micro-batch-size", 2), ("vocab-size", 8192),
                          ("warmup", 2), ("rounds", 7), ("threads", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hf-experts", default=",".join(HF_EXPERTS),
                   help=f"HF experts implementations to time, from {', '.join(HF_EXPERTS)}")
    p.add_argument("--ep", default="1,2,4", help="EP sizes for the memory table ('' skips it)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="print a torch.profiler table of one step of each configuration")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    args = p.parse_args(argv)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_experts",
                 "moe_router_topk", "moe_ffn_hidden_size", "seq_length", "micro_batch_size",
                 "vocab_size", "rounds", "threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    args.hf_experts = [s for s in args.hf_experts.split(",") if s]
    bad = sorted(set(args.hf_experts) - set(HF_EXPERTS))
    if bad:
        p.error(f"--hf-experts: unknown {', '.join(bad)}; valid: {', '.join(HF_EXPERTS)}")
    try:
        args.ep = [int(e) for e in args.ep.split(",") if e]
    except ValueError:
        p.error(f"--ep must be a comma-separated list of integers, got {args.ep!r}")
    if any(e <= 0 or args.num_experts % e for e in args.ep):
        p.error(f"--ep: every size must divide --num-experts ({args.num_experts}), got {args.ep}")
    return args


def model_config(args) -> ModelConfig:
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        vocab_size=args.vocab_size, make_vocab_size_divisible_by=8,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
        attention_dropout=0.0, num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size)


def hf_model(args, cfg: ModelConfig, experts: str, weights_dir: str):
    """HF's MixtralForCausalLM with megalite's weights, as a user gets it: megalite's model
    exported (megalite/convert/hf.py) to ``weights_dir`` and read by ``from_pretrained`` with
    the ``experts_implementation`` to time."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(
        weights_dir, experts_implementation=experts, attn_implementation="sdpa",
        output_router_logits=False, router_jitter_noise=0.0, attention_dropout=0.0)
    assert model.config._experts_implementation == experts, model.config._experts_implementation
    assert model.config._attn_implementation == "sdpa"
    return model.train()


def export_to_hf(model, cfg: ModelConfig, out_dir: str) -> None:
    """megalite's weights as a Hugging Face Mixtral directory (config + safetensors)."""
    from safetensors.torch import save_file

    from megalite.convert.hf import megalite_to_hf_state_dict, model_config_to_hf_config

    model_config_to_hf_config(cfg, max_position_embeddings=cfg.seq_length).save_pretrained(out_dir)
    sd = megalite_to_hf_state_dict({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out_dir,
                                                                       "model.safetensors"),
              metadata={"format": "pt"})


def throughput(args) -> dict:
    from megalite.models import GPTModel
    from megalite.parallel_state import ParallelState

    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                        generator=g)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    models, steps = {}, {}
    for grouped in (True, False):
        cfg = model_config(args)
        name = f"megalite {'grouped' if grouped else 'loop'}"
        models[name] = GPTModel(cfg, ParallelState(), seed=args.seed,
                                execution=ExecutionConfig(moe_grouped_gemm=grouped)).train()
        steps[name] = make_step("megalite", models[name], tokens, labels)
    weights = tempfile.mkdtemp(prefix="moe_hf_")
    export_to_hf(models["megalite grouped"], cfg, weights)
    for experts in args.hf_experts:
        name = f"HF {experts}"
        models[name] = hf_model(args, cfg, experts, weights)
        steps[name] = make_step("hf", models[name], tokens, labels)
    shutil.rmtree(weights)
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    first_loss = {n: s() for n, s in steps.items()}  # also the first warm-up step
    # the same weights on both sides: the same routing, hence the same first loss
    spread = max(first_loss.values()) - min(first_loss.values())
    assert spread < 1e-4 * abs(first_loss["megalite grouped"]), first_loss
    times = timed_rounds(steps, args.rounds, args.warmup - 1, args.profile)
    order = list(steps)
    med = {n: statistics.median(t) for n, t in times.items()}
    hf_names = [n for n in order if n.startswith("HF")]
    fastest = min(hf_names, key=med.get) if hf_names else None
    out = {"params": params, "first_loss": first_loss, "steps_s": times,
           "median_ms": {n: 1e3 * v for n, v in med.items()}, "hf_fastest": fastest}
    if fastest:
        # HF's fastest time / megalite's: > 1 means megalite is faster; paired: the median of
        # the per-round ratios (the steps of one round saw nearly the same machine load)
        out["speedup_vs_hf_fastest"] = {
            n: {"of_medians": med[fastest] / med[n],
                "paired_median": statistics.median(
                    a / b for a, b in zip(times[fastest], times[n]))}
            for n in order if n.startswith("megalite")}
    return out


def _memory_worker(rank, world_size, args):
    from megalite.config import OptimizerConfig
    from megalite.distributed.ddp import wrap_chunks
    from megalite.memory import distinct_storage_bytes
    from megalite.models import GPTModel
    from megalite.optimizer import build_optimizer
    from megalite.parallel_state import initialize_model_parallel
    from megalite.param_meta import grad_of, param_meta

    ps = initialize_model_parallel(1, 1, expert_model_parallel_size=world_size, backend="gloo",
                                   device="cpu", set_default=False)
    ocfg = OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0, zero_stage=0).validate()
    chunks, _, finalize = wrap_chunks([GPTModel(model_config(args), ps, seed=args.seed)], ocfg, ps)
    opt = build_optimizer(chunks, ocfg, ps)
    g = torch.Generator().manual_seed(args.seed + rank)
    ids = torch.randint(0, args.vocab_size, (1, args.seq_length + 1), generator=g)
    opt.zero_grad()
    chunks[0](ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    finalize()
    opt.step()
    pairs = list(zip(opt.model_params, opt.masters))
    expert = [(p, m) for p, m in pairs if param_meta(p).expert]
    states = [v for _, m in expert for k, v in opt.inner.state[m].items()
              if k != "step" and isinstance(v, torch.Tensor)]
    params = distinct_storage_bytes(p for p, _ in expert)
    masters = distinct_storage_bytes(m for _, m in expert) if opt.mixed else 0
    return {"ep": ps.ep_size, "edp": ps.edp_size, "expert_numel": sum(p.numel() for p, _ in expert),
            "params_bytes": params, "master_bytes": masters,
            "grads_bytes": distinct_storage_bytes(grad_of(p) for p, _ in expert),
            "optimizer_state_bytes": distinct_storage_bytes(states),
            "all_params_bytes": distinct_storage_bytes(p for p, _ in pairs)}


def memory(args) -> list:
    from dist_utils import run_distributed

    rows = []
    for ep in args.ep:
        r = run_distributed(_memory_worker, ep, args, timeout=600)[0]
        r["params_plus_state_bytes"] = (r["params_bytes"] + r["master_bytes"]
                                        + r["optimizer_state_bytes"])
        rows.append(r)
    base = rows[0]  # EP 1 when --ep starts with 1: the target is 1/EP of its bytes, plus 5%
    for r in rows:
        r["fraction_of_base"] = r["params_plus_state_bytes"] / base["params_plus_state_bytes"]
        r["target_fraction"] = 1.05 * base["ep"] / r["ep"]
        r["target_met"] = r["fraction_of_base"] <= r["target_fraction"]
    return rows


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"torch": torch.__version__, "threads": args.threads,
              "config": {k: v for k, v in vars(args).items() if k not in ("json", "profile")}}
    print(f"config: L={args.num_layers} h={args.hidden_size} a={args.num_attention_heads} "
          f"E={args.num_experts} top-{args.moe_router_topk} moe-ffn={args.moe_ffn_hidden_size} "
          f"SwiGLU RMSNorm RoPE no-bias untied s={args.seq_length} b={args.micro_batch_size} "
          f"V={args.vocab_size} fp32 AdamW, aux loss off both sides; threads={args.threads}")
    if not args.skip_throughput:
        t = result["throughput"] = throughput(args)
        print(f"\n{'configuration':<20} {'median ms/step':>15} {'HF fastest / this':>18} "
              f"{'paired':>7} {'params':>10} {'first loss':>11}   ({args.rounds} rounds)")
        for name, ms in t["median_ms"].items():
            sp = t.get("speedup_vs_hf_fastest", {}).get(name)
            ratio = f"{sp['of_medians']:>17.3f}x {sp['paired_median']:>6.3f}x" if sp else \
                f"{'':>18} {'':>7}"
            print(f"{name:<20} {ms:>15.1f} {ratio} {t['params'][name]:>10,} "
                  f"{t['first_loss'][name]:>11.4f}")
        if t["hf_fastest"]:
            best = max(v["of_medians"] for v in t["speedup_vs_hf_fastest"].values())
            print(f"HF fastest: {t['hf_fastest']}; target HF fastest / megalite >= 1.1: "
                  f"{'met' if best >= 1.1 else 'not met'} ({best:.3f}x, best megalite path)")
    if args.ep:
        rows = result["memory"] = memory(args)
        mib = 2.0 ** 20
        print(f"\n{'EP':>3} {'EDP':>4} {'expert params':>14} {'Adam moments':>13} "
              f"{'grads':>8} {'params+state':>13} {'x EP1':>7} {'target <=':>10}  (MiB, rank 0)")
        for r in rows:
            print(f"{r['ep']:>3} {r['edp']:>4} {r['params_bytes'] / mib:>14.3f} "
                  f"{r['optimizer_state_bytes'] / mib:>13.3f} {r['grads_bytes'] / mib:>8.3f} "
                  f"{r['params_plus_state_bytes'] / mib:>13.3f} {r['fraction_of_base']:>7.4f} "
                  f"{r['target_fraction']:>10.4f}  {'met' if r['target_met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
