"""GPT-OSS through Hugging Face conversion (megalite/convert/hf.py; docs/models.md, "GPT-OSS:
conversion and MXFP4"): attention sinks, the clamped SwiGLU, alternating windowed and full layers,
YaRN without its rounding, the router's bias, biased experts stacked with gate and up
interleaved, and MXFP4 hub experts (megalite/convert/mxfp4.py).

A tiny random GptOssForCausalLM built here (2 layers: one windowed, one full; 4 experts, hidden
32; nothing is downloaded), every parameter re-drawn with a large std and a SwiGLU limit the
activations reach, so that a misplaced or transposed tensor or a setting left out moves the logits
far beyond the tolerance. Checked: logits and gradients against HF's, the round trip to HF's hub
files bit for bit (also through the converter at TP2 and PP2), the export loading as its own class
with the same config, MXFP4 dequantised as transformers does it (and a packed directory imported
with HF's logits), the refusals, and training from --use-checkpoint-args at EP2 x TP2 + SP (ETP 2)
and at CP2 (p2p and a2a) equal to one process.
"""

import copy
import dataclasses
import json

import pytest
import torch

from megalite.config import ConfigError
from megalite.convert import (
    from_hf,
    hf_config_to_model_config,
    hf_to_megalite_state_dict,
    megalite_to_hf_state_dict,
    model_config_to_hf_config,
    to_hf,
)
from megalite.convert.mxfp4 import dequantize_mxfp4
from megalite.models import GPTModel
from megalite.parallel_state import ParallelState
from test_convert_hf_moe import (  # the same VOCAB and SEQ
    assert_export_loads_as,
    assert_training_grads_match_hf,
    max_abs,
    tokens,
)

VOCAB, SEQ, TOL = 100, 16, 1e-4
# a window of 4 keys in layer 0 (layer 1 full: GPT-OSS's default layer_types), yarn with a
# fractional correction range (truncate false moves it), alpha off its default
CONFIG = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
              sliding_window=4, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
              swiglu_limit=0.5, swiglu_alpha=1.5, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, attn_implementation="eager",
              rope_parameters=dict(rope_type="yarn", rope_theta=500.0, factor=4.0,
                                   original_max_position_embeddings=4, beta_fast=6.0,
                                   beta_slow=0.7, truncate=False))
EXPERTS = ("gate_up_proj", "down_proj")


def make_hf(seed: int = 0, vocab: int = VOCAB, **change):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    # a copy: HF's configs write their defaults into the rope_parameters dict they are given
    config = GptOssConfig(**copy.deepcopy({**CONFIG, "vocab_size": vocab, **change}))
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def test_logits_and_gradients_match_hf():
    """The settings GPT-OSS maps to; forward (eval) logits within 1e-4 of HF's, and the training
    loss and every gradient (HF's converted like its weights). Truncating YaRN's range or dropping
    the clamp moves the logits: both are in play."""
    hf = make_hf()
    ml = from_hf(hf, make_vocab_size_divisible_by=8)
    c = ml.config
    assert (c.attention_sinks, c.swiglu_limit, c.swiglu_alpha, c.sliding_window,
            c.window_attn_skip_freq, c.rope_yarn_truncate, c.moe_router_linear_bias,
            c.add_bias_linear, c.add_qkv_bias, c.moe_router_pre_softmax) == (
        True, 0.5, 1.5, 4, 2, False, True, True, True, False)
    ids, labels = tokens(), tokens(seed=2)
    with torch.no_grad():
        ref, got = hf(ids).logits, ml(ids)
    assert ref.abs().max().item() > 1.0  # the comparison is not between near-zero logits
    assert max_abs(got, ref) <= TOL
    for change in (dict(rope_yarn_truncate=True), dict(swiglu_limit=None)):
        other = from_hf(hf, make_vocab_size_divisible_by=8, **change)
        with torch.no_grad():
            assert max_abs(other(ids), ref) > 100 * TOL, change

    assert_training_grads_match_hf(ml, hf, ids, labels)


def test_round_trip_and_export_are_bit_identical(tmp_path):
    """HF's hub files -> megalite -> HF: the same tensors bit for bit; to_hf's directory loads
    with AutoModelForCausalLM as GptOssForCausalLM with HF's config fields and state dict, and the
    export says in one warning that the experts are not MXFP4."""
    from safetensors.torch import load_file

    hf = make_hf()
    hf.save_pretrained(tmp_path / "hf")
    hub = load_file(tmp_path / "hf" / "model.safetensors")
    assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias",
            "model.layers.0.mlp.experts.gate_up_proj_bias"} <= set(hub)
    cfg = hf_config_to_model_config(hf.config, make_vocab_size_divisible_by=8)
    ml_sd = hf_to_megalite_state_dict(hub, cfg)
    gate_up, w1 = hub["model.layers.1.mlp.experts.gate_up_proj"], ml_sd["layers.1.mlp.weight1"]
    assert torch.equal(w1[..., :32], gate_up[..., ::2])  # gate columns first, then up
    back = megalite_to_hf_state_dict(ml_sd, cfg)
    assert set(back) == set(hub)
    for k in back:
        assert back[k].dtype == hub[k].dtype and torch.equal(back[k], hub[k]), k
    GPTModel(cfg, ParallelState(), seed=None).load_state_dict(ml_sd, strict=True)
    with pytest.warns(UserWarning, match="unquantised"):  # the class that holds it, unrecorded
        assert model_config_to_hf_config(dataclasses.replace(
            cfg, hf_architecture=None)).architectures == ["GptOssForCausalLM"]

    with pytest.warns(UserWarning, match=r"GptOssForCausalLM: the experts are written "
                                         r"unquantised \(float32\), not in MXFP4") as record:
        out = to_hf(from_hf(tmp_path / "hf"), tmp_path / "export")
    assert len(record) == 1
    assert_export_loads_as(out, hf)


def test_converter_round_trip_at_tp2_and_pp2_is_bit_identical(tmp_path):
    """tools/checkpoint/convert.py's hf-to-megalite, then megalite-to-hf, at TP2 (the sinks split
    by heads, the experts' fc1 bias with its columns) and at PP2 (one layer a stage): the same
    tensors bit for bit."""
    from safetensors.torch import load_file

    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    make_hf().save_pretrained(tmp_path / "hf")
    hub = load_file(tmp_path / "hf" / "model.safetensors")
    for name, layout in (("tp2", Layout(2, 1)), ("pp2", Layout(1, 2, decoder_first=1))):
        ml = ct.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / f"ml_{name}"), layout)
        if name == "tp2":
            shard = torch.load(f"{ml}/iter_0000000/mp_rank_01_000/model_optim_rng.pt",
                               weights_only=True)["model"]
            assert shard["layers.0.self_attention.sinks"].shape == (2,)
        with pytest.warns(UserWarning, match="unquantised"):
            back = ct.megalite_to_hf(ml, str(tmp_path / f"back_{name}"))
        got = load_file(f"{back}/model.safetensors")
        assert set(got) == set(hub), (name, set(got) ^ set(hub))
        for k in hub:
            assert got[k].dtype == hub[k].dtype and torch.equal(got[k], hub[k]), (name, k)


# ----------------------------------------------------------------------------------- MXFP4
def _packed(shape, seed):
    """Random MXFP4 blocks [*shape, 16] and scales [*shape] (factors 2^-7 .. 2^-3: weights the
    size of the std-0.3 ones)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, tuple(shape) + (16,), generator=gen, dtype=torch.uint8)
    return blocks, torch.randint(120, 125, tuple(shape), generator=gen, dtype=torch.uint8)


def test_mxfp4_dequantises_as_transformers():
    """Every byte value and a wide range of exponents (subnormal results included), to fp32 and
    bf16: equal to transformers' convert_moe_packed_tensors bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, _ = _packed((3, 40, 2), 0)
    scales = torch.arange(240, dtype=torch.uint8).reshape(3, 40, 2)  # 2^-127 .. 2^112
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and got.shape == (3, 64, 40) and torch.equal(got, want), dtype


def test_an_mxfp4_checkpoint_imports_dequantised(tmp_path):
    """A directory as OpenAI's hub files hold GPT-OSS (experts as *_blocks + *_scales, a
    quantization_config of quant_method mxfp4): from_hf has the logits of the HF model holding
    transformers' dequantised experts, and the converter (one tensor at a time) and the state-dict
    import read the same weights; the export writes them unquantised."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    hf = make_hf()
    hf.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    hub = load_file(weights)
    for i in range(2):
        for j, (name, shape) in enumerate(zip(EXPERTS, ((4, 64, 1), (4, 32, 1)))):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = _packed(shape, 2 * i + j)
            hub.update({key + "_blocks": blocks, key + "_scales": scales})
            dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            getattr(hf.model.layers[i].mlp.experts, name).data.copy_(dequantized)
            del hub[key]
    save_file(hub, weights, metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))

    ids = tokens()
    ml = from_hf(tmp_path / "hf", make_vocab_size_divisible_by=8)
    with torch.no_grad():
        assert max_abs(ml(ids), hf(ids).logits) <= TOL
    ckpt = ct.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ml"), Layout(1, 1))
    with pytest.warns(UserWarning, match="unquantised"):
        want = load_file(ct.megalite_to_hf(ckpt, str(tmp_path / "back")) + "/model.safetensors")
    sd = hf_to_megalite_state_dict(hub, ml.config)
    for k, v in hf.state_dict().items():
        assert torch.equal(want[k], v), k  # the converter's export: unquantised
        if k.startswith("model.layers.1.mlp.experts."):
            kind = "weight" if k.endswith("proj") else "bias"
            n = 1 if "gate_up" in k else 2
            assert torch.equal(sd[f"layers.1.mlp.{kind}{n}"], ml.state_dict()[
                f"layers.1.mlp.{kind}{n}"]), k


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["full_attention", "sliding_attention"]),
     r"gpt_oss layer_types \['full_attention', 'sliding_attention'\] \(sliding_window 4\) are "
     r"not supported: megalite makes every N-th layer full attention"),
    (dict(attention_bias=False), r"gpt_oss attention_bias=False with mlp_bias=True is not "
                                 r"supported: megalite needs both equal"),
    (dict(hidden_act="gelu"), r"gpt_oss hidden_act 'gelu' is not supported"),
    (dict(rope_parameters=dict(CONFIG["rope_parameters"], attention_factor=2.0)),
     r"yarn rope_parameters attention_factor is not supported"),
])
def test_configs_megalite_cannot_hold_are_one_line_errors(change, match):
    from transformers import GptOssConfig

    config = GptOssConfig(**copy.deepcopy({**CONFIG, "vocab_size": VOCAB, **change}))
    with pytest.raises(ConfigError, match=match) as e:
        hf_config_to_model_config(config)
    assert "\n" not in str(e.value)


def test_window_patterns_every_nth_layer_full():
    """HF's layer_types as --window-attn-skip-freq: every layer windowed (none), every third
    full; all full attention without a window is no window; each read back the same."""
    from transformers import GptOssConfig

    s, f = "sliding_attention", "full_attention"
    for types, window, want in (([s, s, s], 4, (4, None)), ([s, s, f, s], 4, (4, 3)),
                                ([f, f], None, (None, None))):
        cfg = hf_config_to_model_config(GptOssConfig(**copy.deepcopy(
            {**CONFIG, "vocab_size": VOCAB, "num_hidden_layers": len(types),
             "layer_types": types, "sliding_window": window})))
        assert (cfg.sliding_window, cfg.window_attn_skip_freq) == want, types
        with pytest.warns(UserWarning, match="unquantised"):
            assert model_config_to_hf_config(cfg).layer_types == types


# -------------------------------------------------------- training in parallel = one process
def test_imported_model_trains_in_parallel_as_one_process(tmp_path):
    """The converter's import trained 2 steps by pretrain.py with --use-checkpoint-args and no
    model flag, in one world of four processes: EP2 x TP2 + SP with ETP 2 (the experts' biases
    split with their columns, the router's bias a partial sum over TP), then CP2 with p2p and
    with a2a (the window and the sinks under CP; DP2 beside it): each run's losses and grad norms
    equal one process's (1e-5)."""
    from dist_utils import run_distributed
    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout
    from pretrain_utils import assert_same_run, flags, pretrain_cases, read_metrics, run_main

    hf = make_hf(vocab=300)  # pretrain_utils.TINY's vocabulary: NullTokenizer's ids
    hf.save_pretrained(tmp_path / "hf")
    ckpt = ct.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ml"), Layout(1, 1))

    def argv(name, *layout):
        return flags("--load", ckpt, "--use-checkpoint-args", "--tokenizer-type",
                     "NullTokenizer", "--eval-iters", "0", *layout, train_iters=2,
                     metrics_file=tmp_path / f"{name}.jsonl")

    layouts = {"ep2_tp2_etp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--expert-model-parallel-size", "2",
                                "--expert-tensor-parallel-size", "2"],
               "cp2_p2p": ["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
               "cp2_a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]}
    assert all(run_distributed(pretrain_cases, 4, [argv(n, *x) for n, x in layouts.items()],
                               timeout=300))
    assert run_main(argv("one")) == 0
    ref = read_metrics(tmp_path / "one.jsonl")
    assert ref[0]["lm_loss"] != ref[1]["lm_loss"]  # the model trains
    for name in layouts:
        assert_same_run(ref, read_metrics(tmp_path / f"{name}.jsonl"), 2, name=name)
