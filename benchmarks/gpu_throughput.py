"""Single-GPU training throughput: megalite against Hugging Face (eager and torch.compile).

One invocation runs a plan of (row, system) runs, each in a fresh process (so each peak memory is
that run's own), and prints one table plus a JSON document:

    python benchmarks/gpu_throughput.py --json out.json       # on a GPU: the default plan, < 8 min
    python benchmarks/gpu_throughput.py --rows llama-1.5b --systems megalite,megalite-compile,hf
    python benchmarks/gpu_throughput.py --time-budget 1800 --json all.json \
        --rows gpt2-350m,gpt2-1.3b,gpt2-1.3b-mbs8,llama-1.5b,mixtral-1.9b  # every row x system

Without CUDA it runs the tiny rows (fp32, a few steps) so the script stays working on any machine;
those CPU figures are not comparable with the GPU rows.

Plan. Given --rows or --systems, every selected system runs on every selected row. Otherwise, on
a GPU, DEFAULT_GPU_PLAN: the comparisons the targets are read from, cheapest and most important
first (the eager runs of every row, then the compiled ones), so a slow compile costs the least
important figures. Time (docs/performance.md, "GPU throughput"): each run may take --run-timeout
seconds and the whole plan --time-budget; no run starts with less than MIN_RUN_S seconds left and
none runs past the budget, so the command ends within the budget whatever hangs. A run cut short
keeps the timed iterations it logged (status ``partial``), or is recorded as an error with the
tail of its output; a run the budget leaves no time for is recorded as skipped. With --json the
document is rewritten after every run (``"complete": false`` until the end), so an interrupted
benchmark (Ctrl-C, SIGTERM, a lost session) still leaves every finished run's figures.

Systems. ``megalite``: ``pretrain.py`` with ``--mock-data`` and the row's flags (``--bf16`` on a
GPU), throughput from its metrics records after ``--warmup`` iterations. ``megalite-compile``: the
same with ``--torch-compile``. ``hf`` / ``hf-compile``: ``GPT2LMHeadModel``, ``LlamaForCausalLM``
or ``MixtralForCausalLM`` (``experts_implementation="grouped_mm"``) built from the same
ModelConfig (``attn_implementation="sdpa"``), fp32 weights
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
import signal
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


def _mixtral(groups, experts, width, topk=2):
    """Llama's flags, every MLP ``experts`` SwiGLU experts ``width`` wide: dropless, one grouped
    GEMM, no balancing loss (HF's MixtralForCausalLM trains without router logits)."""
    return _LLAMA + ["--num-query-groups", groups, "--ffn-hidden-size", width, "--num-experts",
                     experts, "--moe-ffn-hidden-size", width, "--moe-router-topk", topk,
                     "--moe-router-load-balancing-type", "none"]


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
    "mixtral-1.9b": ("Mixtral-shaped 1.9B (0.7B active): 12 layers, h 2048, 16 heads / 8 KV "
                     "groups, 8 experts of width 2816, top-2, V 32000, s 2048, mbs 4, gbs 8",
                     _shape(12, 2048, 16, 2048, 4, 8, 32000, _mixtral(8, 8, 2816))),
    "tiny-gpt2": ("tiny GPT-2 (CPU): 2 layers, h 64, 4 heads, s 64, mbs 2, gbs 4, V 512",
                  _shape(2, 64, 4, 64, 2, 4, 512, _GPT2)),
    "tiny-llama": ("tiny Llama (CPU): 2 layers, h 64, ffn 128, 4 heads / 2 KV groups, s 64, "
                   "mbs 2, gbs 4, V 512",
                   _shape(2, 64, 4, 64, 2, 4, 512,
                          _LLAMA + ["--num-query-groups", "2", "--ffn-hidden-size", "128"])),
    "tiny-mixtral": ("tiny Mixtral (CPU): 2 layers, h 64, 4 heads / 2 KV groups, 4 experts of "
                     "width 96, top-2, s 64, mbs 2, gbs 4, V 512",
                     _shape(2, 64, 4, 64, 2, 4, 512, _mixtral(2, 4, 96))),
}
GPU_ROWS = ["gpt2-350m", "gpt2-1.3b", "gpt2-1.3b-mbs8", "llama-1.5b", "mixtral-1.9b"]
CPU_ROWS = ["tiny-gpt2", "tiny-llama", "tiny-mixtral"]
SYSTEMS = ["megalite", "megalite-compile", "hf", "hf-compile"]
DEFAULT_GPU_PLAN = [
    ("llama-1.5b", "megalite"), ("llama-1.5b", "hf"), ("gpt2-1.3b", "megalite"),
    ("gpt2-1.3b", "hf"), ("gpt2-350m", "megalite"), ("gpt2-350m", "hf"),
    ("mixtral-1.9b", "megalite"), ("mixtral-1.9b", "hf"),
    ("llama-1.5b", "megalite-compile"), ("llama-1.5b", "hf-compile"),
    ("gpt2-1.3b", "hf-compile"), ("gpt2-350m", "hf-compile"),
]
MIN_RUN_S = 10  # less than a process needs to start and build its model


def _flags(row):
    return [str(f) for f in ROWS[row][1]]


def _model_config(row):
    from megalite.arguments import parse_args

    return parse_args(_flags(row) + ["--mock-data"]).model


def _flops_per_token(cfg):
    from megalite.logging import model_flops_per_sequence

    return model_flops_per_sequence(cfg, cfg.vocab_size) / cfg.seq_length


# -------------------------------------------------------------------------------- one process
def _child_env():
    """This environment, with the checkout first on PYTHONPATH (the rest kept) and the hub offline:
    nothing in a run needs the network, and a machine without one would wait on a request."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.setdefault(k, "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"  # a killed run's log still ends where it stopped
    return env


def _run_process(argv, timeout, log_path, cwd):
    """Run ``argv`` in its own session, output to ``log_path``. Returns its exit code, or None when
    it ran past ``timeout`` seconds. At a timeout, or when this process is interrupted, the whole
    session is killed: compile workers included, so nothing is left holding the GPU or the CPUs."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=_child_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


def _train_records(path):
    """The per-iteration records a run has written so far (a line cut off by a kill is dropped)."""
    recs = []
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return recs
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("split") == "train":
            recs.append(r)
    return recs


def summarize(recs, warmup):
    """Median iteration time over the records after ``warmup`` (which hold compilation and
    allocation), peak memory over all; None when no timed iteration was recorded."""
    timed = recs[warmup:]
    if not timed:
        return None
    out = {"iteration_ms": statistics.median(r["iteration_time_ms"] for r in timed),
           "peak_memory_bytes": max(r["peak_memory_bytes"] for r in recs),
           "timed_iterations": len(timed)}
    host = [r["host_queue_ms_per_iteration"] for r in timed if "host_queue_ms_per_iteration" in r]
    if host:  # the host's time to queue forward-backward, no synchronize (docs/logging.md)
        out["host_queue_ms"] = statistics.median(host)
    return out


def run_one(row, system, args, workdir, cuda, timeout):
    """One (row, system) run in a fresh process; its result (see the module docstring)."""
    tag = f"{row}-{system}"
    records = os.path.join(workdir, f"{tag}.jsonl")
    if system.startswith("megalite"):
        argv = ([sys.executable, os.path.join(ROOT, "pretrain.py")] + _flags(row)
                + ["--mock-data", "--train-iters", str(args.warmup + args.iters),
                   "--log-interval", "1", "--eval-interval", str(10 ** 9), "--eval-iters", "0",
                   "--lr", "1e-4", "--lr-warmup-iters", "0", "--metrics-file", records]
                + (["--bf16", "--device", "cuda"] if cuda else ["--device", "cpu"])
                + (["--torch-compile"] if system.endswith("compile") else []))
    else:
        argv = [sys.executable, os.path.abspath(__file__), "--worker", row, "--iters",
                str(args.iters), "--warmup", str(args.warmup), "--worker-result", records] + (
            ["--worker-compile"] if system.endswith("compile") else [])
    t0 = time.time()
    log = os.path.join(workdir, f"{tag}.log")
    rc = _run_process(argv, timeout, log, workdir)
    recs = _train_records(records)
    res = summarize(recs, args.warmup) or {}
    res["wall_s"] = round(time.time() - t0, 1)
    lines = open(log, errors="replace").read().strip().splitlines()
    # megalite/compiled.py: a fast path this machine could not compile ran eagerly (slower)
    fell_back = [ln for ln in lines if ln.startswith("megalite: torch.compile of ")]
    if fell_back:
        res["compile_fallback"] = sorted(set(fell_back))
    if rc == 0 and res.get("timed_iterations") == args.iters:
        return res
    tail = lines[-40:]
    res["log_tail"] = tail
    if rc is None:
        res["timed_out"] = True
        n = args.warmup + args.iters
        what = f"timed out after {timeout:.0f} s ({len(recs)} of {n} iterations)"
    else:
        what = f"exit {rc}: {tail[-1] if tail else 'no output'}"
    res["error"] = what
    return res


# ----------------------------------------------------------------------------- Hugging Face
def run_hf_worker(row, args, compile_model, out_path):
    """In this (fresh) process: train the HF model, one JSON line per iteration to ``out_path``
    (the same fields as megalite's metrics records, so a run cut short keeps what it did)."""
    import torch

    from megalite.convert.hf import model_config_to_hf_config
    from megalite.parallel_state import peak_memory_bytes

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = _model_config(row)
    a = _flags(row)
    mbs = int(a[a.index("--micro-batch-size") + 1])
    gbs = int(a[a.index("--global-batch-size") + 1])
    # MoE rows: HF's grouped_mm experts, asked for by name so that a machine which cannot run
    # them fails the run instead of timing HF's per-expert loop
    moe = {"experts_implementation": "grouped_mm"} if cfg.num_experts else {}
    hf_config = model_config_to_hf_config(cfg, attn_implementation="sdpa", **moe)
    import transformers

    cls = getattr(transformers, hf_config.architectures[0])
    torch.manual_seed(1234)
    with device:
        model = cls(hf_config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                            **({"fused": True} if cuda else {}))
    fwd = torch.compile(model) if compile_model else model
    g = torch.Generator().manual_seed(0)
    with open(out_path, "a", buffering=1) as out:
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
            host_queue = time.perf_counter() - t0  # as megalite's, no synchronize
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            out.write(json.dumps({"split": "train", "iteration": it + 1,
                                  "iteration_time_ms": 1000 * (time.perf_counter() - t0),
                                  "host_queue_ms_per_iteration": 1000 * host_queue,
                                  "peak_memory_bytes": peak_memory_bytes(device)}) + "\n")


# ---------------------------------------------------------------------------------- the table
def finish(row, res, peak):
    """Derived figures for one row: tokens/s, TFLOP/s, MFU, GiB, ratios to each HF system."""
    cfg = _model_config(row)
    a = _flags(row)
    tokens = int(a[a.index("--global-batch-size") + 1]) * cfg.seq_length
    for r in res.values():
        if "iteration_ms" not in r:
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


def _status(r):
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if "error" not in r:
        return "ok" + ("; some fast paths ran eagerly (compile_fallback)"
                       if r.get("compile_fallback") else "")
    if "iteration_ms" in r:  # cut short, but with timed iterations: partial figures
        return f"partial ({r['timed_iterations']} timed it): {r['error']}"
    return f"error: {r['error']}"


def table(results):
    lines = ["| row | system | tokens/s | TFLOP/s | MFU | peak GiB | ms/it | host ms/it | vs HF "
             "| vs HF+compile | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, res in results.items():
        for name, r in res.items():
            if "tokens_per_sec" not in r:
                lines.append(f"| {row} | {name} | | | | | | | | | {_status(r)} |")
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            ratio = lambda k: f"{r[k]:.2f}x" if k in r else ""  # noqa: E731
            host = f"{r['host_queue_ms']:.1f}" if "host_queue_ms" in r else ""
            lines.append(f"| {row} | {name} | {r['tokens_per_sec']:,.0f} | {r['tflops']:.3g} | "
                         f"{mfu} | {r['peak_memory_gib']:.2f} | {r['iteration_ms']:.1f} | {host} | "
                         f"{ratio('ratio_to_hf')} | {ratio('ratio_to_hf-compile')} | "
                         f"{_status(r)} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=None,
                   help=f"comma-separated, of {', '.join(ROWS)} (default: on a GPU the plan "
                        f"of docs/performance.md, 'GPU throughput'; without one the tiny rows)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all); with --rows "
                        f"or --systems every selected system runs on every selected row")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (GPU 10, CPU 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed iterations first: compilation, and iteration 2, whose memory "
                        "is measured (GPU 3, CPU 2)")
    p.add_argument("--run-timeout", type=float, default=None,
                   help="seconds one run may take before it is killed (GPU 210, CPU 600; 0: none)")
    p.add_argument("--time-budget", type=float, default=None,
                   help=f"seconds for all runs: none starts with less than {MIN_RUN_S} s left and "
                        f"none runs past it (GPU 450, CPU 0 = no limit)")
    p.add_argument("--json", default=None, help="also write the JSON document here (rewritten "
                                                "after every run)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if args.rows is None and args.systems is None and cuda:
        args.plan = list(DEFAULT_GPU_PLAN)
    else:
        rows = (args.rows or ",".join(GPU_ROWS if cuda else CPU_ROWS)).split(",")
        systems = (args.systems or ",".join(SYSTEMS)).split(",")
        for kind, given, valid in (("--rows", rows, ROWS), ("--systems", systems, SYSTEMS)):
            bad = [x for x in given if x not in valid]
            if bad:
                p.error(f"{kind}: unknown {', '.join(bad)}; valid: {', '.join(valid)}")
        args.plan = [(r, s) for r in rows for s in systems]
    pick = lambda v, gpu, cpu: v if v is not None else (gpu if cuda else cpu)  # noqa: E731
    args.iters, args.warmup = pick(args.iters, 10, 2), pick(args.warmup, 3, 2)
    args.run_timeout = pick(args.run_timeout, 210.0, 600.0)
    args.time_budget = pick(args.time_budget, 450.0, 0.0)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.run_timeout < 0 or args.time_budget < 0:
        p.error("--run-timeout and --time-budget must be >= 0 seconds (0: no limit)")
    return args, cuda


def _write_json(path, doc):
    """Replace ``path`` whole (a reader never sees half a document)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the running child is killed, the table printed


def main(argv=None):
    args, cuda = parse_args(argv)
    if args.worker:
        run_hf_worker(args.worker, args, args.worker_compile, args.worker_result)
        return 0
    import torch

    from megalite.logging import peak_flops_per_device

    t_start = time.time()
    peak = peak_flops_per_device(torch.device("cuda" if cuda else "cpu"),
                                 "bfloat16" if cuda else "float32")
    doc = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "iters": args.iters, "warmup": args.warmup, "run_timeout_s": args.run_timeout,
           "time_budget_s": args.time_budget, "plan": [f"{r}/{s}" for r, s in args.plan],
           "complete": False, "elapsed_s": 0.0, "rows": {}}
    if args.json:  # an unwritable path fails now, not after the runs
        try:
            _write_json(args.json, doc)
        except OSError as e:
            print(f"gpu_throughput.py: error: --json {args.json}: cannot write it ({e})",
                  file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, _interrupt)
    results = {}
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for row, system in args.plan:
                left = args.time_budget - (time.time() - t_start) if args.time_budget else None
                if left is not None and left < MIN_RUN_S:
                    r = {"skipped": f"--time-budget {args.time_budget:.0f} s spent"}
                else:
                    limits = [t for t in (args.run_timeout or None, left) if t is not None]
                    r = run_one(row, system, args, workdir, cuda, min(limits) if limits else None)
                res = results.setdefault(row, {})
                res[system] = r
                results[row] = finish(row, {s: res[s] for s in SYSTEMS if s in res}, peak)
                print(f"# {row} {system}: {_status(r)}, {r.get('wall_s', 0)} s"
                      + (f", {r['tokens_per_sec']:,.0f} tokens/s" if "tokens_per_sec" in r else ""),
                      file=sys.stderr, flush=True)
                doc["rows"] = {rw: {"shape": ROWS[rw][0], "results": results[rw]} for rw in results}
                doc["elapsed_s"] = round(time.time() - t_start, 1)
                if args.json:
                    _write_json(args.json, doc)
    except KeyboardInterrupt:
        print(table(results))
        print(f"interrupted after {time.time() - t_start:.0f} s; finished runs are in the JSON "
              f"(\"complete\": false)", file=sys.stderr)
        return 130
    doc["complete"] = True
    if args.json:
        _write_json(args.json, doc)
    print(table(results))
    print(json.dumps(doc))
    return 1 if any("error" in r or "skipped" in r for res in results.values()
                    for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
