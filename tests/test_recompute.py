"""Activation recomputation (full and selective) gives the gradients of no recomputation,
including with dropout (the RNG state is replayed) and under TP+SP."""

import pytest
import torch

from dist_utils import run_distributed
from model_utils import VOCAB, assert_grads_close, full_grads, tiny_config
from megalite.distributed.finalize_model_grads import finalize_model_grads
from megalite.models import GPTModel
from megalite.parallel_state import ParallelState, initialize_model_parallel
from megalite.tensor_parallel.random import model_parallel_seed

RECOMPUTE = [("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 1), ("selective", None, None)]


def _run(cfg, ps, tokens, labels, seed=11):
    model_parallel_seed(seed, ps.tp_rank)
    model = GPTModel(cfg, ps, seed=5)
    model.train()
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    finalize_model_grads(model, ps, data_parallel=False)
    return loss.item(), full_grads(model, ps.tp_group)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("granularity,method,n", RECOMPUTE)
def test_recompute_matches_no_recompute_with_dropout(family, granularity, method, n):
    tokens = torch.randint(0, VOCAB, (2, 16))
    labels = torch.randint(0, VOCAB, (2, 16))
    kw = dict(hidden_dropout=0.1, attention_dropout=0.1)
    ref_loss, ref_grads = _run(tiny_config(family, **kw), ParallelState(), tokens, labels)
    cfg = tiny_config(family, recompute_granularity=granularity, recompute_method=method,
                      recompute_num_layers=n, **kw)
    loss, grads = _run(cfg, ParallelState(), tokens, labels)
    assert loss == ref_loss
    assert_grads_close(grads, ref_grads, 1e-6, f"{granularity}/{method}/{n}")


def _tp_recompute_worker(rank, world_size):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    kw = dict(sequence_parallel=True, hidden_dropout=0.1, attention_dropout=0.1)
    ref_loss, ref_grads = _run(tiny_config("llama", **kw), ps, tokens, labels)
    for granularity, method, n in RECOMPUTE:
        cfg = tiny_config("llama", recompute_granularity=granularity, recompute_method=method,
                          recompute_num_layers=n, **kw)
        loss, grads = _run(cfg, ps, tokens, labels)
        assert loss == ref_loss, (granularity, method, n)
        assert_grads_close(grads, ref_grads, 1e-6, f"tp2 sp {granularity}/{method}/{n}")
    return True


def test_recompute_under_tp2_sp_with_dropout():
    assert all(run_distributed(_tp_recompute_worker, 2))


def test_dropout_masks_differ_across_tp_ranks_inside_attention_only():
    """The tracker gives each TP rank its own stream; the default stream stays shared."""
    from megalite.tensor_parallel.random import get_rng_tracker

    model_parallel_seed(3, tp_rank=0)
    with get_rng_tracker().fork():
        a = torch.rand(8)
    shared_a = torch.rand(8)
    model_parallel_seed(3, tp_rank=1)
    with get_rng_tracker().fork():
        b = torch.rand(8)
    shared_b = torch.rand(8)
    assert not torch.equal(a, b)
    assert torch.equal(shared_a, shared_b)
