"""Tensor and sequence parallelism equal one device (docs/design.md, contract 5).

Each config runs on 4 gloo processes; the single-device reference is computed in the same
processes with no process group (same seed => same full model, contract 3).
"""

import pytest
import torch

from dist_utils import run_distributed
from model_utils import VOCAB, assert_grads_close, full_grads, tiny_config

from megalite.distributed.finalize_model_grads import finalize_model_grads
from megalite.config import ExecutionConfig
from megalite.models import GPTModel
from megalite.parallel_state import ParallelState, initialize_model_parallel
from megalite.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, WeightGradStore, enable_weight_grad_deferral)

LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def _batch(seed=0, b=2, s=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _tp_parity_worker(rank, world_size, family, recompute=None):
    results = []
    tokens, labels = _batch()
    ref_model = GPTModel(tiny_config(family), ParallelState(), seed=7)
    ref_logits = ref_model(tokens)
    ref_loss = ref_model(tokens, labels=labels).mean()
    ref_loss.backward()
    ref_grads = full_grads(ref_model, None)
    for tp, sp in LAYOUTS:
        ps = initialize_model_parallel(tp, 1, backend="gloo", device="cpu", set_default=False)
        model = GPTModel(tiny_config(family), ps, seed=7, sequence_parallel=sp,
                         execution=ExecutionConfig(recompute_granularity=recompute))
        logits = model(tokens)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        finalize_model_grads(model, ps, data_parallel=False)
        where = f"{family} tp={tp} sp={sp} recompute={recompute}"
        assert logits.shape == ref_logits.shape, where
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=where)
        rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        assert rel <= 1e-5, f"{where}: loss rel diff {rel}"
        assert_grads_close(full_grads(model, ps.tp_group), ref_grads, 1e-5, where)
        results.append((tp, sp, loss.item()))
    return results


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tp_and_sp_match_single_device(family):
    results = run_distributed(_tp_parity_worker, 4, family)
    assert len(results[0]) == len(LAYOUTS)


def _sp_norm_grad_worker(rank, world_size):
    """Without the TP all-reduce of norm grads, SP norms get partial gradients (the classic bug)."""
    tokens, labels = _batch()
    ref = GPTModel(tiny_config("gpt2"), ParallelState(), seed=3)
    ref(tokens, labels=labels).mean().backward()
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    model = GPTModel(tiny_config("gpt2"), ps, seed=3, sequence_parallel=True)
    model(tokens, labels=labels).mean().backward()
    norm_w = "layers.0.input_layernorm.weight"
    partial = dict(model.named_parameters())[norm_w].grad.clone()
    ref_grad = dict(ref.named_parameters())[norm_w].grad
    # before finalize: a strict part of the gradient, not the gradient
    assert not torch.allclose(partial, ref_grad, rtol=1e-4, atol=1e-6)
    finalize_model_grads(model, ps, data_parallel=False)
    torch.testing.assert_close(dict(model.named_parameters())[norm_w].grad, ref_grad,
                               rtol=1e-5, atol=1e-6)
    return True


def test_sp_norm_grads_need_tp_all_reduce():
    assert all(run_distributed(_sp_norm_grad_worker, 2))


def _graph_nodes(t):
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [f for f, _ in node.next_functions]
    return [type(n).__name__ for n in seen]


def test_linears_are_native_unless_marked_deferrable():
    """A plain model's linears run on native autograd (F.linear; the custom function costs ~20 µs
    of Python each). Marked by enable_weight_grad_deferral, as the zero-bubble executor does, they
    run on the function, and a captured backward defers every weight gradient to the same values."""
    tokens, labels = _batch()
    fn = "LinearWithDeferrableWeightGradBackward"
    grads = []
    for marked in (False, True):
        model = GPTModel(tiny_config("gpt2"), ParallelState(), seed=7)
        linears = [m for m in model.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        store = WeightGradStore()
        if marked:
            enable_weight_grad_deferral([model], store)
        loss = model(tokens, labels=labels).mean()
        nodes = _graph_nodes(loss)
        # the output layer runs inside the chunked loss head, its own (also deferring) function
        assert nodes.count(fn) == (len(linears) - 1 if marked else 0)
        assert nodes.count("_LinearCrossEntropyBackward") == 1
        with store.capture() as queue:
            loss.backward()
        assert len(queue) == (len(linears) if marked else 0)
        assert all((m.weight.grad is None) == marked for m in linears if m.weight is not None)
        for w in queue:
            w()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert_grads_close(grads[1], grads[0], 1e-6, "deferred vs inline weight gradients")


def _tp_all_reduce_in_place_worker(rank, world_size):
    from megalite.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    a = torch.full((4, 2, 3), float(rank + 1), requires_grad=True)
    partial = a * 2  # saved by nothing: reduced in place, no copy
    out = reduce_from_tensor_model_parallel_region(partial, ps.tp_group)
    assert out.data_ptr() == partial.data_ptr()
    torch.testing.assert_close(out, torch.full_like(out, 6.0))
    out.sum().backward()
    torch.testing.assert_close(a.grad, torch.full_like(a, 2.0))
    # exp saves its output for backward: reducing it in place must raise, not corrupt
    saved = a.exp()
    out = reduce_from_tensor_model_parallel_region(saved, ps.tp_group)
    try:
        out.sum().backward()
    except RuntimeError as e:
        return "modified by an inplace operation" in str(e)
    return False


def test_tp_all_reduce_in_place_and_guarded():
    assert run_distributed(_tp_all_reduce_in_place_worker, 2) == [True, True]


def _sp_unmarked_defers_nothing_worker(rank, world_size):
    """SP's column-parallel linears take the autograd function unmarked (it saves only the input
    shard); inside a captured backward they still compute their weight gradient inline, as every
    unmarked linear does. Marked, every linear defers, to the same gradients."""
    tokens, labels = _batch()
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    grads = []
    for marked in (False, True):
        model = GPTModel(tiny_config("gpt2"), ps, seed=3, sequence_parallel=True)
        linears = [m for m in model.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        store = WeightGradStore()
        if marked:
            enable_weight_grad_deferral([model], store)
        loss = model(tokens, labels=labels).mean()
        with store.capture() as queue:
            loss.backward()
        assert len(queue) == (len(linears) if marked else 0), (marked, len(queue))
        assert all((m.weight.grad is None) == marked for m in linears if m.weight is not None)
        for w in queue:
            w()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert_grads_close(grads[1], grads[0], 1e-6, "deferred vs inline weight gradients (SP)")
    return True


def test_sp_linears_defer_only_when_marked():
    assert all(run_distributed(_sp_unmarked_defers_nothing_worker, 2))
