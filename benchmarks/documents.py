"""Packed documents on the CPU: what attending only within each document costs, one device and
under ring context parallelism (docs/data.md and docs/context_parallel.md, "Packed documents").

    OMP_NUM_THREADS=1 python benchmarks/documents.py                  # all three parts
    OMP_NUM_THREADS=1 python benchmarks/documents.py --quick          # smaller, fewer rounds
    OMP_NUM_THREADS=1 python benchmarks/documents.py --parts kernels --seq 4096

Documents: a sample of s tokens cut at k - 1 distinct random places (mean length s/k), an EOD
token at the end of each document, the same cuts for every sample and rank (seeded).

``model``: a training step, forward + backward of a llama-like GPTModel (RMSNorm, SwiGLU, RoPE,
grouped queries; --hidden, --layers, --heads, --seq, --batch) from the micro-batch's tokens,
get_batch included: with --reset-attention-mask and --reset-position-ids at mean length
s / --model-k, against the same step with plain causal attention. The two alternate round by
round; medians of CPU time (time.thread_time) with one thread: the machine's other load does
not count.

``kernels``: forward + backward of one layer's attention alone ([b, heads, s, d], fp32) at mean
lengths s/k for each --kernel-k: SDPA per document and one SDPA per sample under its [s, s] mask
(the two ways of ``megalite.masks._per_document``; ``_MANY_DOCUMENTS`` sets where one takes
over from the other), each against causal SDPA on the whole sample.

``cp``: context_parallel_attention on --cp gloo processes (one thread each) with documents at
mean length s / --model-k, against the same call without them, per --comm: the blocks each rank
skips (Documents._blocks, filled while the step runs: "skip", None = the kernel's own mask, or a
mask) and the step's CPU time per rank (time.thread_time: this rank's compute, not the time it
waited for a peer; with more processes than cores wall time mostly measures the sharing), with
the masked blocks run by the block kernel's masked form (CPU_FLASH's, context_parallel/blocks.py)
and by MATH. A fresh Documents every step, so each step pays for its block decisions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

EOD = 0


def cuts(s: int, k: int, seed: int = 0):
    """The document ids [s] of a sample of s tokens cut into k documents at random places."""
    import numpy as np

    rng = np.random.default_rng(seed)
    starts = np.zeros(s, dtype=np.int64)
    starts[rng.choice(np.arange(1, s), size=k - 1, replace=False)] = 1
    return np.cumsum(starts)


def _tokens(b: int, s: int, k: int, vocab: int):
    """[b, s + 1] tokens whose inputs hold k documents, each ending with EOD."""
    import numpy as np

    ids = cuts(s, k)
    data = np.random.default_rng(1).integers(1, vocab, size=(b, s + 1))
    data[:, :s][:, np.append(ids[1:] != ids[:-1], False)] = EOD  # the token before each start
    return data


def _rounds(steps: dict, rounds: int) -> dict:
    """name -> median CPU seconds of ``steps[name]()`` (time.thread_time: one thread computes,
    so another process's load does not count), the steps alternating round by round after one
    warm-up round."""
    times = {name: [] for name in steps}
    for r in range(rounds + 1):
        for name, step in steps.items():
            t = time.thread_time()
            step()
            if r:
                times[name].append(time.thread_time() - t)
    return {name: statistics.median(t) for name, t in times.items()}


# ---- model ----

def _model_step(model, data, documents: bool):
    from megalite.data.batch import get_batch

    def step():
        batch = get_batch(data, EOD, False, documents, documents)
        loss = model(batch.tokens, labels=batch.labels, position_ids=batch.position_ids,
                     documents=batch.documents)
        loss.mean().backward()
        for p in model.parameters():
            p.grad = None
    return step


def model_part(a):
    import torch

    from megalite.config import ModelConfig
    from megalite.models.gpt import GPTModel

    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                      num_query_groups=a.heads // 2, ffn_hidden_size=a.hidden * 11 // 4,
                      seq_length=a.seq, vocab_size=1024, make_vocab_size_divisible_by=128,
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      add_bias_linear=False, untie_embeddings_and_output_weights=True,
                      hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg.validate(), seed=0)
    data = torch.from_numpy(_tokens(a.batch, a.seq, a.model_k, 1024))
    t = _rounds({"causal": _model_step(model, data, False),
                 "documents": _model_step(model, data, True)}, a.rounds)
    print(f"\nmodel step (forward + backward): {a.layers} layers, hidden {a.hidden}, {a.heads} "
          f"heads ({a.heads // 2} K/V groups), s {a.seq}, b {a.batch}, fp32, "
          f"{torch.get_num_threads()} thread(s), median of {a.rounds}")
    print("| mean doc length | causal ms | documents ms | documents / causal |\n|---|---|---|---|")
    print(f"| s/{a.model_k} | {t['causal'] * 1e3:.0f} | {t['documents'] * 1e3:.0f} | "
          f"{t['documents'] / t['causal']:.3f} |")


# ---- kernels ----

def _attention_step(q, k, v, attend):
    def step():
        attend(q, k, v).sum().backward()
        q.grad = k.grad = v.grad = None
    return step


def kernels_part(a):
    import torch
    import torch.nn.functional as F

    import megalite.masks as M

    d = a.hidden // a.heads
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.batch, a.heads, a.seq, d, generator=gen).requires_grad_()
               for _ in range(3))
    causal = _attention_step(q, k, v, lambda *t: F.scaled_dot_product_attention(
        *t, is_causal=True))
    print(f"\nattention alone (forward + backward): b {a.batch}, {a.heads} heads, d {d}, "
          f"s {a.seq}, fp32, median of {a.rounds}; ratios against causal SDPA")
    print("| mean doc length | documents | causal ms | per document | one mask | faster |\n"
          "|---|---|---|---|---|---|")
    for kk in a.kernel_k:
        docs = M.Documents.of(cuts(a.seq, kk)[None].repeat(a.batch, 0))
        ways = {"causal": causal}
        for name, many in (("per document", 10**9), ("one mask", 0)):
            def attend(*t, many=many):
                M._MANY_DOCUMENTS, old = many, M._MANY_DOCUMENTS
                try:
                    return M._per_document(*t, docs)
                finally:
                    M._MANY_DOCUMENTS = old
            ways[name] = _attention_step(q, k, v, attend)
        t = _rounds(ways, a.rounds)
        best = min(("per document", "one mask"), key=t.get)
        print(f"| s/{kk} | {kk} | {t['causal'] * 1e3:.1f} | "
              f"{t['per document'] / t['causal']:.3f} | {t['one mask'] / t['causal']:.3f} | "
              f"{best} |", flush=True)


# ---- context parallelism ----

def _cp_worker(rank, size, a):
    import torch

    from context_parallel import measure
    from megalite.context_parallel import blocks
    from megalite.context_parallel.attention import context_parallel_attention
    from megalite.context_parallel.sharding import shard
    from megalite.masks import Documents

    torch.set_num_threads(1)
    group = torch.distributed.new_group(list(range(size)))
    gen = torch.Generator().manual_seed(0)
    d = a.hidden // a.heads
    full = [torch.randn(a.batch, a.heads, a.seq, d, generator=gen) for _ in range(3)]
    q, k, v = (shard(t, rank, size, 2).requires_grad_() for t in full)
    ids = cuts(a.seq, a.model_k)[None].repeat(a.batch, 0)
    rows, last = [], {}

    def step(comm, documents):
        def run():
            docs = Documents.of(ids) if documents else None
            context_parallel_attention(q, k, v, group, comm, documents=docs).sum().backward()
            q.grad = k.grad = v.grad = None
            last["docs"] = docs
        return run

    kernel = blocks.masked
    for comm in a.comm:
        for case in ("causal", "documents", "documents, masked by MATH"):
            blocks.masked = (lambda _: blocks.MATH) if "MATH" in case else kernel
            r = measure(step(comm, case != "causal"), a.rounds, group, warmup=1)
            rows.append(dict(comm=comm, case=case, rank=rank, cpu_s=r["cpu_s"],
                             wall_s=r["wall_s"]))
            if last["docs"] is not None:  # the block decisions of its last step
                # (q first, q last, queries, k first, k last, keys, causal, window) -> how
                done = last["docs"]._blocks
                rows[-1].update(blocks=len(done),
                                skipped=sum(isinstance(x, str) for x in done.values()),
                                masked=sum(isinstance(x, torch.Tensor) for x in done.values()),
                                area=sum(key[2] * key[5] / (2 if key[6] else 1)
                                         for key, x in done.items() if not isinstance(x, str)))
        blocks.masked = kernel
    return rows


def cp_part(a):
    from dist_utils import run_distributed

    rows = [r for per in run_distributed(_cp_worker, a.cp, a, timeout=3600) for r in per]
    print(f"\nCP {a.cp} (gloo, one thread per process): attention forward + backward, "
          f"b {a.batch}, {a.heads} heads, d {a.hidden // a.heads}, s {a.seq}, fp32, documents "
          f"at mean length s/{a.model_k}; median of {a.rounds}; blocks computed, their area "
          f"(query-key pairs, a causal diagonal half) against causal's s^2/2; CPU ms per rank: "
          f"min..max; ratio: sum over ranks against causal")
    print("| comm | case | blocks (all ranks) | skipped | masked | area | CPU ms per rank "
          "| ratio | slowest wall ms |\n|---|---|---|---|---|---|---|---|---|")
    for comm in a.comm:
        mine = [r for r in rows if r["comm"] == comm]
        base = sum(r["cpu_s"] for r in mine if r["case"] == "causal")
        for case in dict.fromkeys(r["case"] for r in mine):
            rs = [r for r in mine if r["case"] == case]
            count = " | ".join(str(sum(r[x] for r in rs)) if x in rs[0] else "-"
                               for x in ("blocks", "skipped", "masked"))
            count += f" | {sum(r['area'] for r in rs) / (a.seq ** 2 / 2):.3f}" if (
                "area" in rs[0]) else " | 1.000"
            cpu = [r["cpu_s"] * 1e3 for r in rs]
            print(f"| {comm} | {case} | {count} | {min(cpu):.0f}..{max(cpu):.0f} | "
                  f"{sum(r['cpu_s'] for r in rs) / base:.3f} | "
                  f"{max(r['wall_s'] for r in rs) * 1e3:.0f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["model", "kernels", "cp"],
                   choices=["model", "kernels", "cp"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--model-k", type=int, default=8, help="model and cp: mean length s/k")
    p.add_argument("--kernel-k", type=int, nargs="+", default=[8, 32, 128, 512])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--comm", nargs="+", default=["p2p", "allgather"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="s 512, 2 rounds, kernels at k 8 and 64")
    a = p.parse_args(argv)
    if a.quick:
        a.seq, a.rounds, a.kernel_k = 512, 2, [8, 64]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(f"torch {torch.__version__}")
    for part in a.parts:
        {"model": model_part, "kernels": kernels_part, "cp": cp_part}[part](a)


if __name__ == "__main__":
    main()
