"""Causal attention of a CP rank's queries against the whole sequence: the ring (``p2p``),
``allgather`` and Ulysses (``a2a``) paths, each its own forward and backward, and which block of
which rank is causal: docs/context_parallel.md, "One interface, three implementations"; under
packed documents, a sliding window and attention sinks: its sections of those names."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megalite import collectives as C
from megalite.context_parallel import blocks
from megalite.context_parallel.sharding import chunk_ids, chunk_owner, positions, shard
from megalite.masks import Documents, apply_attention_sink, attention_sink_grad, block


# ---- merging blocks (each block's kernel: blocks.py) ----

def _merge(out, lse, blk_out, blk_lse):
    """Fold a block's (out, lse) into the fp32 running (out, lse), in place (views allowed)."""
    new = torch.logaddexp(lse, blk_lse)
    out.mul_((lse - new).exp().unsqueeze(-1))
    out.add_(blk_out.float() * (blk_lse - new).exp().unsqueeze(-1))
    lse.copy_(new)


# ---- communication helpers (all through megalite.collectives) ----

def _ring(t, group, tag: int):
    """Send ``t`` to the next CP rank, receive its like from the previous."""
    rank, size = C.group_rank(group), C.group_size(group)
    peer = lambda r: dist.get_global_rank(group, r % size)  # noqa: E731
    recv = torch.empty_like(t)
    C.count_p2p(t.numel() * t.element_size(), "cp_p2p")
    ops = [dist.P2POp(dist.isend, t, peer(rank + 1), group, tag),
           dist.P2POp(dist.irecv, recv, peer(rank - 1), group, tag)]
    return C.batch_isend_irecv(ops, tag="cp_p2p"), recv


def _wait(reqs):
    for r in reqs:
        r.wait()


def _all_to_all(pieces, group):
    """pieces[j] (1-D) goes to CP rank j; returns the pieces each rank sent here (pairwise
    batched sends, as NCCL's all-to-all is)."""
    rank = C.group_rank(group)
    got, ops = [torch.empty_like(p) for p in pieces], []
    got[rank] = pieces[rank]
    for j, p in enumerate(pieces):
        if j != rank:
            C.count_p2p(p.numel() * p.element_size(), "cp_a2a")
            ops.append(dist.P2POp(dist.isend, p, dist.get_global_rank(group, j), group, 2))
            ops.append(dist.P2POp(dist.irecv, got[j], dist.get_global_rank(group, j), group, 2))
    _wait(C.batch_isend_irecv(ops, tag="cp_a2a"))
    return got


def _natural(shards, dim):
    """The whole sequence in natural order from every CP rank's local shard (list, rank order)."""
    size, chunks = len(shards), [None] * (2 * len(shards))
    for j, t in enumerate(shards):
        first, second = t.chunk(2, dim)
        chunks[chunk_ids(j, size)[0]], chunks[chunk_ids(j, size)[1]] = first, second
    return torch.cat(chunks, dim)


# ---- p2p (ring) ----

def _ring_block(rank, src, half):
    """(query rows, key rows) of this rank's block against CP rank ``src``'s K/V (the table in
    docs/context_parallel.md, "The load-balanced chunk assignment")."""
    return (slice(half, None) if src > rank else slice(None),
            slice(None, half) if src < rank else slice(None))


def _decide(masks, q_pos, k_pos, causal: bool):
    """The block's run under ``masks``, (window, documents, device) (masks.block: "skip", None or
    a mask), or None (the kernel's own mask) without a window or documents."""
    window, documents, device = masks
    if window is None and documents is None:
        return None
    return block(q_pos, k_pos, causal, window, documents, device)


def _ring_decision(masks, rank, src, size, s, rows, keys, causal: bool):
    """_decide for the ring's block of this rank's ``rows`` against ``src``'s ``keys``. The ring
    still passes skipped K/V on: the next rank needs them."""
    return _decide(masks, positions(s, rank, size)[rows], positions(s, src, size)[keys], causal)


def _pieces(rank, src, half, step, masks):
    """(query rows, key rows, causal) of the parts of this step's block (_ring_block): the block
    itself, or under a window or documents one part per pair of chunks, each decided alone (at
    step 0 a window may leave the later chunk's queries nothing in the earlier chunk). Keys
    last first: a chunk's own diagonal comes before anything merges into its rows."""
    rows, keys = _ring_block(rank, src, half)
    if masks[0] is None and masks[1] is None:
        return [(rows, keys, step == 0)]

    def chunks(sl):
        return [slice(c, c + half) for c in range(sl.start or 0, sl.stop or 2 * half, half)]

    return [(r, k, step == 0 and r == k) for r in chunks(rows) for k in reversed(chunks(keys))]


def _block_fwd(kernel, q, k, v, causal, scale, how):
    """``kernel``'s block forward, or its masked form's under ``how``, a window or documents
    mask."""
    if how is None:
        return kernel.fwd(q, k, v, causal, scale)
    return blocks.masked(kernel).fwd(q, k, v, how, scale)


def _block_bwd(kernel, dout, q, k, v, out, lse, causal, scale, how):
    if how is None:
        return kernel.bwd(dout, q, k, v, out, lse, causal, scale)
    return blocks.masked(kernel).bwd(dout, q, k, v, out, lse, how, scale)


def _ring_fwd(q, k, v, group, scale, kernel, masks):
    rank, size, half = C.group_rank(group), C.group_size(group), q.shape[2] // 2
    kv = torch.stack([k, v])
    out = torch.zeros_like(q, dtype=torch.float32)
    lse = out.new_full(q.shape[:3], float("-inf"))
    for step in range(size):
        reqs, nxt = _ring(kv, group, 0) if step < size - 1 else ([], None)
        src = (rank - step) % size
        for rows, keys, causal in _pieces(rank, src, half, step, masks):
            how = _ring_decision(masks, rank, src, size, size * q.shape[2], rows, keys, causal)
            if how == "skip":  # no query here sees a key there: nothing to compute
                continue
            o, l = _block_fwd(kernel, q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                              causal, scale, how)
            if causal:  # own K/V's diagonal: the first part of its rows
                out[:, :, rows], lse[:, :, rows] = o.float(), l
            else:
                _merge(out[:, :, rows], lse[:, :, rows], o, l)
        _wait(reqs)
        kv = nxt
    return out, lse


def _ring_bwd(dout, q, k, v, out, lse, group, scale, kernel, masks):
    """K/V go round again with an fp32 dK/dV each rank adds to; after C steps it is home."""
    rank, size, half = C.group_rank(group), C.group_size(group), q.shape[2] // 2
    kv, dq = torch.stack([k, v]), torch.zeros_like(q, dtype=torch.float32)
    dkv, dkv_in, dreqs = None, None, []
    for step in range(size):
        reqs, nxt = _ring(kv, group, 0) if step < size - 1 else ([], None)
        src, dkeys = (rank - step) % size, []
        for rows, keys, causal in _pieces(rank, src, half, step, masks):
            how = _ring_decision(masks, rank, src, size, size * q.shape[2], rows, keys, causal)
            if how == "skip":
                continue
            g = _block_bwd(kernel, dout[:, :, rows], q[:, :, rows], kv[0][:, :, keys],
                           kv[1][:, :, keys], out[:, :, rows], lse[:, :, rows], causal, scale,
                           how)
            dq[:, :, rows] += g[0]
            dkeys.append((keys, g[1], g[2]))
        _wait(dreqs)  # these K/V's dK/dV so far, from the ranks that held them before
        dkv = torch.zeros_like(kv, dtype=torch.float32) if dkv_in is None else dkv_in
        for keys, dk, dv in dkeys:
            dkv[0][:, :, keys] += dk
            dkv[1][:, :, keys] += dv
        dreqs, dkv_in = _ring(dkv, group, 1)
        _wait(reqs)
        kv = nxt
    _wait(dreqs)
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


# ---- allgather ----

def _gather_kv(k, v, group):
    """K/V of the whole sequence in natural order, [2, b, g, s, d]."""
    kv = torch.stack([k, v])
    full = kv.new_empty((C.group_size(group) * 2,) + kv.shape[1:])  # ranks along dim 0
    C.all_gather_into_tensor(full, kv, group, tag="cp_allgather")
    return _natural(list(full.view((-1,) + kv.shape).unbind(0)), dim=3)


def _prefix_blocks(rank, size, chunk, masks):
    """(local query rows, key range of the non-causal prefix, key range of the causal diagonal)
    for each of this rank's two chunks: chunk c sees keys [0, c*chunk) whole, its own causally.
    The prefix starts at the chunk holding the first key any query of c sees: under a window of W
    that is c*chunk - W + 1; under ``documents``, the start of the first document reaching into c
    (in any sample)."""
    window, documents, _ = masks
    for i, c in enumerate(chunk_ids(rank, size)):
        first = 0 if window is None else max(0, c * chunk - window + 1)
        if documents is not None:  # ids rise along a sample: a document starts at its first id
            ids = documents.host_ids.numpy()
            first = max(first, min(int(np.searchsorted(row, row[c * chunk])) for row in ids))
        first //= chunk
        yield slice(i * chunk, (i + 1) * chunk), slice(first * chunk, c * chunk), slice(
            c * chunk, (c + 1) * chunk)


def _gathered_block(masks, diag: slice, keys: slice, causal: bool):
    """_decide for a chunk's queries (global ``diag``) against gathered ``keys``."""
    return _decide(masks, torch.arange(diag.start, diag.stop), torch.arange(keys.start, keys.stop),
                   causal)


def _allgather_fwd(q, k, v, group, scale, kernel, masks):
    kv = _gather_kv(k, v, group)
    out = torch.empty_like(q, dtype=torch.float32)
    lse = out.new_empty(q.shape[:3])
    for rows, pre, diag in _prefix_blocks(C.group_rank(group), C.group_size(group),
                                          q.shape[2] // 2, masks):
        how = _gathered_block(masks, diag, diag, True)
        o, l = _block_fwd(kernel, q[:, :, rows], kv[0][:, :, diag], kv[1][:, :, diag], True,
                          scale, how)
        out[:, :, rows], lse[:, :, rows] = o.float(), l
        how = _gathered_block(masks, diag, pre, False) if pre.stop > pre.start else "skip"
        if how != "skip":
            _merge(out[:, :, rows], lse[:, :, rows],
                   *_block_fwd(kernel, q[:, :, rows], kv[0][:, :, pre], kv[1][:, :, pre], False,
                               scale, how))
    return out, lse


def _allgather_bwd(dout, q, k, v, out, lse, group, scale, kernel, masks):
    """K/V gathered again, not kept (the memory CP saves); dK/dV reduce-scattered to owners."""
    size = C.group_size(group)
    kv = _gather_kv(k, v, group)
    chunk = q.shape[2] // 2
    dq = torch.zeros_like(q, dtype=torch.float32)
    dkv = kv.new_zeros((size, 2) + tuple(k.shape), dtype=torch.float32)  # [owner rank, k|v, ...]
    for rows, pre, diag in _prefix_blocks(C.group_rank(group), size, chunk, masks):
        for keys, causal in [(diag, True)] + ([(pre, False)] if pre.stop > pre.start else []):
            how = _gathered_block(masks, diag, keys, causal)
            if how == "skip":
                continue
            g = _block_bwd(kernel, dout[:, :, rows], q[:, :, rows], kv[0][:, :, keys],
                           kv[1][:, :, keys], out[:, :, rows], lse[:, :, rows], causal, scale, how)
            dq[:, :, rows] += g[0]
            for i, part in enumerate(torch.stack(g[1:]).split(chunk, dim=3)):
                j, half = chunk_owner(keys.start // chunk + i, size)  # to the owner's place
                dkv[j][:, :, :, half * chunk:(half + 1) * chunk] += part
    mine = dkv.new_empty(dkv.shape[1:])
    C.reduce_scatter_tensor(mine, dkv.flatten(0, 1), group, tag="cp_allgather")
    return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


# ---- a2a (Ulysses) ----

def _reshard(ts, group, to_heads: bool):
    """[b, h, s/C, d] tensors sharded on the sequence -> [b, h/C, s, d] in natural order
    (``to_heads``), or back."""
    size = C.group_size(group)
    # pieces[j]: what goes to CP rank j, one per tensor; every rank's have the shapes of ours
    pieces = [[t.chunk(size, 1)[j] if to_heads else shard(t, j, size, 2) for t in ts]
              for j in range(size)]
    got = _all_to_all([torch.cat([p.reshape(-1) for p in ps]) for ps in pieces], group)
    out, offset = [], 0
    for p in pieces[0]:
        parts = [g[offset:offset + p.numel()].view(p.shape) for g in got]
        out.append(_natural(parts, dim=2) if to_heads else torch.cat(parts, dim=1))
        offset += p.numel()
    return out


class _Reshard(torch.autograd.Function):
    """:func:`_reshard` one way, its backward the other."""

    @staticmethod
    def forward(ctx, group, to_heads, *ts):
        ctx.group, ctx.to_heads = group, to_heads
        return tuple(_reshard(list(ts), group, to_heads))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_reshard([g.contiguous() for g in grads], ctx.group,
                                      not ctx.to_heads))


def reshard_to_heads(t: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
    """One [b, h, s/C, d] tensor sharded on the sequence -> [b, h/C, s, d] in natural order
    (``to_heads``), or back; differentiable (the a2a path for any per-head mixer)."""
    return _Reshard.apply(group, to_heads, t.contiguous())[0]


# ---- one autograd function over the ring and all-gather ----

class _Attention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, sink, group, comm_type, scale, kernel, masks):
        ctx.group, ctx.comm_type, ctx.scale, ctx.kernel = group, comm_type, scale, kernel
        ctx.masks = masks
        fwd = _ring_fwd if comm_type == "p2p" else _allgather_fwd
        out, lse = fwd(q, k, v, group, scale, kernel, masks)
        if sink is not None:  # once per query, on the merged blocks ("Attention sinks")
            out, lse = apply_attention_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        return out

    @staticmethod
    def backward(ctx, dout):
        bwd = _ring_bwd if ctx.comm_type == "p2p" else _allgather_bwd
        q, k, v, out, lse, sink = ctx.saved_tensors
        grads = bwd(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.scale, ctx.kernel,
                    ctx.masks)
        dsink = None if sink is None else attention_sink_grad(dout, out, lse, sink)
        return (*grads, dsink, None, None, None, None, None)


def context_parallel_attention(q, k, v, cp_group, comm_type: str, softmax_scale=None,
                               local_attention=None, kernel: str = "auto",
                               documents: Optional[Documents] = None,
                               window: Optional[int] = None, sink: Optional[torch.Tensor] = None):
    """q [b, n, s/C, d], k, v [b, g, s/C, d] (g divides n) -> [b, n, s/C, d] in q's dtype.
    ``local_attention(q, k, v)``: a2a only, one head shard's attention over the whole sequence
    (default causal SDPA; with ``documents`` the caller's document attention; with ``sink``,
    taking its heads' sinks as ``sink=``). ``kernel``: --cp-attention-kernel. ``documents``,
    ``window`` (this layer's): the ring and all-gather mask their blocks by them and skip those no
    query sees (docs/context_parallel.md, "Packed documents", "Sliding window"). ``sink`` [n]:
    the heads' attention sinks. Its preconditions are checked once by
    ``ParallelConfig.check_context_parallel``, not here."""
    size, gqa = C.group_size(cp_group), k.shape[1] != q.shape[1]
    if size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale,
                                              enable_gqa=gqa)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if comm_type == "a2a":
        qh, kh, vh = _Reshard.apply(cp_group, True, q.contiguous(), k.contiguous(),
                                    v.contiguous())
        attend = local_attention or partial(F.scaled_dot_product_attention, is_causal=True,
                                            scale=scale, enable_gqa=gqa)
        if sink is not None:  # this rank's heads after the reshard: the C-th part it was sent
            attend = partial(attend, sink=sink.chunk(size)[C.group_rank(cp_group)])
        with sdpa_kernel(SDPBackend.MATH) if kernel == "math" else nullcontext():
            oh = attend(qh, kh, vh)
        return _Reshard.apply(cp_group, False, oh.contiguous())[0]
    if window is not None and window >= q.shape[2] * size:
        window = None  # every earlier key is in it
    return _Attention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sink, cp_group,
                            comm_type, scale, blocks.select(q, k, kernel),
                            (window, documents, q.device))
