"""The Qwen2 / Qwen3 / Mistral / Llama 3.1 model features (--qk-layernorm, --add-qkv-bias,
--kv-channels, --sliding-window, --rope-scaling-factor) under parallel layouts equal one process
(docs/design.md, contract 5), reusing the pipeline and ZeRO parity harnesses; and their flags.
"""

import pytest
import torch

from dist_utils import run_distributed
from model_utils import VOCAB, assert_grads_close, tiny_config
from test_pipeline import _parity_worker
from test_recompute import _run
from test_torch_compile import _explain, seeded_tracker  # noqa: F401  (a fixture)
from test_zero import (
    ITERS, assert_losses_close, assert_params_close, opt_config, reference_run, train)

from megalite.arguments import parse_args
from megalite.config import ConfigError, ExecutionConfig, ModelConfig
from megalite.logging import attention_flops, model_flops_per_sequence
from megalite.parallel_state import ParallelState, initialize_model_parallel
from megalite.planner import Model

# Qwen3-like: q/k norms, head dim 8 != 32 / 8 heads, a window of 6 < 16 tokens on layers >= 1,
# llama3 RoPE scaling with an original context of 4 (shorter than the sequence).
QWEN3 = ("llama", dict(qk_layernorm=True, kv_channels=8, sliding_window=6, max_window_layers=1,
                       rope_scaling_factor=8.0, rope_original_max_position_embeddings=4))
# name: (tp, pp, sp, schedule, layers, layers_per_virtual_stage, first, last, m, tied), as
# tests/test_pipeline.py. Without SP the q/k norm weights are the only parameters whose gradient
# is summed over TP: forgetting that sum fails tp2_pp2_1f1b (the TP ranks' copies diverge).
LAYOUTS = {
    "tp2_pp2_sp_1f1b_m4_tied": (2, 2, True, "1f1b", 4, None, None, None, 4, True),
    "tp2_pp2_1f1b_m2_untied": (2, 2, False, "1f1b", 4, None, None, None, 2, False),
}


def test_qwen3_tp2_sp_pp2_matches_single_device():
    # losses, gradients and trained weights are compared with one process inside the workers
    results = run_distributed(_parity_worker, 4, LAYOUTS, QWEN3, timeout=600)
    assert len(results) == 4 and all(set(r) == set(LAYOUTS) for r in results)


def _qwen2_dp2_zero1_worker(rank, world_size):
    cfg = tiny_config("llama", add_qkv_bias=True, sliding_window=6, max_window_layers=1,
                      untie_embeddings_and_output_weights=False)
    ref_losses, ref_params = reference_run(cfg, opt_config(), ITERS)
    ps = initialize_model_parallel(1, 1, backend="gloo", device="cpu", set_default=False)
    out = train(ps, cfg, opt_config(zero_stage=1), ITERS, micro_batches=2)
    assert_losses_close(out["losses"], ref_losses, 1e-4, "qwen2 dp=2 zero-1")
    assert_params_close(out["params"], ref_params, 1e-5, "qwen2 dp=2 zero-1")
    return out["losses"]


def test_qwen2_dp2_zero1_matches_single_process():
    losses = run_distributed(_qwen2_dp2_zero1_worker, 2)
    assert losses[0] == losses[1] and len(set(losses[0])) > 1


def _qwen3_zero3_tp2_dp2_worker(rank, world_size):
    from test_zero3 import _assert_parity, _build, _reference, _train

    cfg = tiny_config(QWEN3[0], **QWEN3[1])
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    model, opt = _build(cfg, ps)
    _assert_parity(_train(model, opt, ps, 4), _reference(cfg, iters=4), "qwen3 zero3 tp2 dp2")
    return True


def test_qwen3_zero3_tp2_dp2_matches_single_process():
    assert all(run_distributed(_qwen3_zero3_tp2_dp2_worker, 4, timeout=240))


@pytest.mark.parametrize("variant", [dict(recompute_granularity="selective"),
                                     dict(recompute_granularity="full", recompute_method="uniform",
                                          recompute_num_layers=1),
                                     dict(torch_compile="eager")])
def test_recompute_and_torch_compile_match_eager(variant):
    torch._dynamo.reset()
    tokens, labels = (torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(s))
                      for s in (1, 2))
    ref_loss, ref_grads = _run(tiny_config(QWEN3[0], **QWEN3[1]), ParallelState(), tokens, labels)
    loss, grads = _run(tiny_config(QWEN3[0], **QWEN3[1]), ParallelState(), tokens, labels,
                       ex=ExecutionConfig(**variant))
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert_grads_close(grads, ref_grads, 1e-5, str(variant))
    assert grads["layers.1.self_attention.q_layernorm.weight"].abs().sum() > 0


def test_windowed_qk_norm_layer_compiles_to_one_graph(seeded_tracker):  # noqa: F811
    ex = _explain(QWEN3[0], **dict(QWEN3[1], max_window_layers=0))  # layer 0 windowed
    assert ex.graph_break_count == 0, [str(b.reason)[:300] for b in ex.break_reasons]
    assert ex.graph_count == 1


# ------------------------------------------------------------------------------ flags and FLOPs
def test_family_flags_reach_the_model_config():
    m = parse_args(["--num-layers", "4", "--hidden-size", "30", "--num-attention-heads", "4",
                    "--kv-channels", "8", "--qk-layernorm", "--disable-bias-linear",
                    "--add-qkv-bias", "--sliding-window", "64", "--max-window-layers", "2",
                    "--position-embedding-type", "rope", "--rope-scaling-factor", "8",
                    "--rope-original-max-position-embeddings", "128"]).model
    assert (m.kv_channels, m.qk_layernorm, m.add_qkv_bias, m.add_bias_linear) == (8, True, True,
                                                                                  False)
    assert [m.attention_window(i) for i in range(4)] == [None, None, 64, 64]
    assert (m.rope_scaling_factor, m.rope_original_max_position_embeddings) == (8.0, 128)


@pytest.mark.parametrize("argv, match", [
    (["--hidden-size", "30", "--num-attention-heads", "4"], "or give the head dim with --kv-ch"),
    (["--rope-scaling-factor", "8"], "--rope-scaling-factor needs --position-embedding-type rope"),
    (["--sliding-window", "0"], "--sliding-window must be a positive integer"),
    (["--max-window-layers", "-1"], "--max-window-layers must be >= 0"),
])
def test_bad_family_flags_are_one_line_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)


def test_windowed_attention_flops_are_counted_by_the_window():
    full = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=256,
                       vocab_size=8192)  # FLOPs count the vocabulary: pinned, not defaulted
    half = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=256,
                       sliding_window=32, max_window_layers=2)
    assert attention_flops(full) == 3 * 4 * 64 * 4 * 256 * 256
    assert attention_flops(half) == 3 * 4 * 64 * (2 * 256 + 2 * 32) * 256
    assert (model_flops_per_sequence(full) - model_flops_per_sequence(half)
            == attention_flops(full) - attention_flops(half))
    # the planner's attention share (time and recompute cost) is the same count
    assert Model.from_config(half).flops(1)["attention"] == attention_flops(half)
