"""The hybrid linear-attention families through Hugging Face conversion (megalite/convert/hf.py):
Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (docs/models.md, "Hybrid families"), and the gated delta
rule (megalite/models/linear_attention.py) against a recurrence written here and HF's.

Each family is a tiny random HF model built here (3-4 layers, hidden 32; nothing is downloaded),
every parameter re-drawn with a large std so that a misplaced or transposed tensor moves the
logits far beyond the tolerance. Checked: logits and gradients against HF's, round trips to HF's
hub files and through megalite checkpoints at TP2 and PP2 bit for bit, the vision-language
wrapper's text model, Qwen's MTP layer (mtp.*) imported and exported, the refusals, and a
training run from --use-checkpoint-args alone.
"""

import copy
import dataclasses
import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from megalite.config import ConfigError
from megalite.convert import (
    from_hf,
    hf_config_to_model_config,
    hf_to_megalite_state_dict,
    megalite_to_hf_state_dict,
    to_hf,
)
from megalite.models import GPTModel
from megalite.models.linear_attention import gated_delta_rule, l2_normalize
from megalite.parallel_state import ParallelState
from test_convert_hf_moe import (  # the same VOCAB and SEQ
    assert_export_loads_as,
    assert_training_grads_match_hf,
    max_abs,
    tokens,
)

VOCAB, SEQ, TOL = 100, 16, 1e-4
LIN, FULL = "linear_attention", "full_attention"
BASE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_conv_kernel_dim=3, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, attn_implementation="sdpa",
            rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                             "partial_rotary_factor": 0.5})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)
# name -> (HF config class, HF model class, config, megalite's --linear-attention-freq). Between
# them: both in-projection forms, an interval and a list pattern, a softmax first layer (PP2's
# first stage), dense and MoE layers, tied and untied embeddings.
CASES = {
    # fused in_proj_qkvz / in_proj_ba; a dense first layer (mlp_only_layers), then MoE with the
    # sigmoid-gated shared expert; every third layer softmax
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(MOE, num_hidden_layers=3, layer_types=[LIN, LIN, FULL],
                        mlp_only_layers=[0]), "3"),
    # in_proj_qkv, _z, _b, _a; tied embeddings
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(num_hidden_layers=4, layer_types=[LIN, FULL, LIN, FULL],
                     tie_word_embeddings=True), "2"),
    # every layer MoE; a pattern no interval spells
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(MOE, num_hidden_layers=3, layer_types=[FULL, LIN, LIN]), "[0,1,1]"),
}


def make_hf(case: str, seed: int = 0, vocab: int = VOCAB):
    import transformers

    config_cls, model_cls, extra, _ = CASES[case]
    torch.manual_seed(seed)
    # a copy: HF's configs write their defaults into the rope_parameters dict they are given
    config = getattr(transformers, config_cls)(**copy.deepcopy({**BASE, "vocab_size": vocab,
                                                                **extra}))
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


# ---------------------------------------------------------------------------- the delta rule
def _rule_inputs(dtype, b=2, h=3, s=100, dk=8, dv=6):
    """Random q, k, v, g (<= 0), beta (in (0, 1)) as the layer makes them, each a leaf."""
    gen = torch.Generator().manual_seed(0)
    q, k = (l2_normalize(torch.randn(b, h, s, dk, generator=gen, dtype=dtype)) for _ in "qk")
    v = torch.randn(b, h, s, dv, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(b, h, s, generator=gen, dtype=dtype))
    beta = torch.randn(b, h, s, generator=gen, dtype=dtype).sigmoid()
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _value_and_grads(fn, inputs):
    """fn's output and the gradients of a fixed random projection of it w.r.t. every input."""
    out = fn(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return [out.detach()] + list(torch.autograd.grad((out * weight).sum(), inputs))


def _recurrence(q, k, v, g, beta):
    """The gated delta rule token by token: H_t = e^{g_t} H_{t-1} + k_t u_t^T with
    u_t = beta_t (v_t - e^{g_t} H_{t-1}^T k_t), o_t = H_t^T q_t."""
    state = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[2]):
        decay = g[:, :, t, None, None].exp()
        kt = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - (decay * state).transpose(-1, -2).matmul(
            kt.unsqueeze(-1)).squeeze(-1))
        state = decay * state + kt.unsqueeze(-1) * u.unsqueeze(-2)
        out.append(state.transpose(-1, -2).matmul(q[:, :, t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(out, 2)


def test_gated_delta_rule_equals_the_recurrence_in_fp64():
    """Two chunks of 64 (the second padded) and chunks of 16: forward and the gradients of q, k,
    v, g and beta equal the token-by-token rule at 1e-10."""
    inputs = _rule_inputs(torch.float64)
    want = _value_and_grads(_recurrence, inputs)
    for chunk in (64, 16):
        got = _value_and_grads(lambda *x: gated_delta_rule(*x, chunk=chunk), inputs)
        for name, a, b in zip(("out", "q", "k", "v", "g", "beta"), got, want):
            assert max_abs(a, b) <= 1e-10 * max(1.0, b.abs().max().item()), (chunk, name)


def test_gated_delta_rule_equals_hf_torch_chunk_rule_in_fp32():
    """HF's torch_chunk_gated_delta_rule (heads second-last, q scaled inside): forward and the
    gradients of q, k, v, g and beta at 1e-5."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    # HF's function dispatches to fla's kernel when fla is importable: here it is not, so HF runs
    # its torch path
    assert importlib.util.find_spec("fla") is None, \
        "fla is importable: HF's torch_chunk_gated_delta_rule would run fla's kernel"

    def hf(q, k, v, g, beta):
        heads_second_last = [t.transpose(1, 2) for t in (q, k, v, g, beta)]
        return torch_chunk_gated_delta_rule(*heads_second_last)[0].transpose(1, 2)

    inputs = _rule_inputs(torch.float32)
    want = _value_and_grads(hf, inputs)
    got = _value_and_grads(lambda q, *x: gated_delta_rule(q * q.shape[-1] ** -0.5, *x), inputs)
    for name, a, b in zip(("out", "q", "k", "v", "g", "beta"), got, want):
        assert max_abs(a, b) <= 1e-5 * max(1.0, b.abs().max().item()), name


# ------------------------------------------------------------------------------ HF's logits
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_match_hf(case):
    """Forward (eval) logits within 1e-4 of HF's, then the training loss and every gradient:
    HF's gradients, named as its parameters, go through the same conversion as the weights."""
    hf = make_hf(case)
    ml = from_hf(hf, make_vocab_size_divisible_by=8)
    c = ml.config
    assert (c.linear_attention_freq, c.attention_output_gate, c.apply_layernorm_1p,
            c.rotary_percent) == (CASES[case][3], True, True, 0.5)
    ids, labels = tokens(), tokens(seed=2)
    with torch.no_grad():
        ref, got = hf(ids).logits, ml(ids)
    assert ref.abs().max().item() > 1.0  # the comparison is not between near-zero logits
    assert max_abs(got, ref) <= TOL, case

    assert_training_grads_match_hf(ml, hf, ids, labels)


# ------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_and_export_are_bit_identical(case, tmp_path):
    """HF's hub files -> megalite -> HF: the same tensors bit for bit; to_hf's directory loads
    with AutoModelForCausalLM as its own class, with HF's config fields and state dict."""
    from safetensors.torch import load_file

    hf = make_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    hub = load_file(tmp_path / "hf" / "model.safetensors")
    cfg = hf_config_to_model_config(hf.config, make_vocab_size_divisible_by=8)
    ml_sd = hf_to_megalite_state_dict(hub, cfg)
    back = megalite_to_hf_state_dict(ml_sd, cfg)
    assert set(back) == set(hub) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    for k in back:
        assert back[k].dtype == hub[k].dtype and torch.equal(back[k], hub[k]), k
    GPTModel(cfg, ParallelState(), seed=None).load_state_dict(ml_sd, strict=True)

    out = to_hf(from_hf(tmp_path / "hf"), tmp_path / "export")
    assert_export_loads_as(out, hf)


@pytest.mark.parametrize("case", list(CASES))
def test_converter_round_trip_at_tp2_and_pp2_is_bit_identical(case, tmp_path):
    """tools/checkpoint/convert.py's hf-to-megalite, then megalite-to-hf, at TP2 (each rank holds
    one of the two key-head groups of every linear layer) and at PP2 cut after layer 0: the same
    tensors bit for bit."""
    from safetensors.torch import load_file

    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    hf = make_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    hub = load_file(tmp_path / "hf" / "model.safetensors")
    if hf.config.tie_word_embeddings:
        hub.pop("lm_head.weight", None)  # written by neither side when tied
    linear = next(i for i, t in enumerate(hf.config.layer_types) if t == LIN)
    in_proj = f"layers.{linear}.self_attention.in_proj.weight"
    for name, layout in (("tp2", Layout(2, 1)), ("pp2", Layout(1, 2, decoder_first=1))):
        ml, back = tmp_path / f"ml_{name}", tmp_path / f"back_{name}"
        ct.hf_to_megalite(str(tmp_path / "hf"), str(ml), layout)
        it = ml / "iter_0000000"
        shards = {d: torch.load(it / d / "model_optim_rng.pt", weights_only=True)["model"]
                  for d in sorted(p.name for p in it.iterdir() if p.is_dir())}
        if name == "tp2":
            a, b = shards["mp_rank_00_000"], shards["mp_rank_01_000"]
            assert a[in_proj].shape == b[in_proj].shape == (88 // 2, 32)  # one group each
            assert not torch.equal(a[in_proj], b[in_proj])
        ct.megalite_to_hf(str(ml), str(back))
        got = load_file(back / "model.safetensors")
        assert set(got) == set(hub), (name, set(got) ^ set(hub))
        for k in hub:
            assert got[k].dtype == hub[k].dtype and torch.equal(got[k], hub[k]), (name, k)


# --------------------------------------------------------- the wrapper form and the refusals
@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_5_moe"])
def test_the_vision_language_wrapper_imports_its_text_model(case, tmp_path):
    """Qwen3_5(Moe)ForConditionalGeneration's hub files: its vision tower is refused by name;
    without it, the language model (model.language_model.*, config under text_config) imports
    with the text model's logits, as does the text class's save of it, and exports as the text
    class."""
    import transformers
    from safetensors.torch import load_file, save_file

    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    text = make_hf(case)
    prefix = CASES[case][1].replace("ForCausalLM", "")
    config = getattr(transformers, prefix + "Config")(
        text_config=text.config.to_dict(), tie_word_embeddings=text.config.tie_word_embeddings,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=32))
    tied = config.tie_word_embeddings
    config.text_config.tie_word_embeddings = not tied  # HF's wrapper ties by its own field
    assert hf_config_to_model_config(config).tie_embeddings == tied
    config.text_config.tie_word_embeddings = tied  # (and HF's text class by text_config's)
    wrapper = getattr(transformers, prefix + "ForConditionalGeneration")(config)
    wrapper.model.language_model.load_state_dict(text.model.state_dict())
    wrapper.lm_head.load_state_dict(text.lm_head.state_dict())
    wrapper.save_pretrained(tmp_path / "vl")
    weights = tmp_path / "vl" / "model.safetensors"
    with pytest.raises(ConfigError, match=r"model\.visual\.\S+ is not supported: megalite imports"
                                          r" the text model"):
        from_hf(tmp_path / "vl")
    # HF's text class loads the wrapper's directory and saves the text model, its names kept
    getattr(transformers, CASES[case][1]).from_pretrained(tmp_path / "vl").save_pretrained(
        tmp_path / "text")
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("model.visual.")},
              weights, metadata={"format": "pt"})
    ids = tokens()
    for form in ("vl", "text"):
        ml = from_hf(tmp_path / form, make_vocab_size_divisible_by=8)
        assert ml.config.hf_architecture == CASES[case][1]
        with torch.no_grad():
            assert max_abs(ml(ids), text(ids).logits) <= TOL, form
    out = to_hf(ml, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["model_type"] == text.config.model_type
    # the converter reads the wrapper's tensors one at a time, by their text-model names
    ct.hf_to_megalite(str(tmp_path / "vl"), str(tmp_path / "ml"), Layout(1, 1))
    back = load_file(ct.megalite_to_hf(str(tmp_path / "ml"), str(tmp_path / "back"))
                     + "/model.safetensors")
    text.save_pretrained(tmp_path / "hub")
    want = load_file(tmp_path / "hub" / "model.safetensors")
    assert set(back) == set(want) and all(torch.equal(back[k], v) for k, v in want.items())


# ------------------------------------------------------------------- Qwen's MTP layer (mtp.*)
def qwen_mtp_hub(case: str, d):
    """(HF model with mtp_num_hidden_layers 1, its hub files plus Qwen's mtp.* as the released
    checkpoints hold them, those tensors). HF's classes build and save no MTP layer: its decoder
    layer takes the names and shapes of the main model's last (full-attention) layer, every
    tensor random."""
    from safetensors.torch import load_file, save_file

    hf = make_hf(case)
    hf.config.mtp_num_hidden_layers = 1
    hf.save_pretrained(d)
    sd = load_file(d / "model.safetensors")
    last, h = f"model.layers.{hf.config.num_hidden_layers - 1}.", hf.config.hidden_size
    shapes = {"mtp.layers.0." + k[len(last):]: v.shape for k, v in sd.items() if k.startswith(last)}
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    g = torch.Generator().manual_seed(3)
    mtp = {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}
    sd.update(mtp)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return hf, sd, mtp


@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_next"])
def test_qwen_mtp_imports_and_round_trips_bit_identically(case, tmp_path):
    """A Qwen3.5 (dense, tied) and a Qwen3-Next (MoE) hub directory with mtp.*: it imports with
    --mtp-num-layers 1, each tensor where models/mtp.py reads it (the decoder layer as the main
    model's last layer would import the same tensors), the main logits equal HF's, and to_hf
    gives back every hub tensor bit for bit with mtp_num_hidden_layers 1. Qwen3.5's VL wrapper
    form (mtp.* beside model.language_model.*) through the converter at TP2 gives back the
    same."""
    from safetensors.torch import load_file, save_file

    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    hf, sd, mtp = qwen_mtp_hub(case, tmp_path / "hf")
    ml = from_hf(tmp_path / "hf")
    assert ml.config.mtp_num_layers == 1 and ml.config.apply_layernorm_1p
    params = dict(ml.named_parameters())
    for name, hub in (("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"),
                      ("eh_proj", "fc"), ("final_layernorm", "norm")):
        assert torch.equal(params[f"mtp.layers.0.{name}.weight"], mtp[f"mtp.{hub}.weight"])
    last = ml.config.num_layers - 1
    main = {k: v for k, v in sd.items() if k not in mtp}
    main.update({k.replace("mtp.layers.0.", f"model.layers.{last}."): v for k, v in mtp.items()
                 if k.startswith("mtp.layers.")})
    as_last = hf_to_megalite_state_dict(main, dataclasses.replace(ml.config, mtp_num_layers=None))
    layer = {k[len("mtp.layers.0.transformer_layer."):]: v for k, v in ml.state_dict().items()
             if k.startswith("mtp.layers.0.transformer_layer.")}
    assert layer.keys() == {k[len(f"layers.{last}."):] for k in as_last
                            if k.startswith(f"layers.{last}.")}
    assert all(torch.equal(v, as_last[f"layers.{last}.{k}"]) for k, v in layer.items())
    with torch.no_grad():
        assert max_abs(ml(tokens()), hf(tokens()).logits) <= TOL

    tied = hf.config.tie_word_embeddings
    want = {k: v for k, v in sd.items() if k != "lm_head.weight" or not tied}
    out = to_hf(ml, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    forms = [load_file(out / "model.safetensors")]
    if case == "qwen3_5":
        import transformers

        vl = tmp_path / "vl"
        config = transformers.Qwen3_5Config(
            text_config=hf.config.to_dict(), tie_word_embeddings=hf.config.tie_word_embeddings,
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                               out_hidden_size=32))
        config.architectures = ["Qwen3_5ForConditionalGeneration"]
        config.save_pretrained(vl)
        save_file({k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()},
                  vl / "model.safetensors", metadata={"format": "pt"})
        ct.hf_to_megalite(str(vl), str(tmp_path / "ml"), Layout(2, 1))  # the depth split too
        forms.append(load_file(ct.megalite_to_hf(str(tmp_path / "ml"), str(tmp_path / "back"))
                               + "/model.safetensors"))
    for back in forms:
        assert set(back) == set(want), set(back) ^ set(want)
        assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in want.items())


def test_qwen_mtp_refusals_are_one_line(tmp_path):
    """More than one depth (Qwen's share one set of norms and fc); a last layer of linear
    attention, on import and on export. HF's own save (mtp_num_hidden_layers kept, no mtp.*
    tensor) imports without MTP."""
    from megalite.convert import model_config_to_hf_config

    hf = make_hf("qwen3_5")
    hf.config.mtp_num_hidden_layers = 2
    with pytest.raises(ConfigError, match="qwen3_5_text mtp_num_hidden_layers=2 is not "
                                          "supported: Qwen's depths share one set"):
        hf_config_to_model_config(hf.config)
    hf.config.mtp_num_hidden_layers = 1
    hf.save_pretrained(tmp_path / "hf")
    assert from_hf(tmp_path / "hf").config.mtp_num_layers is None
    moe = make_hf("qwen3_5_moe")  # its last layer is linear attention
    cfg = hf_config_to_model_config(moe.config)
    moe.config.mtp_num_hidden_layers = 1
    kind = "mtp_num_hidden_layers=1 with a last layer of kind linear_attention is not supported"
    with pytest.raises(ConfigError, match=kind):
        hf_config_to_model_config(moe.config)
    with pytest.raises(ConfigError, match="cannot be exported as Qwen3_5MoeForCausalLM, which it "
                                          "was imported from: qwen3_5_moe_text " + kind):
        model_config_to_hf_config(dataclasses.replace(cfg, mtp_num_layers=1))


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=[LIN, "sliding_attention", LIN, FULL]),
     r"qwen3_5_text layer_types \['sliding_attention'\] are not supported"),
    (dict(linear_num_value_heads=3), r"--linear-num-value-heads \(3\) must be a multiple"),
])
def test_hybrid_configs_megalite_cannot_hold_are_one_line_errors(change, match):
    import transformers

    kw = {**copy.deepcopy(BASE), **CASES["qwen3_5"][2], **change, "vocab_size": VOCAB}
    with pytest.raises(ConfigError, match=match):
        hf_config_to_model_config(transformers.Qwen3_5TextConfig(**kw))


def test_export_refuses_a_hybrid_model_as_a_softmax_family():
    """A Qwen3.5 model cannot leave as Qwen3 (no linear layers, no output gate); with no class
    recorded, the first family that holds it is Qwen3.5's (Qwen3-Next's has experts)."""
    from megalite.convert import model_config_to_hf_config

    cfg = hf_config_to_model_config(make_hf("qwen3_5").config)
    with pytest.raises(ConfigError, match="cannot be exported as Qwen3ForCausalLM, which it was "
                                          "imported from: it would read back as"):
        model_config_to_hf_config(dataclasses.replace(cfg, hf_architecture="Qwen3ForCausalLM"))
    cfg = dataclasses.replace(cfg, hf_architecture=None)
    assert model_config_to_hf_config(cfg).architectures == ["Qwen3_5ForCausalLM"]


# -------------------------------------------------------------------- training from the import
def test_imported_models_train_from_checkpoint_args_alone(tmp_path):
    """Each family imported by the converter trains 2 steps with --use-checkpoint-args and no
    other model flag, is saved and exported: from_pretrained loads it as its own class, the
    weights moved, and HF's logits are megalite's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout
    from pretrain_utils import flags, read_metrics, run_main

    ids = tokens()
    for case in CASES:
        hf = make_hf(case, vocab=300)  # pretrain_utils.TINY's vocabulary: NullTokenizer's ids
        hf.save_pretrained(tmp_path / f"{case}_hf")
        ct.hf_to_megalite(str(tmp_path / f"{case}_hf"), str(tmp_path / f"{case}_ml"),
                          Layout(1, 1))
        argv = flags("--load", tmp_path / f"{case}_ml", "--use-checkpoint-args",
                     "--tokenizer-type", "NullTokenizer", "--eval-iters", "0", "--save",
                     tmp_path / f"{case}_trained", train_iters=2,
                     metrics_file=tmp_path / f"{case}.jsonl")
        assert run_main(argv) == 0, case
        losses = [r["lm_loss"] for r in read_metrics(tmp_path / f"{case}.jsonl")]
        assert len(losses) == 2 and losses[0] != losses[1], case
        out = ct.megalite_to_hf(str(tmp_path / f"{case}_trained"), str(tmp_path / f"{case}_x"))
        loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert type(loaded).__name__ == CASES[case][1], case
        assert not info["missing_keys"] and not info["unexpected_keys"], (case, info)
        before = load_file(tmp_path / f"{case}_hf" / "model.safetensors")
        after = load_file(f"{out}/model.safetensors")
        assert set(after) == set(before), case
        assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
        with torch.no_grad():
            got = loaded.eval()(ids).logits
            assert max_abs(from_hf(loaded, make_vocab_size_divisible_by=8)(ids), got) <= TOL
