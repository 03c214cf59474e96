"""Single-GPU training throughput: megalite against Hugging Face (eager and torch.compile).

One invocation runs every selected system on every selected row, each in a fresh process (so
peak memory and compile caches are per run), and prints one table plus a JSON document:

    python benchmarks/gpu_throughput.py                       # on a GPU: the rows of docs/performance.md
    python benchmarks/gpu_throughput.py --rows llama-1.5b --systems megalite,megalite-compile,hf
    python benchmarks/gpu_throughput.py --json out.json       # also write the JSON to a file

Without CUDA it runs the tiny rows (fp32, a few steps) so the script stays working on any machine;
those CPU figures are not comparable with the GPU rows.

Systems. ``megalite``: ``pretrain.py`` with ``--mock-data`` and the row's flags (``--bf16`` on a
GPU), throughput from its metrics records after ``--warmup`` iterations. ``megalite-compile``: the
same with ``--torch-compile``. ``hf`` / ``hf-compile``: ``GPT2LMHeadModel`` or
``LlamaForCausalLM`` built from the same ModelConfig (``attn_implementation="sdpa"``), fp32 weights
under bf16 autocast on a GPU, fused AdamW, gradient clipping at 1.0, the same micro/global batch
and tokens per step; ``hf-compile`` wraps the model in ``torch.compile``. Dropout is 0 everywhere.

Figures. tokens/s = global batch x sequence / median iteration time over the timed iterations.
TFLOP/s counts every system with megalite's model-FLOPs formula at the real vocab
(``megalite.logging.model_flops_per_sequence``), so the TFLOP/s ratio is the tokens/s ratio; MFU
is against the datasheet dense bf16 peak (``peak_flops_per_device``; on CPU a measured matmul
rate). Peak memory: ``torch.cuda.max_memory_allocated`` (CPU: peak RSS of the process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_GPT2 = ["--hidden-dropout", "0", "--attention-dropout", "0"]
_LLAMA = _GPT2 + ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                  "--group-query-attention"]


def _shape(L, h, heads, s, mbs, gbs, V, extra=()):
    return ["--num-layers", L, "--hidden-size", h, "--num-attention-heads", heads,
            "--seq-length", s, "--max-position-embeddings", s, "--micro-batch-size", mbs,
            "--global-batch-size", gbs, "--vocab-size", V,
            "--make-vocab-size-divisible-by", "128"] + list(extra)


ROWS = {  # name -> (description, megalite flags); the GPU rows are docs/performance.md's
    "gpt2-350m": ("GPT-2 350M: 24 layers, h 1024, 16 heads, s 1024, mbs 8, gbs 16, V 50257",
                  _shape(24, 1024, 16, 1024, 8, 16, 50257, _GPT2)),
    "gpt2-1.3b": ("GPT-2 1.3B: 24 layers, h 2048, 16 heads, s 2048, mbs 4, gbs 8, V 50257",
                  _shape(24, 2048, 16, 2048, 4, 8, 50257, _GPT2)),
    "gpt2-1.3b-mbs8": ("GPT-2 1.3B, mbs 8, gbs 16",
                       _shape(24, 2048, 16, 2048, 8, 16, 50257, _GPT2)),
    "llama-1.5b": ("Llama 1.5B: 16 layers, h 2048, ffn 8192, 32 heads / 8 KV groups, V 128256, "
                   "s 2048, mbs 4, gbs 8",
                   _shape(16, 2048, 32, 2048, 4, 8, 128256,
                          _LLAMA + ["--num-query-groups", "8", "--ffn-hidden-size", "8192"])),
    "tiny-gpt2": ("tiny GPT-2 (CPU): 2 layers, h 64, 4 heads, s 64, mbs 2, gbs 4, V 512",
                  _shape(2, 64, 4, 64, 2, 4, 512, _GPT2)),
    "tiny-llama": ("tiny Llama (CPU): 2 layers, h 64, ffn 128, 4 heads / 2 KV groups, s 64, "
                   "mbs 2, gbs 4, V 512",
                   _shape(2, 64, 4, 64, 2, 4, 512,
                          _LLAMA + ["--num-query-groups", "2", "--ffn-hidden-size", "128"])),
}
GPU_ROWS = ["gpt2-350m", "gpt2-1.3b", "gpt2-1.3b-mbs8", "llama-1.5b"]
CPU_ROWS = ["tiny-gpt2", "tiny-llama"]
SYSTEMS = ["megalite", "megalite-compile", "hf", "hf-compile"]


def _flags(row):
    return [str(f) for f in ROWS[row][1]]


def _model_config(row):
    from megalite.arguments import parse_args

    return parse_args(_flags(row) + ["--mock-data"]).model


def _flops_per_token(cfg):
    from megalite.logging import model_flops_per_sequence

    return model_flops_per_sequence(cfg, cfg.vocab_size) / cfg.seq_length


# ----------------------------------------------------------------------------------- megalite
def run_megalite(row, args, compile_layers, workdir, cuda):
    metrics = os.path.join(workdir, f"{row}-megalite{'-compile' if compile_layers else ''}.jsonl")
    argv = ([sys.executable, os.path.join(ROOT, "pretrain.py")] + _flags(row)
            + ["--mock-data", "--train-iters", str(args.warmup + args.iters), "--log-interval", "1",
               "--eval-interval", str(10 ** 9), "--eval-iters", "0", "--lr", "1e-4",
               "--lr-warmup-iters", "0", "--metrics-file", metrics]
            + (["--bf16", "--device", "cuda"] if cuda else ["--device", "cpu"])
            + (["--torch-compile"] if compile_layers else []))
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    recs = [r for r in map(json.loads, open(metrics)) if r.get("split") == "train"]
    timed = recs[args.warmup:] or recs
    return {"iteration_ms": statistics.median(r["iteration_time_ms"] for r in timed),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in recs)}


# ----------------------------------------------------------------------------- Hugging Face
def run_hf_worker(row, args, compile_model):
    """In this (fresh) process: train the HF model and return the timing record."""
    import torch

    from megalite.convert.hf import model_config_to_hf_config
    from megalite.parallel_state import peak_memory_bytes

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = _model_config(row)
    a = _flags(row)
    mbs = int(a[a.index("--micro-batch-size") + 1])
    gbs = int(a[a.index("--global-batch-size") + 1])
    hf_config = model_config_to_hf_config(cfg, attn_implementation="sdpa")
    import transformers

    cls = getattr(transformers, hf_config.architectures[0])
    torch.manual_seed(1234)
    with device:
        model = cls(hf_config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                            **({"fused": True} if cuda else {}))
    fwd = torch.compile(model) if compile_model else model
    g = torch.Generator().manual_seed(0)
    times = []
    for it in range(args.warmup + args.iters):
        batches = [torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length), generator=g)
                   for _ in range(gbs // mbs)]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids in batches:
            ids = ids.to(device, non_blocking=True)
            with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
                loss = fwd(input_ids=ids, labels=ids).loss / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    timed = times[args.warmup:] or times
    return {"iteration_ms": 1000 * statistics.median(timed),
            "peak_memory_bytes": peak_memory_bytes(device)}


def run_hf(row, args, compile_model, workdir):
    out = os.path.join(workdir, f"{row}-hf{'-compile' if compile_model else ''}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", row, "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--worker-result", out] + (
        ["--worker-compile"] if compile_model else [])
    proc = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.load(open(out))


# ---------------------------------------------------------------------------------- the table
def finish(row, res, cuda):
    """Derived figures for one row: tokens/s, TFLOP/s, MFU, GiB, ratios to each HF system."""
    import torch

    from megalite.logging import peak_flops_per_device

    cfg = _model_config(row)
    a = _flags(row)
    tokens = int(a[a.index("--global-batch-size") + 1]) * cfg.seq_length
    peak = peak_flops_per_device(torch.device("cuda" if cuda else "cpu"),
                                 "bfloat16" if cuda else "float32")
    for r in res.values():
        if "error" in r:
            continue
        r["tokens_per_sec"] = tokens / (r["iteration_ms"] / 1000)
        r["tflops"] = r["tokens_per_sec"] * _flops_per_token(cfg) / 1e12
        r["mfu"] = r["tflops"] * 1e12 / peak if peak and peak == peak else None
        r["peak_memory_gib"] = r["peak_memory_bytes"] / 2 ** 30
    for name, r in res.items():
        for base in ("hf", "hf-compile"):
            if base != name and "tokens_per_sec" in r and "tokens_per_sec" in res.get(base, {}):
                r[f"ratio_to_{base}"] = r["tokens_per_sec"] / res[base]["tokens_per_sec"]
    return res


def table(results):
    lines = ["| row | system | tokens/s | TFLOP/s | MFU | peak GiB | vs HF | vs HF+compile |",
             "|---|---|---|---|---|---|---|---|"]
    for row, res in results.items():
        for name, r in res.items():
            if "error" in r:
                lines.append(f"| {row} | {name} | error: {' '.join(r['error'])} | | | | | |")
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            ratio = lambda k: f"{r[k]:.2f}x" if k in r else ""  # noqa: E731
            lines.append(f"| {row} | {name} | {r['tokens_per_sec']:,.0f} | {r['tflops']:.3g} | "
                         f"{mfu} | {r['peak_memory_gib']:.2f} | {ratio('ratio_to_hf')} | "
                         f"{ratio('ratio_to_hf-compile')} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=None,
                   help=f"comma-separated, of {', '.join(ROWS)} (default: the GPU rows on a GPU, "
                        f"the tiny rows without one)")
    p.add_argument("--systems", default="megalite,megalite-compile,hf,hf-compile",
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (GPU 20, CPU 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (GPU 5, CPU 1)")
    p.add_argument("--json", default=None, help="also write the JSON document here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    args.rows = (args.rows or ",".join(GPU_ROWS if cuda else CPU_ROWS)).split(",")
    args.systems = args.systems.split(",")
    for kind, given, valid in (("--rows", args.rows, ROWS), ("--systems", args.systems, SYSTEMS)):
        bad = [x for x in given if x not in valid]
        if bad:
            p.error(f"{kind}: unknown {', '.join(bad)}; valid: {', '.join(valid)}")
    args.iters = args.iters if args.iters is not None else (20 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args, cuda


def main(argv=None):
    args, cuda = parse_args(argv)
    if args.worker:
        with open(args.worker_result, "w") as f:
            json.dump(run_hf_worker(args.worker, args, args.worker_compile), f)
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for row in args.rows:
            res = {}
            for system in args.systems:
                t0 = time.time()
                if system.startswith("megalite"):
                    res[system] = run_megalite(row, args, system.endswith("compile"), workdir, cuda)
                else:
                    res[system] = run_hf(row, args, system.endswith("compile"), workdir)
                res[system]["wall_s"] = round(time.time() - t0, 1)
                print(f"# {row} {system}: {res[system]}", file=sys.stderr, flush=True)
            results[row] = finish(row, res, cuda)
    import torch

    doc = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "iters": args.iters, "warmup": args.warmup,
           "rows": {row: {"shape": ROWS[row][0], "results": results[row]} for row in results}}
    print(table(results))
    print(json.dumps(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    errors = [f"{row}/{s}" for row, res in results.items() for s, r in res.items() if "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
