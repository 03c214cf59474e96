"""CPU training step of a small Qwen3.5-shaped hybrid: megalite's GPTModel against Hugging Face's
``Qwen3_5ForCausalLM``, both on their torch paths (docs/performance.md, "Hybrid linear
attention").

The same shape on both sides: three Gated DeltaNet layers then one gated softmax layer (partial
RoPE, q/k norms, output gate), zero-centred RMSNorm, SwiGLU, untied embeddings, fp32, dropout 0.
megalite's model is built from a ModelConfig, HF's from a Qwen3_5TextConfig; the parameter counts
are checked equal (each side keeps its own random weights: the step's time does not depend on
them). On the CPU HF takes its torch paths (``torch_chunk_gated_delta_rule``, the torch causal
conv): fla and causal-conv1d run on CUDA only. A step is forward, next-token loss and backward;
steps alternate between the two models round by round, each figure a median. With one thread
(the default) a step is timed in CPU time (time.thread_time), which other jobs on a shared
machine do not inflate; with more, in wall-clock time.

    OMP_NUM_THREADS=1 python benchmarks/linear_attention.py            # docs/performance.md
    python benchmarks/linear_attention.py --seq-length 512 --rounds 3  # a quick look
    python benchmarks/linear_attention.py --profile                    # where the time goes
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
from megalite.models import GPTModel  # noqa: E402
from megalite.parallel_state import ParallelState  # noqa: E402
from single_device import profile_step  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=4, help="a multiple of 4 (3 linear, 1 full)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1, help="1: CPU time; more: wall clock")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--profile", action="store_true",
                   help="print a torch.profiler table of one step of each model")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    args = p.parse_args(argv)
    if args.num_layers <= 0 or args.num_layers % 4:
        p.error(f"--num-layers must be a positive multiple of 4, got {args.num_layers}")
    for name in ("hidden_size", "seq_length", "micro_batch_size", "vocab_size", "threads",
                 "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    return args


# Qwen3.5's proportions at a small width: 4 heads of 64 in 2 KV groups, RoPE on a quarter of each
# head; linear attention with 4 key heads, 8 value heads, 64 channels each
HEADS, GROUPS, LK, LV, DK = 4, 2, 4, 8, 64


def build_models(args):
    h, L = args.hidden_size, args.num_layers
    cfg = ModelConfig(
        num_layers=L, hidden_size=h, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=DK, ffn_hidden_size=3 * h,
        seq_length=args.seq_length, max_position_embeddings=args.seq_length,
        vocab_size=args.vocab_size, make_vocab_size_divisible_by=1,
        position_embedding_type="rope", rotary_percent=0.25, normalization="RMSNorm",
        norm_epsilon=1e-6, swiglu=True, add_bias_linear=False, qk_layernorm=True,
        untie_embeddings_and_output_weights=True, attention_output_gate=True,
        apply_layernorm_1p=True, linear_attention_freq="4", linear_num_key_heads=LK,
        linear_num_value_heads=LV, linear_key_head_dim=DK, linear_value_head_dim=DK,
        hidden_dropout=0.0, attention_dropout=0.0).validate()
    megalite_model = GPTModel(cfg, ParallelState(), seed=1)

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(
        vocab_size=args.vocab_size, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=L,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=DK,
        max_position_embeddings=args.seq_length, rms_norm_eps=1e-6, tie_word_embeddings=False,
        linear_num_key_heads=LK, linear_num_value_heads=LV, linear_key_head_dim=DK,
        linear_value_head_dim=DK, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        layer_types=["full_attention" if cfg.linear_attention_pattern()[i] is False
                     else "linear_attention" for i in range(L)],
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base,
                         "partial_rotary_factor": 0.25},
        attn_implementation="sdpa")
    hf_model = Qwen3_5ForCausalLM(hf_cfg)
    counts = [sum(p.numel() for p in m.parameters()) for m in (megalite_model, hf_model)]
    if counts[0] != counts[1]:
        raise RuntimeError(f"not the same shape: megalite {counts[0]} parameters, HF {counts[1]}")
    return megalite_model.train(), hf_model.train(), counts[0]


def make_step(name, model, tokens, labels):
    def step():
        if name == "megalite":
            loss = model(tokens, labels=labels).mean()
        else:  # HF shifts the labels itself
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ml, hf, params = build_models(args)
    ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    steps = {"megalite": make_step("megalite", ml, tokens, labels),
             "hf": make_step("hf", hf, tokens, labels)}
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    if args.profile:
        for name, step in steps.items():
            profile_step(name, step)
    times = {name: [] for name in steps}
    for r in range(args.rounds):  # the order alternates: AB BA AB ...
        for name in list(steps)[::1 if r % 2 == 0 else -1]:
            t0 = clock()
            steps[name]()
            times[name].append(clock() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = statistics.median(a / b for a, b in zip(times["megalite"], times["hf"]))
    print(f"hybrid {args.num_layers} layers, h {args.hidden_size}, s {args.seq_length}, "
          f"b {args.micro_batch_size}, {params:,} parameters, {args.threads} threads "
          f"({'CPU' if args.threads == 1 else 'wall-clock'} time), torch {torch.__version__}")
    print(f"megalite {med['megalite'] * 1e3:.0f} ms/step, HF {med['hf'] * 1e3:.0f} ms/step, "
          f"median per-round megalite/HF time {ratio:.2f}")
    if args.json:
        print(json.dumps({"megalite_s": med["megalite"], "hf_s": med["hf"], "ratio": ratio,
                          "seq_length": args.seq_length, "threads": args.threads}))


if __name__ == "__main__":
    main()
