"""Hugging Face <-> megalite conversion (megalite/convert/hf.py).

Small random HF models are built locally (nothing is downloaded). Every parameter, norms and
biases included, is re-drawn with a large std so a misplaced or transposed tensor changes the
logits well beyond the 1e-4 tolerance.
"""

import pytest
import torch

from dist_utils import run_distributed

from megalite.config import ConfigError
from megalite.convert import (
    convert_layer_hf_to_megalite,
    from_hf,
    hf_config_to_model_config,
    hf_layer_keys,
    hf_to_megalite_state_dict,
    load_full_state_dict_into,
    megalite_to_hf_state_dict,
    to_hf,
)
from megalite.convert.hf import fuse_qkv, split_qkv
from megalite.models import GPTModel
from megalite.parallel_state import ParallelState, initialize_model_parallel

VOCAB, SEQ = 100, 16
TOL = 1e-4

# name -> (family, config overrides). Vocab 100 is not a multiple of 8 (nor of 16 at tp=2), so
# the padding of vocab tensors is exercised.
CASES = {
    "gpt2": ("gpt2", {}),
    "gpt2_untied": ("gpt2", {"tie_word_embeddings": False, "activation_function": "gelu"}),
    "llama_gqa": ("llama", {}),
    "llama_tied_bias_headdim": ("llama", {"tie_word_embeddings": True, "attention_bias": True,
                                          "mlp_bias": True, "head_dim": 8}),
    # Llama 3.1+: llama3 RoPE scaling, evaluated at SEQ = 4x its original context
    "llama3_scaled": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": SEQ // 4}}),
    # Qwen2: q/k/v bias only. Tied: a window (5 < SEQ) on layer 1 only (max_window_layers=1).
    # Untied: a sliding_window value with use_sliding_window false, as released configs have:
    # no window anywhere.
    "qwen2_tied_window": ("qwen2", {"tie_word_embeddings": True, "use_sliding_window": True,
                                    "sliding_window": 5, "max_window_layers": 1}),
    "qwen2_untied": ("qwen2", {"sliding_window": 5}),
    # Qwen3: per-head q/k RMSNorm, head_dim 12 != 32 / 8
    "qwen3_untied_headdim": ("qwen3", {"head_dim": 12}),
    # 6 heads do not divide h = 32: the head dim comes from head_dim (--kv-channels) alone
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True, "num_attention_heads": 6,
                             "num_key_value_heads": 3, "head_dim": 6}),
    "mistral_window": ("mistral", {"sliding_window": 5}),
    "mistral_tied_no_window": ("mistral", {"tie_word_embeddings": True, "sliding_window": None}),
}


def make_hf(case: str, seed: int = 0):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    family, extra = CASES[case]
    torch.manual_seed(seed)
    if family == "gpt2":
        kw = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                  eos_token_id=None, attn_implementation="sdpa")
        kw.update(extra)
        model = GPT2LMHeadModel(GPT2Config(**kw))
    else:
        kw = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=SEQ,
                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                  bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
        kw.update(extra)
        name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
        config = getattr(transformers, name + "Config")(**kw)
        model = getattr(transformers, name + "ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():  # tied weights are one Parameter: drawn once
            p.normal_(0.0, 0.3)
    return model.eval()


def tokens(seed: int = 1, b: int = 2):
    return torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def max_abs(a, b) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- logits parity
@pytest.mark.parametrize("case", list(CASES))
def test_from_hf_logits_match(case):
    hf = make_hf(case)
    ml = from_hf(hf, make_vocab_size_divisible_by=8)
    assert not ml.training
    assert ml.config.untie_embeddings_and_output_weights == (not hf.config.tie_word_embeddings)
    ids = tokens()
    with torch.no_grad():
        got = ml(ids)
    ref = hf_logits(hf, ids)
    assert ref.abs().max().item() > 1.0  # the comparison is not between near-zero logits
    assert max_abs(got, ref) <= TOL, case


@pytest.mark.parametrize("case, field", [("mistral_window", "sliding_window"),
                                         ("qwen2_tied_window", "sliding_window"),
                                         ("llama3_scaled", "rope_scaling_factor")])
def test_window_and_rope_scaling_change_the_logits(case, field):
    """The parity above is not vacuous: without the window or the scaling, logits differ."""
    hf = make_hf(case)
    assert getattr(from_hf(hf).config, field) is not None
    with torch.no_grad():
        assert max_abs(from_hf(hf, **{field: None})(tokens()), hf_logits(hf, tokens())) > 1e-2


def test_family_config_fields():
    qwen2 = hf_config_to_model_config(make_hf("qwen2_tied_window").config)
    assert (qwen2.sliding_window, qwen2.max_window_layers) == (5, 1)
    assert [qwen2.attention_window(i) for i in range(2)] == [None, 5]
    assert qwen2.add_qkv_bias and not qwen2.add_bias_linear and not qwen2.qk_layernorm
    old = make_hf("qwen2_tied_window").config
    old.layer_types = None  # as configs of transformers before layer_types: derived the same way
    assert hf_config_to_model_config(old).to_dict() == qwen2.to_dict()
    released = hf_config_to_model_config(make_hf("qwen2_untied").config)  # use_sliding_window false
    assert released.sliding_window is None and released.hf_architecture == "Qwen2ForCausalLM"
    qwen3 = hf_config_to_model_config(make_hf("qwen3_untied_headdim").config)
    assert qwen3.qk_layernorm and qwen3.kv_channels == 12 and not qwen3.add_qkv_bias
    mistral = hf_config_to_model_config(make_hf("mistral_window").config)
    assert [mistral.attention_window(i) for i in range(2)] == [5, 5]
    llama3 = hf_config_to_model_config(make_hf("llama3_scaled").config)
    assert (llama3.rope_scaling_factor, llama3.rope_low_freq_factor, llama3.rope_high_freq_factor,
            llama3.rope_original_max_position_embeddings) == (8.0, 1.0, 4.0, SEQ // 4)


def test_llama_config_fields():
    hf = make_hf("llama_tied_bias_headdim")
    cfg = hf_config_to_model_config(hf.config)
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.rotary_base) == (4, 8, 500.0)
    assert cfg.add_bias_linear and cfg.add_qkv_bias and cfg.swiglu and cfg.tie_embeddings
    assert cfg.normalization == "RMSNorm" and cfg.norm_epsilon == 1e-5
    gpt2 = hf_config_to_model_config(make_hf("gpt2").config)
    assert gpt2.activation == "gelu_tanh" and gpt2.position_embedding_type == "learned_absolute"


# ------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_identical(case):
    hf = make_hf(case)
    cfg = hf_config_to_model_config(hf.config, make_vocab_size_divisible_by=8)
    hf_sd = hf.state_dict()
    ml_sd = hf_to_megalite_state_dict(hf_sd, cfg)
    assert ml_sd["embedding.word_embeddings.weight"].shape[0] == cfg.padded_vocab_size(1) == 104
    assert ml_sd["embedding.word_embeddings.weight"][VOCAB:].abs().sum() == 0
    back = megalite_to_hf_state_dict(ml_sd, cfg)
    expected = set(hf_sd) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert set(back) == expected
    for k in expected:
        assert torch.equal(back[k], hf_sd[k]), k
    again = hf_to_megalite_state_dict(back, cfg)
    assert set(again) == set(ml_sd)
    for k in ml_sd:
        assert torch.equal(again[k], ml_sd[k]), k
    # the converted dict is exactly what GPTModel holds (strict load)
    model = GPTModel(cfg, ParallelState(), seed=None)
    model.load_state_dict(ml_sd, strict=True)


def test_per_layer_conversion_matches_whole_state_dict():
    hf = make_hf("llama_gqa")
    cfg = hf_config_to_model_config(hf.config)
    hf_sd = hf.state_dict()
    whole = hf_to_megalite_state_dict(hf_sd, cfg)
    only_layer_1 = {k: hf_sd[k] for k in hf_layer_keys(1, cfg)}
    layer = convert_layer_hf_to_megalite(1, only_layer_1, cfg)
    assert layer and all(k.startswith("layers.1.") for k in layer)
    for k, v in layer.items():
        assert torch.equal(v, whole[k]), k


def test_fused_qkv_is_laid_out_per_query_group():
    cfg = hf_config_to_model_config(make_hf("llama_gqa").config)  # 8 heads, 4 groups, d=4
    d, hpg = cfg.kv_channels, 2
    q = torch.arange(8 * d).float().unsqueeze(1)  # row r of q belongs to head r // d
    k = 1000 + torch.arange(4 * d).float().unsqueeze(1)
    v = 2000 + torch.arange(4 * d).float().unsqueeze(1)
    fused = fuse_qkv(q, k, v, cfg)
    block = (hpg + 2) * d
    group1 = fused[block:2 * block, 0]  # group 1: q heads 2, 3, then k head 1, then v head 1
    assert torch.equal(group1[: hpg * d], q[2 * d:4 * d, 0])
    assert torch.equal(group1[hpg * d:(hpg + 1) * d], k[d:2 * d, 0])
    assert torch.equal(group1[(hpg + 1) * d:], v[d:2 * d, 0])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, cfg), (q, k, v)))


# ------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("case", ["gpt2", "llama_gqa", "llama_tied_bias_headdim", "llama3_scaled",
                                  "qwen2_tied_window", "qwen3_untied_headdim",
                                  "mistral_tied_no_window"])
def test_to_hf_loads_with_auto_model(case, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = make_hf(case)
    ml = from_hf(hf)
    out = to_hf(ml, tmp_path / "export")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(loaded).__name__ == type(hf).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = tokens(seed=5)
    assert max_abs(hf_logits(loaded.eval(), ids), hf_logits(hf, ids)) <= TOL
    # and back again from the directory
    reloaded = from_hf(out)
    with torch.no_grad():
        assert max_abs(reloaded(ids), hf_logits(hf, ids)) <= TOL


def test_to_hf_writes_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<unk>": VOCAB - 2, "<eos>": VOCAB - 1})
    raw = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>")
    out = to_hf(from_hf(make_hf("gpt2")), tmp_path / "tok", tokenizer=tok)
    again = AutoTokenizer.from_pretrained(str(out))
    assert again("w3 w7")["input_ids"] == [3, 7]
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(out)).eos_token_id == VOCAB - 1


def test_to_hf_rejects_sharded_models():
    ml = from_hf(make_hf("gpt2"))
    ml.tp_size = 2  # as a TP rank's model reports itself
    with pytest.raises(ValueError, match="single-process"):
        to_hf(ml, "/nonexistent/never-written")


# ------------------------------------------------------------------------------- bad input
def test_unsupported_architecture_is_a_config_error():
    from transformers import BertConfig, GPT2Config, GPT2Model

    with pytest.raises(ConfigError, match=r"'BertForMaskedLM'.*GPT2LMHeadModel.*LlamaForCausalLM"):
        hf_config_to_model_config(BertConfig(architectures=["BertForMaskedLM"]))
    tiny = GPT2Model(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, n_positions=4,
                                bos_token_id=None, eos_token_id=None))
    with pytest.raises(ConfigError, match=r"'GPT2Model'.*GPT2LMHeadModel"):
        from_hf(tiny)


def test_unsupported_llama_variants_are_config_errors():
    from transformers import LlamaConfig

    base = dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)
    for rope_type, extra in [("dynamic", {"factor": 2.0}), ("linear", {"factor": 2.0})]:
        scaled = LlamaConfig(**base, rope_parameters={"rope_type": rope_type, "rope_theta": 5e5,
                                                      **extra})
        with pytest.raises(ConfigError, match=f"rope type '{rope_type}' is not supported"):
            hf_config_to_model_config(scaled)
    with pytest.raises(ConfigError, match="attention_bias"):
        hf_config_to_model_config(LlamaConfig(**base, attention_bias=True, mlp_bias=False))


def test_unsupported_family_options_are_config_errors():
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    base = dict(num_hidden_layers=3, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)
    with pytest.raises(ConfigError, match=r"qwen3 attention_bias=True .*o_proj"):
        hf_config_to_model_config(Qwen3Config(**base, attention_bias=True))
    gaps = ["sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(ConfigError, match=r"qwen2 layer_types window layers \[0, 2\]"):
        hf_config_to_model_config(Qwen2Config(**base, use_sliding_window=True, sliding_window=4,
                                              layer_types=gaps))
    with pytest.raises(ConfigError, match=r"layer_types \['chunked_attention'\]"):
        hf_config_to_model_config(Qwen3Config(**base, use_sliding_window=True, sliding_window=4,
                                              layer_types=["chunked_attention"] * 3))
    with pytest.raises(ConfigError, match="Mistral layer_types with full-attention layers"):
        hf_config_to_model_config(MistralConfig(**base, sliding_window=4, layer_types=gaps))


def test_export_refuses_models_no_hf_class_holds():
    from megalite.config import ModelConfig
    from megalite.convert.hf import hf_architecture

    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                 num_layers=2, hidden_size=32, num_attention_heads=4)
    assert hf_architecture(ModelConfig(**llama, add_bias_linear=False)) == "LlamaForCausalLM"
    assert hf_architecture(ModelConfig(**llama, add_bias_linear=False, add_qkv_bias=True)) \
        == "Qwen2ForCausalLM"
    assert hf_architecture(ModelConfig(**llama, add_bias_linear=False, sliding_window=8)) \
        == "MistralForCausalLM"
    with pytest.raises(ConfigError, match="no Hugging Face architecture holds"):
        hf_architecture(ModelConfig(**llama, add_bias_linear=False, add_qkv_bias=True,
                                    qk_layernorm=True))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no q/k norm, sliding window"):
        hf_architecture(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    sliding_window=8))
    with pytest.raises(ConfigError, match="cannot be exported as MistralForCausalLM"):
        hf_architecture(ModelConfig(**llama, add_bias_linear=False, sliding_window=8,
                                    max_window_layers=1, hf_architecture="MistralForCausalLM"))


def test_state_dict_with_unmapped_tensors_is_rejected():
    hf = make_hf("gpt2")
    cfg = hf_config_to_model_config(hf.config)
    sd = dict(hf.state_dict())
    sd["transformer.h.2.ln_1.weight"] = torch.ones(32)  # a third layer the config does not have
    with pytest.raises(ValueError, match=r"transformer\.h\.2\.ln_1\.weight"):
        hf_to_megalite_state_dict(sd, cfg)
    del sd["transformer.h.2.ln_1.weight"], sd["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match=r"missing tensor 'transformer\.h\.1\.mlp\.c_fc\.bias'"):
        hf_to_megalite_state_dict(sd, cfg)


# --------------------------------------------------------------------- tensor parallel, tp=2
def _tp2_worker(rank, world_size, case):
    hf = make_hf(case)  # same seed on every rank -> the same model
    ids = tokens(seed=3)
    ref = hf_logits(hf, ids)
    cfg = hf_config_to_model_config(hf.config, make_vocab_size_divisible_by=8)
    full = hf_to_megalite_state_dict(hf.state_dict(), cfg)  # padded to 104 rows; tp=2 needs 112
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    model = GPTModel(cfg, ps, seed=None).eval()
    load_full_state_dict_into(model, full, ps.tp_rank, ps.tp_size)
    local = model.embedding.word_embeddings.weight
    assert local.shape[0] == cfg.padded_vocab_size(2) // 2 == 56
    with torch.no_grad():
        got = model(ids)
    err = max_abs(got, ref)
    assert err <= TOL, f"{case} tp=2 rank {rank}: max-abs {err:.3e}"
    return err


@pytest.mark.parametrize("case", ["gpt2", "llama_gqa", "qwen3_untied_headdim"])
def test_tp2_converted_model_matches_hf(case):
    errs = run_distributed(_tp2_worker, 2, case, timeout=240)
    assert len(errs) == 2 and max(errs) <= TOL
