"""A sliding window and attention sinks under context parallelism: the ring (p2p) and all-gather
mask their blocks by the window (with packed documents too) and skip the blocks it leaves empty;
a sink joins each query once, at the final merge; every comm type equals the whole-sequence
formula (docs/context_parallel.md, "Sliding window", "Attention sinks")."""

from functools import partial

import numpy as np
import torch

from megalite.context_parallel import attention as A
from megalite.context_parallel.sharding import chunk_ids, shard
from megalite.masks import Documents, causal_attention, document_attention, sink_attention
from tests.dist_utils import run_distributed

B, N, G, S, D = 2, 4, 2, 32, 8
# sample 0: a document across the CP chunk borders; sample 1: many short ones
LENGTHS = [(5, 11, 16), (4, 4, 4, 4, 4, 4, 4, 4)]


def _documents():
    return Documents.of(np.stack([np.repeat(np.arange(len(ls)), ls) for ls in LENGTHS]))


def _reference(q, k, v, window=None, docs=None, sink=None):
    """softmax(q k^T / sqrt(d) masked, one more column: the head's sink logit) v, written out."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    pos = torch.arange(q.shape[2])
    gap = pos[:, None] - pos[None, :]
    sees = (gap >= 0) & (gap < (window or S))
    if docs is not None:
        sees = sees & (docs.ids[:, None, :, None] == docs.ids[:, None, None, :])
    scores = (q @ k.transpose(-1, -2) * D ** -0.5).masked_fill(~sees, float("-inf"))
    if sink is not None:
        column = sink[:, None, None].expand(*scores.shape[:-1], 1)
        return (torch.cat([scores, column], -1).softmax(-1)[..., :-1]) @ v
    return scores.softmax(-1) @ v


def _local(window, docs, sinks):
    """a2a's attention of one head shard over the whole sequence: the one-device one."""
    if sinks:
        return partial(sink_attention, window=window, docs=docs)
    if docs is not None:
        return partial(document_attention, docs=docs, window=window, enable_gqa=True)
    return partial(causal_attention, window=window, enable_gqa=True)


# (window, packed documents, sinks): windows shorter than a chunk (8) and across two chunks
CASES = [(5, False, False), (11, True, False), (None, False, True), (3, True, True)]


def _case(group, rank, size, comm, kernel, window, packed, sinks):
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(B, h, S, D, generator=gen) for h in (N, G, G, N))
    sink = torch.randn(N, generator=gen) if sinks else None
    docs = _documents() if packed else None
    ins = [t.requires_grad_() for t in (q, k, v)] + ([sink.requires_grad_()] if sinks else [])
    ref = _reference(q, k, v, window, docs, sink)
    ref_grads = torch.autograd.grad(ref, ins, dout)
    local = [shard(t.detach(), rank, size, 2).requires_grad_() for t in (q, k, v)]
    mine = local + ([sink.detach().clone().requires_grad_()] if sinks else [])
    attend = _local(window, docs, sinks) if comm == "a2a" else None
    out = A.context_parallel_attention(*local, group, comm, local_attention=attend,
                                       kernel=kernel, documents=docs, window=window,
                                       sink=mine[3] if sinks else None)
    grads = torch.autograd.grad(out, mine, shard(dout, rank, size, 2))
    errs = [(a.detach() - shard(b.detach(), rank, size, 2)).abs().max()
            for a, b in zip([out, *grads[:3]], [ref, *ref_grads[:3]])]
    # each rank's sink gradient is its queries' part: the ranks' sum is the whole one
    if sinks:
        torch.distributed.all_reduce(grads[3], group=group)
        errs.append((grads[3] - ref_grads[3]).abs().max())
    return float(torch.stack(errs).max())


def _all(rank, size):
    group = torch.distributed.new_group(list(range(size)))
    # the ring and all-gather's masked parts by CPU_FLASH's masked form (auto) and by MATH (what
    # CUDA runs them with); a2a by the one-device attention
    runs = [("p2p", "auto"), ("p2p", "math"), ("allgather", "auto"), ("allgather", "math"),
            ("a2a", "auto")]
    return {run + case: _case(group, rank, size, *run, *case) for run in runs for case in CASES}


def test_windows_and_sinks_under_every_comm_type_equal_the_formula():
    for rank, res in enumerate(run_distributed(_all, 2)):
        for case, err in res.items():
            assert err < 1e-5, (rank, case, err)


def test_the_ring_and_all_gather_compute_only_the_chunk_pairs_a_window_reaches():
    """C = 4, chunks of 4, a window of 3: chunk c sees only itself and chunk c - 1. The ring's
    parts (one per pair of chunks of a block, decided on the host) computed are exactly those
    15 pairs of the 40; each all-gather prefix is trimmed to the one chunk before its queries'."""
    size, chunk, masks = 4, S // 8, (3, None, torch.device("cpu"))
    computed, parts = set(), 0
    for rank in range(size):
        for step in range(size):
            src = (rank - step) % size
            for rows, keys, causal in A._pieces(rank, src, chunk, step, masks):
                how = A._ring_decision(masks, rank, src, size, S, rows, keys, causal)
                parts += 1
                if not isinstance(how, str):
                    computed.add((chunk_ids(rank, size)[rows.start // chunk],
                                  chunk_ids(src, size)[keys.start // chunk]))
    assert parts == 40
    assert computed == {(c, c) for c in range(8)} | {(c, c - 1) for c in range(1, 8)}
    prefixes = [(pre.start, pre.stop) for rank in range(size)
                for _, pre, _ in A._prefix_blocks(rank, size, chunk, masks)]
    assert all(stop - start == (chunk if stop else 0) for start, stop in prefixes), prefixes


# ------------------------------------------------------------------------------------------------
# pretrain.py: GPT-OSS's attention (windowed and full layers in turn, sinks) on packed documents
# under CP2, every comm type, equals one process (docs/design.md, contract 5)
# ------------------------------------------------------------------------------------------------
MODEL = ["--sliding-window", "5", "--window-attn-skip-freq", "2", "--attention-sinks"]


def test_windowed_layers_with_sinks_under_cp2_equal_one_process(tmp_path):
    from tests.pretrain_utils import assert_same_run, pretrain_cases, read_metrics, run_main
    from tests.test_documents import ITERS, LLAMA, _argv, _short_documents

    data = str(tmp_path / "docs")
    _short_documents(data)
    assert LLAMA[-2:] == ["--num-layers", "4"]
    model = LLAMA[:-2] + ["--num-layers", "2"] + MODEL  # one windowed layer, one full
    runs = {comm: _argv(data, model, ["--context-parallel-size", "2", "--cp-comm-type", comm],
                        tmp_path / f"{comm}.jsonl") for comm in ("p2p", "allgather", "a2a")}
    assert all(run_distributed(pretrain_cases, 2, list(runs.values()), timeout=600))
    assert run_main(_argv(data, model, [], tmp_path / "one.jsonl")) == 0
    ref = read_metrics(tmp_path / "one.jsonl")
    for comm in runs:
        got = read_metrics(tmp_path / f"{comm}.jsonl")
        assert_same_run(ref, got, ITERS, name=f"cp2 {comm}")
