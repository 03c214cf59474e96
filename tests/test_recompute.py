"""Activation recomputation (full and selective) gives the gradients of no recomputation,
including with dropout (the RNG state is replayed) and under TP+SP."""

import pytest
import torch

from dist_utils import run_distributed
from model_utils import VOCAB, assert_grads_close, full_grads, tiny_config
from megalite.config import ExecutionConfig
from megalite.distributed.finalize_model_grads import finalize_model_grads
from megalite.models import GPTModel
from megalite.parallel_state import ParallelState, initialize_model_parallel
from megalite.tensor_parallel.random import model_parallel_seed

RECOMPUTE = [("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 1), ("selective", None, None)]


def _run(cfg, ps, tokens, labels, seed=11, sp=False, ex=ExecutionConfig()):
    model_parallel_seed(seed, ps.tp_rank)
    model = GPTModel(cfg, ps, seed=5, sequence_parallel=sp, execution=ex)
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
    ex = ExecutionConfig(recompute_granularity=granularity, recompute_method=method,
                         recompute_num_layers=n)
    loss, grads = _run(tiny_config(family, **kw), ParallelState(), tokens, labels, ex=ex)
    assert loss == ref_loss
    assert_grads_close(grads, ref_grads, 1e-6, f"{granularity}/{method}/{n}")


def _tp_recompute_worker(rank, world_size):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    kw = dict(hidden_dropout=0.1, attention_dropout=0.1)
    ref_loss, ref_grads = _run(tiny_config("llama", **kw), ps, tokens, labels, sp=True)
    for granularity, method, n in RECOMPUTE:
        ex = ExecutionConfig(recompute_granularity=granularity, recompute_method=method,
                             recompute_num_layers=n)
        loss, grads = _run(tiny_config("llama", **kw), ps, tokens, labels, sp=True, ex=ex)
        assert loss == ref_loss, (granularity, method, n)
        assert_grads_close(grads, ref_grads, 1e-6, f"tp2 sp {granularity}/{method}/{n}")
    return True


def test_recompute_under_tp2_sp_with_dropout():
    assert all(run_distributed(_tp_recompute_worker, 2))


def _masks_worker(rank, world_size):
    """Record every dropout the model draws: the hidden/embedding masks themselves, and for
    attention (whose mask SDPA draws internally) the generator state it draws from."""
    import torch.distributed as dist
    import torch.nn.functional as F

    log = []
    real_dropout, real_sdpa = F.dropout, F.scaled_dot_product_attention

    def dropout(x, p=0.5, training=True, inplace=False):
        out = real_dropout(x, p, training, inplace)
        log.append(("hidden", (out == 0).clone()))
        return out

    def sdpa(q, k, v, *args, dropout_p=0.0, **kwargs):
        if dropout_p > 0:
            log.append(("attention", torch.get_rng_state()))
        return real_sdpa(q, k, v, *args, dropout_p=dropout_p, **kwargs)

    F.dropout, F.scaled_dot_product_attention = dropout, sdpa
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    for sp in (False, True):
        log.clear()
        cfg = tiny_config("gpt2", hidden_dropout=0.2, attention_dropout=0.2)
        ex = ExecutionConfig(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1)
        model_parallel_seed(11, ps.tp_rank)
        model = GPTModel(cfg, ps, seed=5, sequence_parallel=sp, execution=ex)
        model.train()
        model(tokens, labels=labels).mean().backward()
        # forward: embedding, then per layer attention + 2 hidden; backward replays each layer
        per_layer = 3
        n_fwd = 1 + per_layer * cfg.num_layers
        assert [k for k, _ in log[:n_fwd]] == ["hidden"] + ["attention", "hidden", "hidden"] * 2
        assert len(log) == n_fwd + per_layer * cfg.num_layers, len(log)
        fwd = [log[1 + i * per_layer:1 + (i + 1) * per_layer] for i in range(cfg.num_layers)]
        bwd = [log[n_fwd + i * per_layer:n_fwd + (i + 1) * per_layer]
               for i in range(cfg.num_layers)][::-1]  # backward recomputes the last layer first
        for i, (f, b) in enumerate(zip(fwd, bwd)):  # recompute replays every mask exactly
            assert all(torch.equal(x, y) for (_, x), (_, y) in zip(f, b)), (sp, i)
        others = [None] * world_size
        dist.all_gather_object(others, [t for _, t in log[:n_fwd]], group=ps.tp_group)
        mine, other = others[ps.tp_rank], others[1 - ps.tp_rank]
        for j, (kind, _) in enumerate(log[:n_fwd]):
            same = torch.equal(mine[j], other[j])
            if kind == "attention":  # each rank's own heads: its own stream (tracker fork)
                assert not same, (sp, j)
            elif sp:  # each rank's own sequence shard: its own mask
                assert not same, (sp, j)
            else:  # replicated activations: the same mask on every TP rank
                assert same, (sp, j)
    return True


def test_dropout_masks_across_tp_ranks_and_recompute_replay():
    """TP 2, with and without SP, dropout in the embedding, attention and hidden states: masks
    differ across TP ranks where the ranks hold different data (attention heads; SP sequence
    shards), agree where they hold the same (replicated hidden states), and full recomputation
    draws exactly the masks of the original forward."""
    assert all(run_distributed(_masks_worker, 2))
