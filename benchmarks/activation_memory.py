"""Bytes one transformer layer saves for backward, measured, beside Korthikanti et al.'s table.

    python benchmarks/activation_memory.py [--seq-length 256 --hidden-size 512 --heads 8
                                            --micro-batch-size 2 --tp 2 --dtype float32 bfloat16]

Every tensor autograd saves during the forward of one ``TransformerLayer`` passes through a
``torch.autograd.graph.saved_tensors_hooks`` pack hook; each storage is counted once (views share
a storage) and parameters are left out (they are model state, not activations). Cases: no
parallelism, TP, TP+SP, selective and full recompute (TP and SP run on ``--tp`` gloo processes on
this machine; rank 0's count is printed). The planner's per-layer formula
(megalite/planner.py ``layer_activation_bytes``) is printed beside each measurement, as is
Korthikanti et al.'s 16-bit table, sbh(34 + 5as/h) and its TP/SP/recompute variants.
docs/planner.md explains every difference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [("none", 1, False, None), ("TP", None, False, None), ("TP+SP", None, True, None),
         ("TP+SP+selective", None, True, "selective"), ("TP+SP+full", None, True, "full"),
         ("selective", 1, False, "selective"), ("full", 1, False, "full")]


def saved_bytes(layer, x, full_recompute: bool) -> int:
    from megalite.tensor_parallel.random import checkpoint

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    # Storages are held here, not only their addresses: a part of the graph freed during the
    # forward would free its saved tensors, and a later one allocated at the same address would
    # replace its entry (an undercount that depended on the allocator's reuse).
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes() > 0:
            seen[s.data_ptr()] = s
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = checkpoint(layer, x.device, x) if full_recompute else layer(x)
    y.float().sum().backward()  # the saved tensors must serve a real backward
    return sum(s.nbytes() for s in seen.values())


def measure(rank, world, port, a, results):
    from megalite.config import ExecutionConfig, ModelConfig
    from megalite.models.transformer import TransformerLayer
    from megalite.parallel_state import initialize_model_parallel

    torch.set_num_threads(1)
    ps = initialize_model_parallel(world, 1, backend="gloo", device="cpu", rank=rank,
                                   world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                   set_default=True)
    out = {}
    for dtype in a.dtype:
        for name, t, sp, rc in CASES:
            if (t or world) != world or (world == 1) != (t == 1):
                continue
            cfg = ModelConfig(num_layers=1, hidden_size=a.hidden_size,
                              num_attention_heads=a.heads, seq_length=a.seq_length,
                              hidden_dropout=a.dropout, attention_dropout=a.attention_dropout,
                              params_dtype=dtype)
            layer = TransformerLayer(cfg, 0, ps.tp_group, sequence_parallel=sp,
                                     execution=ExecutionConfig(recompute_granularity=rc))
            with torch.no_grad():
                for p in layer.parameters():
                    p.normal_(0, 0.02)
            layer.train()
            s = a.seq_length // world if sp else a.seq_length
            x = torch.randn(s, a.micro_batch_size, a.hidden_size,
                            dtype=getattr(torch, dtype), requires_grad=True)
            out[(dtype, name)] = saved_bytes(layer, x, rc == "full")
    if rank == 0:
        results.put(out)


def _spawn(world, a, results):
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=measure, args=(r, world, port, a, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results.update(queue.get(timeout=600))
    for p in procs:
        p.join()


def main(argv=None):
    from megalite.config import ModelConfig
    from megalite.planner import Model, layer_activation_bytes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1, help="hidden dropout")
    p.add_argument("--attention-dropout", type=float, default=0.0)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    a = p.parse_args(argv)
    results = {}
    _spawn(1, a, results)
    _spawn(a.tp, a, results)
    s, b, h, n = a.seq_length, a.micro_batch_size, a.hidden_size, a.heads
    sbh = s * b * h
    print(f"s={s} b={b} h={h} a={n} t={a.tp} hidden dropout {a.dropout} attention dropout "
          f"{a.attention_dropout}; bytes per layer (sbh = {sbh})")
    print("| dtype | case | measured | planner | measured/planner | Korthikanti 16-bit "
          "| measured / sbh |")
    print("|---|---|---|---|---|---|---|")
    for dtype in a.dtype:
        m = Model.from_config(ModelConfig(
            num_layers=1, hidden_size=h, num_attention_heads=n, seq_length=s,
            hidden_dropout=a.dropout, attention_dropout=a.attention_dropout, params_dtype=dtype),
            device="cpu")
        for name, t, sp, rc in CASES:
            key = (dtype, name)
            if key not in results:
                continue
            t = t or a.tp
            est = layer_activation_bytes(m, b, t, sp, rc or "none")
            kor = korthikanti(s, b, h, n, t, sp, rc)
            print(f"| {dtype} | {name} | {results[key]:,} | {est:,.0f} | "
                  f"{results[key] / est:.3f} | {kor:,.0f} | {results[key] / sbh:.2f} |")


def korthikanti(s, b, h, a, t, sp, rc) -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte dropout masks)."""
    sbh = s * b * h
    att = 5 * a * s / h
    if rc == "full":
        return 2 * sbh / (t if sp else 1)
    if rc == "selective":
        att = 0.0
    if t == 1:
        return sbh * (34 + att)
    if sp:
        return sbh / t * (34 + att)
    return sbh * (10 + 24 / t + att / t)


if __name__ == "__main__":
    main()
