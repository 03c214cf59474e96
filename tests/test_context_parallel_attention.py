"""Context-parallel attention equals one process's causal attention on the whole sequence.

Every comm type (p2p ring, allgather, a2a), forward and backward (grads of q, k, v), with and
without GQA, at C = 2 and 4, on the fused CPU blocks and on the math ones
(``--cp-attention-kernel math``): each rank computes the reference on the whole sequence itself
and compares its load-balanced shard (``sharding.shard``) of the output and of the gradients.
The block kernels themselves: test_context_parallel_blocks.py.
"""

import pytest
import torch
import torch.nn.functional as F

from megalite import collectives as C
from megalite.config import ConfigError, ModelConfig, ParallelConfig
from megalite.context_parallel import attention as A
from megalite.context_parallel.sharding import shard
from tests.dist_utils import run_distributed

B, N, S, D = 2, 8, 32, 8  # 2C chunks of S: 4 tokens at C = 4; K/V groups N or C (GQA)


def _case(group, rank, size, comm, groups, dtype, seed, kernel="auto"):
    """Max abs error of (out, dq, dk, dv) of CP attention against the whole-sequence reference,
    relative to the reference's largest magnitude."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, h, S, D, generator=gen)
                     for h in (N, groups, groups, N))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                         enable_gqa=groups != N)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    local = [shard(t.detach(), rank, size, 2).requires_grad_() for t in (q, k, v)]
    C.reset_bytes_sent()
    out = A.context_parallel_attention(*local, group, comm, kernel=kernel)
    assert out.dtype == dtype and out.shape == local[0].shape
    grads = torch.autograd.grad(out, local, shard(dout, rank, size, 2).to(dtype))
    return [float((a.detach().float() - shard(b.detach(), rank, size, 2)).abs().max()
                  / b.detach().abs().max()) for a, b in zip([out, *grads], [ref, *ref_grads])]


def _all_cases(rank, size):
    group = torch.distributed.new_group(list(range(size)))
    errs = {}
    for comm in ("p2p", "allgather", "a2a"):
        for g in (N, size):
            errs[comm, g] = _case(group, rank, size, comm, g, torch.float32, 7 + g)
        # bytes sent by this rank, forward + backward (docs/theory.md, "Context parallelism"):
        # K/V in fp32 (e = 4) and dK/dV in fp32, KV = 2 b g (s/C) d e
        kv = 2 * B * g * (S // size) * D * 4
        want = {"p2p": {"cp_p2p": 2 * (size - 1) * kv + size * kv},
                "allgather": {"cp_allgather": 3 * (size - 1) * kv},
                "a2a": {"cp_a2a": 2 * (size - 1) * B * (S // size) * D * (2 * N + 2 * g) * 4
                        // size}}[comm]
        assert C.bytes_sent() == want, (comm, C.bytes_sent(), want)
        errs[comm, "math"] = _case(group, rank, size, comm, size, torch.float32, 5, "math")
    bf16 = {comm: _case(group, rank, size, comm, size, torch.bfloat16, 3)
            for comm in ("p2p", "allgather", "a2a")}
    return errs, bf16


@pytest.mark.parametrize("size", [2, 4])
def test_context_parallel_attention_matches_one_process(size):
    for errs, bf16 in run_distributed(_all_cases, size):
        for case, e in errs.items():  # out, dq, dk, dv
            assert max(e) < 1e-5, (case, e)
        for comm, e in bf16.items():
            assert max(e) < 1e-2, (comm, e)  # bf16's epsilon: 7.8e-3


def test_single_rank_is_plain_causal_attention():
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(A.context_parallel_attention(q, k, v, None, "p2p"), ref)


@pytest.mark.parametrize("size", [2, 4])
def test_what_the_attention_needs_is_refused_by_the_config(size):
    """context_parallel_attention checks nothing itself: the validated config is the one home of
    its needs (an unknown comm type; a2a with K/V groups, here 1, not divisible by C; an odd
    local sequence, s not divisible by 2C)."""
    with pytest.raises(ConfigError, match="must be one of p2p, allgather, a2a"):
        ParallelConfig(cp_comm_type="ring").validate()
    model = dict(num_attention_heads=N, hidden_size=N * D, seq_length=S, attention_dropout=0.0)
    ParallelConfig(context_parallel_size=size, cp_comm_type="a2a").check_context_parallel(
        ModelConfig(**model))  # the shapes the parity test above runs
    for comm, extra, match in (("a2a", dict(num_query_groups=1), "1 query groups"),
                               ("p2p", dict(seq_length=2 * size * 4 + size), "divisible by")):
        with pytest.raises(ConfigError, match=match):
            ParallelConfig(context_parallel_size=size, cp_comm_type=comm).check_context_parallel(
                ModelConfig(**{**model, **extra}))


def test_chunk_owner_inverts_chunk_ids():
    from megalite.context_parallel.sharding import chunk_ids, chunk_owner

    for size in (1, 2, 3, 4):
        for c in range(2 * size):
            rank, i = chunk_owner(c, size)
            assert chunk_ids(rank, size)[i] == c
