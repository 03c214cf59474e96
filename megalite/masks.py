"""Which keys a query attends to: causal, a sliding window, the documents of a packed sample; and
attention on one device under those masks (docs/data.md, "Packed documents"; docs/models.md,
"Sliding window"). Context parallelism asks :class:`Documents` which of its blocks to skip."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from megalite.compiled import self_checked
from megalite.context_parallel import blocks


def sliding_window_attention(q, k, v, window: int, **kw) -> torch.Tensor:
    """Causal SDPA in which query i sees keys i - W < j <= i (W = ``window``); q: [b, n, s, d],
    k, v: [b, g, s, d]; ``kw`` is passed to SDPA (dropout, enable_gqa). Query blocks of W against
    one [W, 2W] band mask (docs/models.md, "Sliding window")."""
    b, n, s, d = q.shape
    if s <= 2 * window:
        i = torch.arange(s, device=q.device)
        gap = i[:, None] - i[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < window),
                                              **kw)
    nb, g, w = -(-s // window), k.shape[1], window
    pad = nb * w - s
    first = F.scaled_dot_product_attention(q[:, :, :w], k[:, :, :w], v[:, :, :w], is_causal=True,
                                           **kw)
    q = F.pad(q[:, :, w:], (0, 0, 0, pad)).view(b, n, nb - 1, w, d).transpose(1, 2).reshape(
        b * (nb - 1), n, w, d)
    # the keys of query block c >= 1 are window c - 1: positions [(c-1)W, (c+1)W)
    k, v = (F.pad(t, (0, 0, 0, pad)).unfold(2, 2 * w, w)  # [b, g, nb - 1, d, 2W]
            .permute(0, 2, 1, 4, 3).reshape(b * (nb - 1), g, 2 * w, d) for t in (k, v))
    i, j = torch.arange(w, device=q.device), torch.arange(2 * w, device=q.device)
    gap = i[:, None] + w - j[None, :]  # query position minus key position, in every block
    rest = F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < w), **kw)
    rest = rest.view(b, nb - 1, n, w, d).transpose(1, 2).reshape(b, n, (nb - 1) * w, d)
    return torch.cat([first, rest], dim=2)[:, :, :s]


def causal_attention(q, k, v, window: Optional[int] = None, **kw) -> torch.Tensor:
    """Causal SDPA over whole sequences, within ``window`` keys when it is shorter than them."""
    if window is not None and window < q.shape[2]:
        return sliding_window_attention(q, k, v, window, **kw)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)


def apply_attention_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor):
    """(output, log-sum-exp) of a softmax with one more logit, ``sink`` [n] per head, of value 0,
    in its denominator, from ``out`` [b, n, s, d] and its log-sum-exp ``lse`` [b, n, s] without
    it: out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink), in fp32, and
    log(exp(lse) + exp(sink)), with which the kernels' backward gives the sink's softmax."""
    sink = sink.float()[:, None]
    out = out.float() * torch.sigmoid(lse.float() - sink).unsqueeze(-1)
    return out, torch.logaddexp(lse, sink)


def attention_sink_grad(dout, out, lse, sink) -> torch.Tensor:
    """The sink's gradient [n] from the output's, ``out`` and ``lse`` being the attention's with
    the sink: a key of value 0 whose probability is exp(sink - lse), so its softmax gradient is
    -exp(sink - lse) (dout . out), summed over the batch and the queries."""
    p = (sink.float()[:, None] - lse.float()).exp()
    return -(p * (dout.float() * out.float()).sum(-1)).sum((0, 2)).to(sink.dtype)


class _SinkAttention(torch.autograd.Function):
    """A block kernel's attention with a sink: its backward is the kernel's given the output and
    log-sum-exp with the sink (the sink a key of value 0), plus the sink's own gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sink, kernel, mask, scale):
        out, lse = apply_attention_sink(*kernel.fwd(q, k, v, mask, scale), sink)
        out = out.to(q.dtype)
        ctx.kernel, ctx.mask, ctx.scale = kernel, mask, scale
        ctx.save_for_backward(q, k, v, sink, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sink, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        grads = ctx.kernel.bwd(dout, q, k, v, out, lse, ctx.mask, ctx.scale)
        return (*grads, attention_sink_grad(dout, out, lse, sink), None, None, None)


def sink_attention(q, k, v, sink, window=None, docs=None, scale=None, kernel: str = "auto"):
    """Causal attention (within ``window``, within ``docs``' documents) with a sink per head: a
    block kernel that returns the log-sum-exp (context_parallel/blocks.py; ``kernel``:
    --cp-attention-kernel), then apply_attention_sink. q [b, n, s, d], k, v [b, g, s, d]."""
    pos = torch.arange(q.shape[2])
    mask = block(pos, pos, True, window, docs, q.device)  # None: the kernel's causal mask
    chosen = blocks.select(q, k, kernel)
    chosen, mask = (chosen, True) if mask is None else (blocks.masked(chosen), mask)
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _SinkAttention.apply(q, k, v, sink, chosen, mask, scale or q.shape[-1] ** -0.5)


def document_ids(tokens: np.ndarray, eod: int):
    """(ids, positions) of ``tokens`` [b, s] (host): each token's document index in its sample
    and its position in that document. A document ends with its EOD: the next token starts one."""
    ends = tokens == eod
    ids = np.cumsum(ends, axis=1) - ends  # EODs strictly before each token
    first = np.zeros(tokens.shape, dtype=np.int64)  # each token's document's first position
    first[:, 1:] = np.where(ends[:, :-1], np.arange(1, tokens.shape[1]), 0)
    return ids, np.arange(tokens.shape[1]) - np.maximum.accumulate(first, axis=1)


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a micro-batch's packed samples, whole sequence (every CP rank has all):
    ``lengths`` per sample (host ints, summing to s), ``ids`` [b, s] each token's document
    index, on the compute device, ``host_ids`` the same on the host (block decisions read it),
    ``cu_seqlens`` the documents' cumulative lengths over the batch (int32, compute device)."""

    lengths: tuple
    ids: torch.Tensor
    host_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    _blocks: dict = field(default_factory=dict, repr=False)  # the block decisions, per block

    @classmethod
    def of(cls, ids: np.ndarray) -> "Documents":
        ids = torch.from_numpy(np.ascontiguousarray(ids)).to(torch.int32)
        lengths = tuple(tuple(np.bincount(row).tolist()) for row in ids.numpy())
        cu = np.concatenate([[0], np.cumsum([x for row in lengths for x in row])])
        return cls(lengths, ids, ids, torch.from_numpy(cu).to(torch.int32))

    def to(self, device, non_blocking: bool = False) -> "Documents":
        """On ``device``: the host parts stay (CUDA: copy from pinned memory, queued)."""
        move = (lambda t: t.pin_memory().to(device, non_blocking=True)) if non_blocking else (
            lambda t: t.to(device))
        return Documents(self.lengths, move(self.ids), self.host_ids, move(self.cu_seqlens))

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int] = None,
             ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[b, 1, sq, sk] bool: query at position q_pos[i] sees key k_pos[j] (same document,
        causal, within ``window``); on ``ids``' device (default the compute device)."""
        ids = self.ids if ids is None else ids
        q_pos, k_pos = q_pos.to(ids.device), k_pos.to(ids.device)
        gap = q_pos[:, None] - k_pos[None, :]
        ok = (gap >= 0) if window is None else (gap >= 0) & (gap < window)
        return ((ids[:, q_pos, None] == ids[:, None, k_pos]) & ok).unsqueeze(1)


_WINDOW_BLOCKS: dict = {}  # decisions without documents: fixed by positions, kept for good


def block(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: Optional[int] = None,
          documents: Optional[Documents] = None, device=None):
    """How a CP block of queries at global positions ``q_pos`` (host) against keys at ``k_pos``
    runs under ``window`` and ``documents``: "skip" (no query sees a key), None (the kernel's own
    mask, causal or full, is exact) or the [b or 1, 1, sq, sk] bool mask, on ``device`` (with
    documents, theirs). Decided on the host, in numpy, once per micro-batch with documents and
    once for good without: the values read are host ones, never a device's (torch reads, even of
    host tensors, would look like device syncs to tests/host_reads.py)."""
    q, k = q_pos.numpy(), k_pos.numpy()
    # a block's rows and keys are one or two whole chunks: ends and count name them
    key = (int(q[0]), int(q[-1]), len(q), int(k[0]), int(k[-1]), len(k), causal, window)
    cache = _WINDOW_BLOCKS if documents is None else documents._blocks
    key, device = (key + (device,), device) if documents is None else (key, documents.ids.device)
    if key not in cache:
        gap = q[None, None, :, None] - k[None, None, None, :]
        m = (gap >= 0) if window is None else (gap >= 0) & (gap < window)
        if documents is not None:
            ids = documents.host_ids.numpy()
            m = m & (ids[:, None, q, None] == ids[:, None, None, k])
        if not m.any():
            cache[key] = "skip"
        elif m.all() or (causal and (m == np.tri(*m.shape[-2:], dtype=bool)).all()):
            cache[key] = None
        else:  # CUDA: queued from pinned memory, not waited for (as Documents.to)
            m = torch.from_numpy(m)
            cache[key] = m.pin_memory().to(device, non_blocking=True) if m.device != device else m
    return cache[key]


# One masked SDPA per sample instead of an SDPA per document when a sample holds more documents
# than this times (s/512)^2: the masked call costs ~ s^2, the calls per document ~ their number.
# CPU, 4 heads of 64: they cross near 100 documents at s = 256, 450 at s = 512 and beyond s at
# s = 2048 (benchmarks/documents.py; docs/performance.md, "Packed documents").
_MANY_DOCUMENTS = 400


def document_attention(q, k, v, docs: Documents, window: Optional[int] = None, **kw):
    """q [b, n, s, d], k, v [b, g, s, d]: causal attention (within ``window``) in which each token
    sees only its own document's keys; ``kw`` as SDPA's (scale, dropout_p, enable_gqa)."""
    if q.is_cuda and kw.get("dropout_p", 0.0) == 0.0 and _varlen_ok(q, k, window):
        return _varlen(q, k, v, docs, window, **kw)
    return _per_document(q, k, v, docs, window, **kw)


def _per_document(q, k, v, docs: Documents, window: Optional[int] = None, **kw):
    """SDPA per document, or per sample under one mask when its documents are many."""
    out = []
    # split, not sliced: a slice's backward is a gradient of the whole tensor, one per document
    for i, (lengths, *one) in enumerate(zip(docs.lengths, *(t.split(1) for t in (q, k, v)))):
        if len(lengths) > _MANY_DOCUMENTS * (q.shape[2] / 512) ** 2:
            pos = torch.arange(q.shape[2])
            mask = docs.mask(pos, pos, window, ids=docs.ids[i:i + 1])
            out.append(F.scaled_dot_product_attention(*one, attn_mask=mask, **kw))
            continue
        parts = zip(*(t.split(lengths, dim=2) for t in one))
        out.append(torch.cat([causal_attention(*p, window, **kw) for p in parts], dim=2))
    return torch.cat(out, dim=0)


def _varlen(q, k, v, docs: Documents, window: Optional[int], scale=None, enable_gqa=False,
            dropout_p=0.0):
    """torch's varlen flash attention (CUDA): the samples' documents as one ragged batch."""
    from torch.nn.attention.varlen import varlen_attn

    b, n, s, d = q.shape
    longest = max(x for row in docs.lengths for x in row)
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    cu = docs.cu_seqlens
    out = varlen_attn(*flat, cu, cu, longest, longest, scale=scale,
                      window_size=(-1 if window is None else window - 1, 0),
                      enable_gqa=enable_gqa)
    return out.view(b, s, n, -1).transpose(1, 2)


_VARLEN_CHECKED: dict = {}  # (device, dtype, head dim, window, gqa) -> passed its self-check


def _varlen_ok(q, k, window) -> bool:
    """Whether torch's varlen kernel runs here and matches the per-document SDPA on a small
    random packed batch (checked once per kind of call; one warning line when it does not)."""
    gqa = q.shape[1] != k.shape[1]
    key = (q.device, q.dtype, q.shape[-1], window, gqa)
    if key not in _VARLEN_CHECKED:
        gen = torch.Generator(device=q.device).manual_seed(0)
        qq = torch.randn(2, q.shape[1], 96, q.shape[-1], device=q.device, generator=gen)
        kk, vv = (torch.randn(2, k.shape[1], 96, q.shape[-1], device=q.device, generator=gen)
                  for _ in range(2))
        qq, kk, vv = (t.to(q.dtype) for t in (qq, kk, vv))
        docs = Documents.of(np.tile(np.arange(96) // 40, (2, 1))).to(q.device)

        def error():
            got = _varlen(qq, kk, vv, docs, window, enable_gqa=gqa)
            ref = _per_document(qq.float(), kk.float(), vv.float(), docs, window, enable_gqa=gqa)
            return float((got.float() - ref).abs().max() / ref.abs().max())

        _VARLEN_CHECKED[key] = self_checked("document attention: torch's varlen kernel",
                                            "SDPA per document", error, 3e-2)
    return _VARLEN_CHECKED[key]
