"""What multi-token prediction costs (docs/models.md, "Multi-token prediction"): MFU's FLOP count
grows by exactly the D depths' terms, written out by hand here, as does the planner's total; an
evaluation runs no depth and reports the main loss."""

import dataclasses

import torch

from test_mtp import DEEPSEEK


def test_flops_per_sequence_grow_by_the_depths_terms():
    """Per depth and token, forward: the last layer's kind (MLA projections 2·P_attn, an MoE
    layer: router, 2 routed experts, the shared expert), one more output head 2hV and eh_proj
    2·2h·h; x3 for the backward, x s tokens; plus its attention core 3·2·(qk + v)·s·s."""
    from megalite.config import ModelConfig
    from megalite.logging import attention_flops, document_attention, model_flops_per_sequence
    from megalite.planner import Model

    cfg = ModelConfig(**DEEPSEEK)
    h, s, V = 32, 16, 104  # V: 100 padded to a multiple of 8
    assert cfg.padded_vocab_size(1) == V
    # MLA: h·r_q + r_q·n·(d_n + d_r) + h·(r_kv + d_r) + r_kv·n·(d_n + d_v) + n·d_v·h
    p_attn = 32 * 12 + 12 * 4 * (8 + 4) + 32 * (16 + 4) + 16 * 4 * (8 + 6) + 4 * 6 * 32
    assert p_attn == cfg.attention_weights() == 3264
    swiglu_mlp = 2 * (h * 2 * 24 + 24 * h)  # width 24, as each expert and the shared expert
    layer = 2 * p_attn + 2 * h * 4 + 2 * swiglu_mlp + swiglu_mlp
    core = 3 * 2 * (4 * (8 + 4) + 4 * 6) * s * s  # q·k over d_n + d_r, scores·v over d_v
    depth = 3 * s * (layer + 2 * h * V + 2 * 2 * h * h) + core
    assert depth == 1615872
    base = model_flops_per_sequence(cfg, V)
    for d in (1, 2):
        mtp = dataclasses.replace(cfg, mtp_num_layers=d)
        assert model_flops_per_sequence(mtp, V) - base == d * depth
        assert attention_flops(mtp) - attention_flops(cfg) == d * core
        # packed documents (--reset-attention-mask): a document of 10 and one of 6 per sample,
        # causal pairs 10·11/2 + 6·7/2 per layer, the depths' layers too
        need = document_attention(mtp, [[10, 6]])[0] - document_attention(cfg, [[10, 6]])[0]
        assert need == d * 3 * 2 * (4 * (8 + 4) + 4 * 6) * (55 + 21)
        # the planner's TFLOP/s and MFU count the same total; its per-layer split stays the main
        # model's (the step time adds the depths itself: planner.mtp_layers)
        got, want = Model.from_config(mtp).flops(1), Model.from_config(cfg).flops(1)
        assert got["total"] == model_flops_per_sequence(mtp, V)
        assert {k: got[k] for k in ("logits", "layers", "attention")} == \
            {k: want[k] for k in ("logits", "layers", "attention")}


def test_evaluation_runs_no_mtp_depth_and_reports_the_main_loss():
    """A forward hook on every MTPLayer: training runs the depths (2 per micro-batch), the
    evaluation after it none; with --skip-train the validation loss with 2 depths equals the one
    without (parameters are seeded by name, so the main weights are the same)."""
    from megalite.arguments import parse_args
    from megalite.models.mtp import MTPLayer
    from megalite.training import pretrain
    from pretrain_utils import flags

    calls = []  # the module's training flag at each MTPLayer call

    def hook(module, args, out):
        if isinstance(module, MTPLayer):
            calls.append(module.training)

    def run(*extra, **kw):
        calls.clear()
        return pretrain(parse_args(flags("--position-embedding-type", "rope", *extra, **kw)))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        trained = run("--mtp-num-layers", "2", train_iters=1, eval_interval=1)
        assert calls == [True] * 2 * 4, calls  # 4 micro-batches of 2, then no call evaluating
        assert list(trained["valid"]) == [1]
        with_mtp = run("--mtp-num-layers", "2", "--skip-train")
        assert calls == []
        without = run("--skip-train")
    finally:
        handle.remove()
    assert with_mtp["valid"] == without["valid"] and len(without["valid"]) == 1
