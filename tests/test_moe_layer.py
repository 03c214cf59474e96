"""The MoE MLP on one process (docs/moe.md): the same function as Hugging Face's Mixtral block,
grouped GEMMs equal the per-expert loop forward and backward, shared experts with their gate,
capacity drops, the balancing losses' gradient through the output hook, and initialisation that
does not depend on how the experts are split."""

import pytest
import torch

from megalite.config import ExecutionConfig
from megalite.models import GPTModel
from megalite.models.transformer import TransformerLayer, mlp_activation
from megalite.moe import router as R
from megalite.moe.layer import (MoELayer, begin_step, enable_expert_weight_grad_deferral,
                                moe_layers)
from megalite.overlap import WeightGradStore
from megalite.param_meta import param_meta
from megalite.parallel_state import ParallelState

from model_utils import tiny_config


def _moe_config(**kw):
    base = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)
    base.update(kw)
    return tiny_config("llama", **base)


def _layer(cfg, seed=0, grouped=True):
    torch.manual_seed(seed)
    layer = MoELayer(cfg, 0, mlp_activation(cfg),
                     execution=ExecutionConfig(moe_grouped_gemm=grouped))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def test_matches_hf_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = _moe_config()
    layer = _layer(cfg).eval()
    hf = MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        hidden_act="silu")).eval()
    with torch.no_grad():  # HF keeps [E, out, in]; megalite's stacked experts are [E, in, out]
        hf.gate.weight.copy_(layer.router)
        hf.experts.gate_up_proj.copy_(layer.weight1.transpose(1, 2))
        hf.experts.down_proj.copy_(layer.weight2.transpose(1, 2))
    x = torch.randn(7, 3, 32)
    want = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)  # HF is [b, s, h]
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(swiglu=False, activation="gelu",
                                             add_bias_linear=True)])
def test_grouped_gemm_equals_the_expert_loop(kw):
    cfg = _moe_config(**kw)
    loop, grouped = _layer(cfg, grouped=False), _layer(cfg)
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(9, 2, 32, requires_grad=True)
    outs = []
    for layer in (loop, grouped):
        x.grad = None
        y = layer(x)
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        outs.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
    (y0, dx0, g0), (y1, dx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grouped", [True, False])
def test_deferred_expert_weight_grads_are_the_inline_ones(grouped):
    """--delay-wgrad-compute's expert W (docs/moe.md): a marked layer's backward inside
    ``store.capture()`` leaves the expert weights' gradients to two queued closures;
    run, then followed by an inline micro-batch, every gradient is bit for bit the unmarked
    layer's (both paths: grouped GEMM and the per-expert loop)."""
    cfg = _moe_config()
    plain, marked = _layer(cfg, grouped=grouped), _layer(cfg, grouped=grouped)
    store = WeightGradStore()
    enable_expert_weight_grad_deferral([marked], store)
    xs = [torch.randn(9, 2, 32) for _ in range(2)]
    grads = []
    for layer in (plain, marked):
        dx = []
        for j, x in enumerate(xs):
            x = x.clone().requires_grad_()
            y = layer(x)
            loss = (y * torch.arange(y.numel()).view_as(y).sin()).sum()
            if layer is marked and j == 0:
                with store.capture() as queue:
                    loss.backward()
                assert len(queue) == 2 and layer.weight1.grad is None
                assert layer.weight2.grad is None and layer.router.grad is not None
                for fn in queue:
                    fn()
            else:
                loss.backward()
            dx.append(x.grad)
        grads.append(dx + [p.grad for p in layer.parameters()])
    assert param_meta(marked.weight1).weight_grads_queued == 0
    assert param_meta(marked.weight2).weight_grads_queued == 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _reference(layer, x):
    """Token by token: the gates over the chosen experts times each expert's MLP."""
    cfg = layer.config
    tokens = x.reshape(-1, x.shape[-1])
    probs, _ = R.route(tokens @ layer.router.t(), cfg.moe_router_topk)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e in probs[t].nonzero().flatten().tolist():
            h = layer.act(tokens[t] @ layer.weight1[e]) @ layer.weight2[e]
            out[t] += probs[t, e] * h
    return out.view_as(x)


def test_shared_expert_with_its_sigmoid_gate():
    cfg = _moe_config(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
    torch.manual_seed(0)
    block = TransformerLayer(cfg, 0)
    moe = block.mlp
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 2, 32)
    shared = moe.shared_expert(x) * torch.sigmoid(x @ moe.shared_gate.t())
    torch.testing.assert_close(moe(x), _reference(moe, x) + shared, rtol=1e-5, atol=1e-6)


def test_capacity_drops_tokens_over_it():
    cfg = _moe_config(moe_expert_capacity_factor=0.5)
    layer, full = _layer(cfg), _layer(_moe_config())
    full.load_state_dict(layer.state_dict())
    x = torch.randn(16, 1, 32)
    # 32 assignments over 4 experts at factor 0.5: 4 per expert are kept, so some tokens lose an
    # expert and the output differs from the dropless one
    _, routing_map = layer._route(x.view(-1, 32))[1:]
    assert (routing_map.sum(0) <= 4).all() and routing_map.sum() < 32
    assert not torch.allclose(layer(x), full(x))


def test_aux_and_z_loss_gradients_reach_the_router_through_the_output():
    cfg = _moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3)
    layer = _layer(cfg).train()
    x = torch.randn(6, 2, 32)
    begin_step([layer], 0.5)
    layer(x).sum().backward()
    got = layer.router.grad.clone()
    # by hand: the output's own gradient plus 0.5 x d(aux + z)/d(router)
    layer.router.grad = None
    tokens = x.view(-1, 32)
    y = _reference(layer, x)
    logits = tokens @ layer.router.t()
    scores, top = R.scores_for_aux_loss(logits, 2)
    aux = R.switch_load_balancing_loss(scores, top.sum(0).float(), 12, 2, 4, 0.1)
    (y.sum() + 0.5 * (aux + R.z_loss(logits, 1e-3))).backward()
    torch.testing.assert_close(got, layer.router.grad, rtol=1e-5, atol=1e-5)
    layer.router.grad = None
    _reference(layer, x).sum().backward()  # without the losses: clearly another gradient
    assert (got - layer.router.grad).abs().max() > 1e-3
    assert set(layer.metrics) >= {"load_balancing_loss", "z_loss", "tokens_per_expert"}


def test_expert_init_does_not_depend_on_the_split():
    """Experts are drawn one by one from (seed, name, global index): the local experts of EP
    rank r are rows r*E/EP.. of the one-process tensor."""
    from megalite.param_meta import param_meta, set_param_meta

    cfg = _moe_config(num_layers=1)
    full = GPTModel(cfg, ParallelState(), seed=5)
    w = full.layers["0"].mlp.weight1
    half = _layer(cfg)
    set_param_meta(half.weight1, init_method=("normal_experts", cfg.init_method_std, 2))
    from megalite.models.init import initialize_parameters

    sub = torch.nn.Module()
    sub.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    sub.layers["0"].mlp = half
    initialize_parameters(sub, 5, 0, 1, cfg)
    assert param_meta(half.weight1).expert
    assert torch.equal(half.weight1[:2], w[2:])
    assert len(moe_layers([full])) == 1


def test_model_flops_count_the_active_experts():
    from megalite.logging import model_flops_per_sequence

    dense = tiny_config("llama", num_layers=2)
    moe = _moe_config(num_layers=2, moe_layer_freq="[0,1]", moe_shared_expert_intermediate_size=16,
                      moe_shared_expert_gate=True)
    h, s, f, fm, fs, k, E = 32, 16, 48, 24, 16, 2, 4

    def mlp(width):
        return 2 * (h * 2 * width + width * h)  # SwiGLU: three h x width matrices

    active = 2 * h * E + k * mlp(fm) + mlp(fs) + 2 * h  # router, k experts, shared + its gate
    assert model_flops_per_sequence(moe) - model_flops_per_sequence(dense) == 3 * s * (
        active - mlp(f))


def test_global_aux_loss_takes_the_running_mean_of_the_step_counts():
    """global_aux_loss as Megatron's router computes it (whose buffers are created on CUDA, so
    its function is the oracle here): micro-batch j's loss uses the mean tokens per expert of the
    step's micro-batches 1..j; begin_step starts the counts again."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils as mu
    coeff, k, E = 1e-2, 2, 4
    cfg = _moe_config(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=coeff)
    layer = _layer(cfg).train()
    xs = [torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    counts, got, want = [], [], []
    for step in range(2):
        begin_step([layer], 1.0)
        counts.clear()
        for x in xs[step:]:
            layer(x)
            logits = torch.nn.functional.linear(x.reshape(-1, 32), layer.router.detach())
            top, scores = mu.compute_routing_scores_for_aux_loss(logits, k, "softmax")
            counts.append(top.sum(0).float())
            want.append(mu.switch_load_balancing_loss_func(scores, sum(counts) / len(counts),
                                                           12, k, E, coeff))
            got.append(layer.metrics["load_balancing_loss"])
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-6, atol=0)
    assert layer.step_micro_batches == 2
