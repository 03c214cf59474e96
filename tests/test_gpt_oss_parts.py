"""GPT-OSS's model parts (docs/models.md, "GPT-OSS"), each against a reference: attention sinks
against a softmax written out with one more column, the clamped SwiGLU and the biased router
against transformers' GPT-OSS modules, the alternating window pattern against its config's
layer types, YaRN without truncation against transformers' YaRN; and a tiny model with all of
them at TP2 + SP (ETP 2), EP2 and DP2 ZeRO-3 with selective recompute equal to one process
(fp32, 1e-5, strict mode)."""

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from megalite.config import ConfigError, ModelConfig
from megalite.masks import Documents, sink_attention

TOL = dict(rtol=1e-5, atol=1e-5)


def _reference_sink_attention(q, k, v, sink, mask):
    """softmax over [scores, sink] per query and head, the sink's column dropped after."""
    b, n, s, d = q.shape
    k, v = (t.repeat_interleave(n // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) * d ** -0.5).masked_fill(~mask, float("-inf"))
    column = sink.view(1, n, 1, 1).expand(b, n, s, 1)
    return torch.cat([scores, column], -1).softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("kernel", ["auto", "math"])
def test_sink_attention_equals_a_softmax_with_one_more_column(kernel):
    gen = torch.Generator().manual_seed(0)
    s = 24
    pos = torch.arange(s)
    gap = pos[:, None] - pos[None, :]
    docs = Documents.of(np.tile(np.arange(s) // 10, (2, 1)))
    cases = {"causal": (None, None, (gap >= 0)[None, None]),
             "window": (5, None, ((gap >= 0) & (gap < 5))[None, None]),
             "documents and window": (7, docs, docs.mask(pos, pos, 7))}
    for name, (window, documents, mask) in cases.items():
        q = torch.randn(2, 4, s, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(2, 2, s, 8, generator=gen, requires_grad=True) for _ in range(2))
        sink = torch.randn(4, generator=gen, requires_grad=True)
        out = sink_attention(q, k, v, sink, window, documents, kernel=kernel)
        ref = _reference_sink_attention(q, k, v, sink, mask)
        torch.testing.assert_close(out, ref, **TOL, msg=name)
        dout = torch.randn(out.shape, generator=gen)
        got = torch.autograd.grad(out, (q, k, v, sink), dout)
        want = torch.autograd.grad(ref, (q, k, v, sink), dout)
        for what, a, b in zip("qkv", got, want):
            torch.testing.assert_close(a, b, **TOL, msg=f"{name}: d{what}")
        torch.testing.assert_close(got[3], want[3], **TOL, msg=f"{name}: dsink")
        assert want[3].abs().min() > 1e-3  # each head's sink gets a gradient


def test_clamped_swiglu_is_gpt_oss_gate_on_megalite_halves():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from megalite.models.transformer import mlp_activation

    cfg = ModelConfig(swiglu=True, swiglu_limit=0.7, swiglu_alpha=1.5).validate()
    hf = GptOssExperts(GptOssConfig(swiglu_limit=0.7))
    hf.alpha = 1.5
    gate, up = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(0))
    interleaved = torch.stack([gate, up], -1).flatten(-2)  # GPT-OSS: gate [..., ::2], up [1::2]
    assert (gate > 0.7).any() and (up.abs() > 0.7).any()  # both clamps bite
    torch.testing.assert_close(mlp_activation(cfg)(torch.cat([gate, up], -1)),
                               hf._apply_gate(interleaved), rtol=0, atol=1e-6)


def test_router_linear_bias_moves_choice_and_gates_as_gpt_oss_router():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from megalite.models.transformer import mlp_activation
    from megalite.moe.layer import MoELayer

    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_experts=8, moe_router_topk=2,
                      moe_router_linear_bias=True).validate()
    layer = MoELayer(cfg, 0, mlp_activation(cfg))
    hf = GptOssTopKRouter(GptOssConfig(hidden_size=32, num_local_experts=8,
                                       num_experts_per_tok=2))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (layer.router, layer.router_bias):
            p.normal_(0, 1, generator=gen)
        hf.weight.copy_(layer.router)
        hf.bias.copy_(layer.router_bias)
    x = torch.randn(40, 32, generator=gen)
    _, probs, routing_map = layer._route(x)
    _, scores, idx = hf(x)
    want = torch.zeros(40, 8).scatter(1, idx, scores)
    torch.testing.assert_close(probs, want, **TOL)
    assert routing_map.equal(want > 0)
    # the bias changes the choice for some token: the selection, not just the gates, moves
    assert not routing_map.equal(torch.zeros_like(routing_map).scatter(
        1, (x @ layer.router.detach().t()).topk(2).indices, True))


def test_window_skip_frequency_is_gpt_oss_layer_types():
    from transformers import GptOssConfig

    cfg = ModelConfig(num_layers=6, sliding_window=4, window_attn_skip_freq=2).validate()
    types = GptOssConfig(num_hidden_layers=6).layer_types
    assert [cfg.attention_window(i) for i in range(6)] == [
        4 if t == "sliding_attention" else None for t in types] == [4, None] * 3
    both = ModelConfig(num_layers=6, sliding_window=4, window_attn_skip_freq=3,
                       max_window_layers=2).validate()
    assert [both.attention_window(i) for i in range(6)] == [None, None, None, 4, 4, None]


@pytest.mark.parametrize("overrides, message", [
    (dict(swiglu_limit=7.0), "--swiglu-limit needs --swiglu"),
    (dict(window_attn_skip_freq=2), "--window-attn-skip-freq needs --sliding-window"),
    (dict(attention_sinks=True, attention_dropout=0.1), "--attention-sinks needs softmax"),
    (dict(rope_yarn_truncate=False), "--rope-yarn-truncate needs --rope-type yarn"),
    (dict(moe_router_linear_bias=True), "--moe-router-linear-bias needs --num-experts"),
])
def test_gpt_oss_settings_out_of_place_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**overrides).validate()


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_inv_freq_equals_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from megalite.models.rotary import rotary_embedding

    hf = GptOssConfig(head_dim=64, hidden_size=256, num_attention_heads=4)
    hf.rope_parameters = dict(hf.rope_parameters, truncate=truncate)
    want, factor = _compute_yarn_parameters(hf, "cpu")
    rope = hf.rope_parameters
    cfg = ModelConfig(hidden_size=256, num_attention_heads=4, kv_channels=64,
                      position_embedding_type="rope", rope_type="yarn",
                      rotary_base=rope["rope_theta"], rotary_scaling_factor=rope["factor"],
                      rope_original_max_position_embeddings=rope[
                          "original_max_position_embeddings"],
                      beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"],
                      rope_yarn_truncate=truncate).validate()
    ours = rotary_embedding(cfg, 64)
    torch.testing.assert_close(ours.inv_freq, want, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(factor)


# A tiny GPT-OSS: grouped queries, biases everywhere (the experts' too: split over ETP at TP2), a
# sink per head, alternating windowed and full layers, YaRN untruncated, 4 experts chosen by a
# biased router, SwiGLU clamped tightly enough (0.1) that the clamps bite at this init.
GPT_OSS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
           "--group-query-attention",
           "--num-query-groups", "2", "--attention-sinks", "--sliding-window", "4",
           "--window-attn-skip-freq", "2", "--rope-type", "yarn", "--rotary-scaling-factor", "4",
           "--rope-original-max-position-embeddings", "8", "--no-rope-yarn-truncate",
           "--swiglu-limit", "0.1", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-ffn-hidden-size", "24", "--moe-router-linear-bias",
           "--untie-embeddings-and-output-weights"]
LAYOUTS = {"tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "ep2": ["--expert-model-parallel-size", "2"],
           # the sinks inside the recomputed attention core, gathered by ZeRO-3
           "dp2_zero3_selective": ["--zero-stage", "3", "--recompute-granularity", "selective"]}
ITERS = 3


def test_model_holds_each_part():
    from megalite.arguments import parse_args
    from megalite.models.gpt import GPTModel

    from pretrain_utils import flags

    cfg = parse_args(flags(*GPT_OSS, "--vocab-size", "304")).model  # (304: no padding rows)
    model = GPTModel(cfg, seed=1)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    layers = list(model.layers.values())
    assert [layer.self_attention.window for layer in layers] == [4, None]
    assert all(layer.self_attention.sinks.abs().min() > 0 for layer in layers)
    assert all(layer.mlp.router_bias.shape == (4,) for layer in layers)


def test_a_step_reads_nothing_on_the_host():
    """The sink's kernel is chosen and its masks decided on the host (masks.block), once: steps
    2-4 read no device value (tests/host_reads.py; a log line at 4 only)."""
    from host_reads import count_pretrain
    from pretrain_utils import flags

    counts = count_pretrain(flags(*GPT_OSS, "--log-interval", "4", "--global-batch-size", "2",
                                  train_iters=5))
    assert [sum(c.values()) for c in counts[1:4]] == [0, 0, 0], counts[1:4]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    from pretrain_utils import flags, pretrain_cases, run_main

    d = tmp_path_factory.mktemp("gpt_oss")

    def argv(name, layout):
        return flags(*GPT_OSS, *layout, train_iters=ITERS, eval_iters=0,
                     metrics_file=d / f"{name}.jsonl")

    runs = [argv(name, layout) for name, layout in LAYOUTS.items()]
    assert all(run_distributed(pretrain_cases, 2, runs, timeout=600))
    assert run_main(argv("single", [])) == 0
    return d


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt_oss_layout_equals_one_process(layout_runs, name):
    from pretrain_utils import assert_same_run, read_metrics

    ref = read_metrics(layout_runs / "single.jsonl")
    assert_same_run(ref, read_metrics(layout_runs / f"{name}.jsonl"), ITERS, name=name)
    assert len({round(r["lm_loss"], 4) for r in ref}) == ITERS  # the losses do move
