"""Hybrid linear attention (Gated DeltaNet layers beside gated softmax layers, Qwen3.5's shape):
every layout trains as one process does (docs/design.md, contract 5), and what the layer cannot
run is refused in one line (docs/models.md, "Hybrid linear attention")."""

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError
from tests.dist_utils import run_distributed

ITERS = 4
# layers 0 and 2 linear, 1 and 3 softmax (with PP2 each stage holds one of each)
HYBRID = ["--num-layers", "4", "--seq-length", "64", "--linear-attention-freq", "2",
          "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
          "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
          "--attention-output-gate", "--apply-layernorm-1p", "--qk-layernorm",
          "--rotary-percent", "0.5", "--position-embedding-type", "rope",
          "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--group-query-attention",
          "--num-query-groups", "2"]
MOE = HYBRID + ["--num-experts", "4", "--moe-router-topk", "2",
                "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# name -> (world size, model flags, layout flags); one process runs each model's flags
LAYOUTS = {
    "tp2_sp": (2, HYBRID, TP2_SP),
    "pp2_1f1b": (2, HYBRID, PP2),
    "pp2_dualpipev": (2, HYBRID, PP2 + ["--pipeline-schedule", "dualpipev"]),
    "cp2_a2a": (2, HYBRID, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "dp2_zero3": (2, HYBRID, ["--zero-stage", "3"]),
    "moe_ep2_tp2_sp": (4, MOE, ["--expert-model-parallel-size", "2"] + TP2_SP),
    "recompute_full": (1, HYBRID, ["--recompute-granularity", "full"]),
}


def _argv(model, layout, metrics):
    from tests.pretrain_utils import TINY

    return [*TINY, "--train-iters", str(ITERS), "--metrics-file", str(metrics), *model, *layout]


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    from tests.pretrain_utils import pretrain_cases, run_main, single_process_refs

    d = tmp_path_factory.mktemp("linear_attention")
    for world in (2, 4):
        runs = [_argv(m, layout, d / f"{name}.jsonl")
                for name, (w, m, layout) in LAYOUTS.items() if w == world]
        assert all(run_distributed(pretrain_cases, world, runs, timeout=600))
    for name, (w, m, layout) in LAYOUTS.items():
        if w == 1:
            assert run_main(_argv(m, layout, d / f"{name}.jsonl")) == 0
    refs = single_process_refs((m for _w, m, _l in LAYOUTS.values()),
                               lambda m, out: _argv(m, [], out), d)
    return d, refs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_every_layout_equals_one_process(hybrid_runs, name):
    from tests.pretrain_utils import assert_same_run, read_metrics

    d, refs = hybrid_runs
    ref = read_metrics(refs[tuple(LAYOUTS[name][1])])
    assert_same_run(ref, read_metrics(d / f"{name}.jsonl"), ITERS, name=name)


@pytest.mark.parametrize("flags, needle", [
    (TP2_SP[:2] + ["--linear-num-key-heads", "3", "--linear-num-value-heads", "6"],
     "--linear-num-key-heads (3) must be divisible by --tensor-model-parallel-size (2)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p"], "--cp-comm-type p2p"),
    (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], "--cp-comm-type allgather"),
    (["--reset-attention-mask"], "--reset-attention-mask with --linear-attention-freq"),
    (["--linear-num-value-heads", "3"], "--linear-num-value-heads (3) must be a multiple"),
])
def test_what_linear_layers_cannot_run_is_refused_in_one_line(flags, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(HYBRID + flags)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# Parameters, FLOPs and activation memory of the linear layers (docs/theory.md, "Linear
# attention"), against a real model, torch's FLOP counter and measured saved tensors
# ------------------------------------------------------------------------------------------------
def _linear_config(**kw):
    from megalite.config import ModelConfig

    base = dict(num_layers=1, hidden_size=128, num_attention_heads=4, seq_length=128,
                linear_attention_freq="[1]", linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=32, normalization="RMSNorm",
                swiglu=True, position_embedding_type="rope")
    return ModelConfig(**{**base, **kw}).validate()


@pytest.mark.parametrize("model", [HYBRID, MOE], ids=["dense", "moe"])
def test_parameter_count_is_the_models(model):
    from megalite.models.gpt import GPTModel

    cfg = parse_args(["--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "384",
                      "--make-vocab-size-divisible-by", "128", *model]).model
    assert sum(p.numel() for p in GPTModel(cfg, seed=1).parameters()) == cfg.num_parameters()


def test_flops_are_what_torch_counts():
    """One Gated DeltaNet layer's forward under torch's FLOP counter: its matmuls and conv are
    2 FLOPs per weight and token (the conv's padding aside), the rule's batched matmuls are the
    count's c(4dk + 2dv) + 6dk·dv per token and head, the triangular solves (uncounted) the
    rest."""
    import dataclasses

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megalite.logging import attention_flops
    from megalite.models.linear_attention import CHUNK, GatedDeltaNet

    cfg, (s, H, dk, dv) = _linear_config(hidden_size=64), (128, 4, 16, 32)
    layer = GatedDeltaNet(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.02) if p.dim() > 1 else torch.nn.init.constant_(p, 0.5)
    with FlopCounterMode(display=False) as fc:
        layer(torch.randn(s, 1, 64))
    counts = {str(op).split(".")[-1]: n for op, n in fc.get_flop_counts()["Global"].items()}
    conv_padding = 2 * (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_kernel_dim * (
        2 * 2 * dk + H * dv)
    assert counts["mm"] + counts["convolution"] == 2 * cfg.linear_attention_weights() * s \
        + conv_padding
    solves = s * H * CHUNK * (dk + dv)
    assert counts["bmm"] + solves == attention_flops(cfg) / 3  # forward: a third
    # no s² term on linear layers: twice the sequence, twice their FLOPs (softmax: 4 times)
    linear = dataclasses.replace(parse_args(HYBRID).model, linear_attention_freq="[1,1,1,1]")
    softmax = dataclasses.replace(linear, linear_attention_freq=None)
    for model, growth in ((linear, 2), (softmax, 4)):
        longer = dataclasses.replace(model, seq_length=2 * model.seq_length)
        assert attention_flops(longer) == growth * attention_flops(model)


@pytest.mark.parametrize("dtype,s,kw", [
    ("float32", 128, {}), ("float32", 100, dict(linear_num_value_heads=6)),
    ("bfloat16", 128, {}), ("float32", 128, dict(linear_attention_freq="[0]",
                                                  attention_output_gate=True))],
    ids=["fp32", "fp32-padded-chunk", "bf16", "softmax-output-gate"])
def test_layer_activations_measured(dtype, s, kw):
    """What one linear-attention TransformerLayer (or a gated softmax one) saves for backward,
    measured (each storage once, parameters excluded), against layer_activation_bytes."""
    import torch

    from megalite.models.transformer import TransformerLayer
    from megalite.planner import Model, layer_activation_bytes
    from tests.test_planner import _load

    saved_bytes = _load("benchmarks", "activation_memory.py").saved_bytes
    cfg = _linear_config(params_dtype=dtype, seq_length=s, **kw)
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(s, 2, 128, dtype=getattr(torch, dtype), requires_grad=True)
    got = saved_bytes(layer.train(), x, False)
    want = layer_activation_bytes(Model.from_config(cfg, "cpu"), 2, 1, False)
    assert abs(got / want - 1) < 0.01, (got, want)


def test_pretrain_estimate_of_a_hybrid(tmp_path):
    """A hybrid run's logged planner estimate is within 10% of its measured peak."""
    from tests.test_planner import _pretrain_estimate

    est, got, _ = _pretrain_estimate(
        tmp_path, 1, "--micro-batch-size", "2", "--linear-attention-freq", "2",
        "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
        "--linear-key-head-dim", "32", "--linear-value-head-dim", "64",
        "--attention-output-gate", "--apply-layernorm-1p")
    assert abs(est / got - 1) < 0.10, (est, got)
