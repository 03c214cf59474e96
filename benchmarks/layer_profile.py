"""Per-layer kernel counts and cross-entropy peak memory, for docs/performance.md.

    python benchmarks/layer_profile.py kernels [--dtype bfloat16] [--compile inductor]
    python benchmarks/layer_profile.py ce --tokens 2048 --vocabs 32768,50257 [--blocks compiled]
    python benchmarks/layer_profile.py startup --sizes 125m,350m [--device cuda]
    python benchmarks/layer_profile.py host-overhead [--seq 16 --batch 1 --hidden 64] [--deferrable-linear]
    [torchrun --nproc-per-node 2] benchmarks/layer_profile.py graph-breaks [--sequence-parallel]

``kernels``: one Llama-shaped TransformerLayer (and, separately, the loss head: final norm, output
layer, vocab-parallel cross entropy), forward + backward under torch.profiler. On CUDA it counts
device kernels; on the CPU it counts leaf ATen ops that compute (views and metadata ops are not
kernels), the CPU analogue of kernel launches. ``ce``: one vocab-parallel cross-entropy
forward + backward on ``[tokens, 1, V]`` logits per (V, dtype): median wall and CPU milliseconds
over ``--repeat`` calls after a warm-up, and the largest growth of memory above the logits (on
Linux the process's resident high-water mark is reset before each call; on CUDA, the allocator's
peak). ``--blocks compiled|eager`` forces the per-block math through torch.compile (the CUDA
path) or eagerly (the CPU path) on any device; ``auto`` (default) is what training does.
``startup``: for GPT-2-shaped models of each size, the seconds to build the model
and draw its initial weights (megalite/models/init.py), and the seconds from launching
``pretrain.py`` (bf16 on CUDA, fp32 on CPU, ``--mock-data``) to its first logged iteration
(process wall time minus that iteration's own time; interpreter and import time included), with
CPU seconds beside the wall times (a loaded machine inflates wall time, much less CPU time).
``host-overhead``: forward + backward wall time of one eager layer at a tiny shape, where the time
is Python and op dispatch rather than arithmetic (the launch-bound regime of a small model on a
GPU): megalite's TransformerLayer against Hugging Face's ``GPT2Block`` / ``LlamaDecoderLayer``
built from the same shape (SDPA attention, fp32, dropout 0, training mode; HF's rotary tables
computed once outside the timed call), best of several blocks of repetitions, with the ATen ops
each dispatches. ``graph-breaks``: graphs and graph breaks of one compiled TransformerLayer in
training mode (``torch._dynamo.explain``), GPT-2 and Llama shaped, with and without selective
recompute and attention dropout; under torchrun the processes form the TP group (gloo). Runs against whatever ``megalite`` is on PYTHONPATH, so two checkouts compare.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

import torch

# appended, not prepended: a megalite on PYTHONPATH (another checkout) wins
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Ops that only make views or read metadata: no kernel is launched for them.
_NO_KERNEL = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::permute",
              "aten::transpose", "aten::t", "aten::split", "aten::split_with_sizes",
              "aten::chunk", "aten::unflatten", "aten::as_strided", "aten::expand",
              "aten::squeeze", "aten::unsqueeze", "aten::slice", "aten::select", "aten::detach",
              "aten::empty", "aten::empty_strided", "aten::alias", "aten::flatten",
              "aten::lift_fresh", "aten::result_type", "aten::_unsafe_view", "aten::unbind",
              "aten::narrow", "aten::expand_as", "aten::view_as", "aten::resolve_conj",
              "aten::resolve_neg", "aten::empty_like", "aten::is_nonzero", "aten::item",
              "aten::_local_scalar_dense", "aten::size", "aten::stride", "detach"}


def _count(prof, cuda: bool):
    if cuda:
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(evs), {}
    def computes(e):
        return e.name.startswith("aten::") and e.name not in _NO_KERNEL

    def has_computing_descendant(e):
        return any(computes(c) or has_computing_descendant(c) for c in e.cpu_children)

    per_op = {}
    for e in prof.events():
        if computes(e) and not has_computing_descendant(e):  # the op that does the work
            per_op[e.name] = per_op.get(e.name, 0) + 1
    return sum(per_op.values()), dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def kernels(args):
    from megalite.config import ExecutionConfig, ModelConfig
    from megalite.models.gpt import GPTModel
    from megalite.parallel_state import ParallelState

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    kw = dict(num_layers=1, hidden_size=256, num_attention_heads=8, num_query_groups=2,
              ffn_hidden_size=512, seq_length=128, vocab_size=4096, hidden_dropout=0.0,
              attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
              swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
              params_dtype=args.dtype)
    model = GPTModel(ModelConfig(**kw), ParallelState(device=dev), seed=1, device=dev,
                     execution=ExecutionConfig(torch_compile=args.compile or None))
    layer = model.layers["0"]
    x = torch.randn(128, 2, 256, device=dev, dtype=getattr(torch, args.dtype), requires_grad=True)
    labels = torch.randint(0, 4096, (128, 2), device=dev)
    from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    def run_layer():
        layer(x).float().sum().backward()

    def run_head():
        h = model.final_layernorm(x)
        logits = model.output_layer(h, model.output_layer.weight)
        vocab_parallel_cross_entropy(logits, labels, None, vocab_size=4096).sum().backward()

    out = {"device": str(dev), "dtype": args.dtype, "compile": args.compile}
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, fn in (("layer", run_layer), ("loss_head", run_head)):
        fn()  # warm-up (and compilation)
        with profile(activities=acts) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        out[name], out[name + "_ops"] = _count(prof, cuda)
    print(json.dumps(out))


def ce(args):
    import statistics
    import time

    from megalite.memory import host_rss_bytes, reset_host_peak_rss
    from megalite.parallel_state import synchronize
    from megalite.tensor_parallel import cross_entropy as ce_mod

    ce_mod.COMPILE_BLOCKS = {"auto": None, "compiled": True, "eager": False}[args.blocks]
    dev = torch.device(args.device)

    def reset_peak():
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return reset_host_peak_rss()

    def peak():
        return torch.cuda.max_memory_allocated() if dev.type == "cuda" else \
            host_rss_bytes("VmHWM")

    for vocab in map(int, args.vocabs.split(",")):
        for dtype in args.dtypes.split(","):
            g = torch.Generator(device=dev).manual_seed(0)
            logits = torch.empty(args.tokens, 1, vocab, dtype=getattr(torch, dtype), device=dev)
            logits.normal_(generator=g).mul_(4)
            labels = torch.randint(0, vocab, (args.tokens, 1), generator=g, device=dev)
            logits.requires_grad_(True)
            wall, cpu, growth = [], [], []
            for i in range(args.repeat + 1):
                logits.grad = None
                base = reset_peak()
                t0, c0 = time.perf_counter(), time.process_time()
                ce_mod.vocab_parallel_cross_entropy(logits, labels, None).sum().backward()
                synchronize(dev)
                if i:  # the first call warms up (and compiles)
                    wall.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                    growth.append(peak() - base)
            print(json.dumps({
                "tokens": args.tokens, "vocab": vocab, "dtype": dtype, "device": str(dev),
                "blocks": args.blocks,
                "logits_mib": round(logits.numel() * logits.element_size() / 2 ** 20, 1),
                "wall_ms": round(statistics.median(wall) * 1e3, 1),
                "cpu_ms": round(statistics.median(cpu) * 1e3, 1),
                "peak_growth_mib": round(max(growth) / 2 ** 20, 1),
                "load_average": os.getloadavg()[0]}), flush=True)
            del logits, labels


SIZES = {"25m": (4, 512, 8), "125m": (12, 768, 12), "350m": (24, 1024, 16),
         "760m": (24, 1536, 16), "1.3b": (24, 2048, 16)}  # layers, hidden, heads (V 50257)


def startup(args):
    import subprocess
    import tempfile
    import time

    from megalite.config import ModelConfig
    from megalite.models.gpt import GPTModel
    from megalite.parallel_state import ParallelState, synchronize

    dev = torch.device(args.device)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for size in args.sizes.split(","):
        L, h, n = SIZES[size]
        cfg = ModelConfig(num_layers=L, hidden_size=h, num_attention_heads=n, seq_length=1024,
                          vocab_size=50257, hidden_dropout=0.1, attention_dropout=0.1)
        t0, c0 = time.perf_counter(), time.process_time()
        model = GPTModel(cfg, ParallelState(device=dev), seed=1, device=dev)
        synchronize(dev)
        init_s, init_cpu = time.perf_counter() - t0, time.process_time() - c0
        params = sum(p.numel() for p in model.parameters())
        del model
        with tempfile.TemporaryDirectory() as tmp:
            metrics = os.path.join(tmp, "m.jsonl")
            argv = [sys.executable, os.path.join(root, "pretrain.py"), "--mock-data",
                    "--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads",
                    str(n), "--seq-length", "128", "--max-position-embeddings", "1024",
                    "--vocab-size", "50257", "--micro-batch-size", "1", "--global-batch-size",
                    "1", "--train-iters", "1", "--eval-iters", "0", "--log-interval", "1",
                    "--device", args.device, "--metrics-file", metrics] + (
                        ["--bf16"] if dev.type == "cuda" else [])
            t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True)
            wall, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
            child_cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-2000:])
            it = [json.loads(line) for line in open(metrics)
                  if json.loads(line).get("split") == "train"][0]["iteration_time_ms"] / 1000
        print(json.dumps({"size": size, "params": params, "device": str(dev),
                          "build_and_init_s": round(init_s, 2), "build_and_init_cpu_s":
                          round(init_cpu, 2), "launch_to_first_iteration_s": round(wall - it, 2),
                          "whole_run_cpu_s": round(child_cpu, 2),
                          "load_average": os.getloadavg()[0]}), flush=True)


def _best_us(fns: dict, reps: int, blocks: int) -> dict:
    """name -> (wall, CPU) microseconds per call, each the best block's mean. The systems take
    turns block by block, so load from other jobs hits them alike; the process's CPU time leaves
    out the time a loaded machine keeps it descheduled (on a quiet one the two agree)."""
    import time

    for fn in fns.values():
        for _ in range(max(10, reps)):
            fn()  # warm-up: caches, allocator
    best = {name: [float("inf"), float("inf")] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps):
                fn()
            wall, cpu = (time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps
            best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
    return {name: (round(w * 1e6, 1), round(c * 1e6, 1)) for name, (w, c) in best.items()}


def _ops_dispatched(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def host_overhead(args):
    from transformers import GPT2Config, LlamaConfig
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from megalite.config import ExecutionConfig, ModelConfig
    from megalite.models.transformer import TransformerLayer
    from megalite.overlap import WeightGradStore
    from megalite.tensor_parallel.layers import enable_weight_grad_deferral
    from megalite.tensor_parallel.random import model_parallel_seed

    model_parallel_seed(1, 0)  # as in a training run: the tracked RNG stream exists
    s, b, h, n = args.seq, args.batch, args.hidden, args.heads
    common = dict(num_layers=1, hidden_size=h, num_attention_heads=n, seq_length=s,
                  vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    families = {
        "gpt2": (ModelConfig(**common),
                 GPT2Block(GPT2Config(n_embd=h, n_head=n, n_inner=4 * h, n_positions=s,
                                      activation_function="gelu", resid_pdrop=0.0,
                                      attn_pdrop=0.0, embd_pdrop=0.0, layer_norm_epsilon=1e-5,
                                      attn_implementation="sdpa"), layer_idx=0)),
        "llama": (ModelConfig(**common, num_query_groups=n // 2, ffn_hidden_size=2 * h,
                              position_embedding_type="rope", normalization="RMSNorm",
                              swiglu=True, add_bias_linear=False, norm_epsilon=1e-6),
                  LlamaConfig(hidden_size=h, intermediate_size=2 * h, num_attention_heads=n,
                              num_key_value_heads=n // 2, rms_norm_eps=1e-6,
                              max_position_embeddings=s, attn_implementation="sdpa")),
    }
    for family, (cfg, hf) in families.items():
        ours = TransformerLayer(cfg, 0).train()
        x = torch.randn(s, b, h, requires_grad=True)
        xb = torch.randn(b, s, h, requires_grad=True)  # HF is batch-first
        if family == "llama":
            hf_cfg, hf = hf, LlamaDecoderLayer(hf, layer_idx=0)
            pos = torch.arange(s)[None].expand(b, s)
            rope = LlamaRotaryEmbedding(hf_cfg)(xb, pos)
            hf_call = lambda: hf(xb, position_embeddings=rope, position_ids=pos)  # noqa: E731
        else:
            hf_call = lambda: hf(xb)  # noqa: E731
        for mod in (ours, hf):
            for p in mod.parameters():
                torch.nn.init.normal_(p, std=0.02)
        hf.train()
        runs = {"megalite": lambda: ours(x).sum().backward(),
                "hf": lambda: (lambda o: (o[0] if isinstance(o, tuple) else o))(hf_call())
                .sum().backward()}
        if args.deferrable_linear:  # the linears on their autograd function, as zero-bubble runs them
            marked = TransformerLayer(cfg, 0).train()
            marked.load_state_dict(ours.state_dict())
            enable_weight_grad_deferral([marked], WeightGradStore())
            runs["megalite_deferrable_linear"] = lambda: marked(x).sum().backward()
        if args.compile:  # the same layer under --torch-compile (same weights)
            compiled = TransformerLayer(cfg, 0,
                                        execution=ExecutionConfig(torch_compile=args.compile))
            compiled.load_state_dict(ours.state_dict())
            runs["megalite_compiled"] = lambda: compiled.train()(x).sum().backward()
        out = {"family": family, "shape": [s, b, h], "heads": n, "threads":
               torch.get_num_threads(), "load_average": round(os.getloadavg()[0], 2)}
        for name, (wall, cpu) in _best_us(runs, args.reps, args.blocks).items():
            out[f"{name}_wall_us"], out[f"{name}_cpu_us"] = wall, cpu
            out[f"{name}_aten_ops"] = _ops_dispatched(runs[name])
        out["megalite_over_hf_cpu"] = round(out["megalite_cpu_us"] / out["hf_cpu_us"], 3)
        print(json.dumps(out), flush=True)


def graph_breaks(args):
    import torch._dynamo as dynamo
    import torch.distributed as dist

    from megalite.config import ExecutionConfig, ModelConfig
    from megalite.models.transformer import TransformerLayer
    from megalite.tensor_parallel.random import model_parallel_seed

    group, rank, tp = None, 0, 1
    if "WORLD_SIZE" in os.environ:  # torchrun: all processes are one TP group
        dist.init_process_group("gloo")
        group, rank, tp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    model_parallel_seed(1, rank)  # as in training: the tracked RNG stream exists
    s = 16
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=s, vocab_size=128,
                hidden_dropout=0.0, attention_dropout=0.0)
    llama = dict(num_query_groups=2, ffn_hidden_size=128, position_embedding_type="rope",
                 normalization="RMSNorm", swiglu=True, add_bias_linear=False)
    cases = [("gpt2", {}), ("llama", llama),
             ("llama, selective recompute", dict(llama, recompute="selective")),
             ("llama, attention dropout 0.1", dict(llama, attention_dropout=0.1))]
    for name, extra in cases:
        ex = ExecutionConfig(recompute_granularity=extra.pop("recompute", None))
        layer = TransformerLayer(ModelConfig(**{**base, **extra}), 0, tp_group=group,
                                 sequence_parallel=args.sequence_parallel, execution=ex).train()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(s // tp if args.sequence_parallel else s, 2, 64, requires_grad=True)
        dynamo.reset()
        ex = dynamo.explain(layer._layer_forward)(x)
        where = sorted({f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                        for b in ex.break_reasons for f in b.user_stack[-1:]})
        if rank == 0:
            print(json.dumps({"layer": name, "tp": tp, "sp": args.sequence_parallel,
                              "graphs": ex.graph_count, "breaks": ex.graph_break_count,
                              "break_sites": where,
                              "reasons": sorted({str(b.reason).split("\n")[0][:120]
                                                 for b in ex.break_reasons})}), flush=True)
    if group is not None:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    k.add_argument("--compile", default=None, choices=["inductor", "aot_eager"])
    c = sub.add_parser("ce")
    c.add_argument("--tokens", type=int, default=2048)
    c.add_argument("--vocabs", default="32768,50257")
    c.add_argument("--dtypes", default="bfloat16,float32")
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--blocks", default="auto", choices=["auto", "compiled", "eager"])
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    st = sub.add_parser("startup")
    st.add_argument("--sizes", default="25m,125m,350m", help=f"of {', '.join(SIZES)}")
    st.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ho = sub.add_parser("host-overhead")
    ho.add_argument("--seq", type=int, default=16)
    ho.add_argument("--batch", type=int, default=1)
    ho.add_argument("--hidden", type=int, default=64)
    ho.add_argument("--heads", type=int, default=4)
    ho.add_argument("--reps", type=int, default=20, help="calls per timed block")
    ho.add_argument("--blocks", type=int, default=50, help="timed blocks; the best is reported")
    ho.add_argument("--compile", default=None, choices=["inductor", "aot_eager", "eager"],
                    help="also time megalite's layer compiled with this backend")
    ho.add_argument("--deferrable-linear", action="store_true",
                    help="also time megalite with its linears marked for zero-bubble W deferral "
                         "(the autograd function instead of native F.linear)")
    gb = sub.add_parser("graph-breaks")
    gb.add_argument("--sequence-parallel", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    {"kernels": kernels, "ce": ce, "startup": startup, "host-overhead": host_overhead,
     "graph-breaks": graph_breaks}[args.cmd](args)


if __name__ == "__main__":
    main()
