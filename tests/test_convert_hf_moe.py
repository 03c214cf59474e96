"""The mixture-of-experts families through Hugging Face conversion (megalite/convert/hf.py):
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and GLM-4.5 (docs/models.md).

Each family is a tiny random HF model built here (3 layers, 4-8 experts, hidden 32; nothing is
downloaded), every parameter and the GLM correction bias re-drawn with a large std so that a
misplaced, transposed or dropped tensor moves the logits far beyond the tolerance. Checked: logits
and the loss's gradients against HF's, the round trip to HF's hub files bit for bit, the export
loading as its own class with the same config, the layer-pattern mapping, every refusal, and one
world of two processes where imported models train at EP2 and at TP2+SP x EP2 with one process's
losses and grad norms.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from megalite.config import ConfigError, ModelConfig
from megalite.convert import (
    from_hf,
    hf_config_to_model_config,
    hf_to_megalite_state_dict,
    megalite_to_hf_state_dict,
    model_config_to_hf_config,
    to_hf,
)
from megalite.convert.hf import _hf_moe_pattern, _hf_pattern_fields, hf_architecture
from megalite.models import GPTModel
from megalite.parallel_state import ParallelState

VOCAB, SEQ, TOL = 100, 16, 1e-4
BASE = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=SEQ, rms_norm_eps=1e-5, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, attn_implementation="sdpa",
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})
GLM = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
           intermediate_size=48, num_nextn_predict_layers=0)
DEEPSEEK = dict(GLM, num_key_value_heads=4, rms_norm_eps=1e-6, n_group=4, topk_group=2,
                first_k_dense_replace=1, routed_scaling_factor=2.5, n_shared_experts=1,
                q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6, rope_parameters=dict(
                    BASE["rope_parameters"], rope_type="yarn", factor=4.0,
                    original_max_position_embeddings=4, beta_fast=8.0, beta_slow=0.5, mscale=0.8,
                    mscale_all_dim=0.6))
# name -> (HF class prefix, config). Between them: every routing rule, each layer pattern, the
# shared experts, both q/k norms, the biases, partial RoPE, tied and untied embeddings.
CASES = {
    # softmax top-2, renormalised (megalite: a softmax over the chosen logits); all layers MoE
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                                head_dim=8)),
    # decoder_sparse_step 2: only layer 1 is MoE ((i + 1) % 2 == 0), layers 0 and 2 dense and
    # wider; a sigmoid-gated shared expert; q/k/v bias; the plain top-k of the softmax
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=40, intermediate_size=48,
                                   decoder_sparse_step=2)),
    # mlp_only_layers [0]; per-head q/k norm; renormalised gates over 8 experts; tied
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                   intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0],
                                   tie_word_embeddings=True)),
    # q/k norm over the whole projections
    "olmoe": ("Olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    # one dense first layer of its own width; sigmoid scores, the correction bias, 4 groups scored
    # by their top-2 of which 2 are kept, gates renormalised and scaled by 2.5; two shared experts;
    # partial RoPE; q/k/v bias; per-head q/k norm
    "glm4_moe": ("Glm4Moe", dict(GLM, n_group=4, topk_group=2, first_k_dense_replace=1,
                                 attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5,
                                 n_shared_experts=2, rope_parameters=dict(
                                     BASE["rope_parameters"], partial_rotary_factor=0.5))),
    # sigmoid gates kept raw (norm_topk_prob false), no groups, two dense layers
    "glm4_moe_raw_gates": ("Glm4Moe", dict(GLM, norm_topk_prob=False, first_k_dense_replace=2)),
    # multi-latent attention with a q latent and interleaved RoPE rows, YaRN (frequencies, cos/sin
    # factor, DeepSeek's softmax factor); GLM-4.5's routing with one shared expert
    "deepseek_v3": ("DeepseekV3", DEEPSEEK),
}


def make_hf(case: str, seed: int = 0, vocab: int = VOCAB):
    import transformers

    prefix, extra = CASES[case]
    torch.manual_seed(seed)
    # a copy: HF's configs write their defaults into the rope_parameters dict they are given
    config = getattr(transformers, prefix + "Config")(
        **copy.deepcopy({**BASE, "vocab_size": vocab, **extra}))
    model = getattr(transformers, prefix + "ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, but it steers the choice
                b.normal_(0.0, 0.3)
    return model.eval()


def tokens(seed: int = 1, b: int = 2):
    return torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(seed))


def max_abs(a, b) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return (a - b).abs().max().item()


def assert_export_loads_as(out, hf):
    """HF's AutoModelForCausalLM loads the exported directory ``out`` as ``hf``'s own class,
    every key found, with ``hf``'s tensors bit for bit and its config fields."""
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(loaded) is type(hf)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref, got = hf.state_dict(), loaded.state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    a, b = hf.config.to_dict(), loaded.config.to_dict()
    differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert differ <= {"_name_or_path", "architectures", "dtype"}, {k: (a.get(k), b.get(k))
                                                                   for k in differ}


def assert_training_grads_match_hf(ml, hf, ids, labels):
    """The mean token loss and every parameter's gradient equal HF's (train mode): HF's
    gradients, named as its parameters, go through the same conversion as the weights."""
    loss = ml.train()(ids, labels).mean()
    loss.backward()
    hf_loss = F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten())
    hf_loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= TOL
    grads = {n: p.grad for n, p in hf.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in hf.named_buffers()
                  if n.endswith("e_score_correction_bias")})  # not trained by gradient
    want = hf_to_megalite_state_dict(grads, ml.config)
    for name, p in ml.named_parameters():
        scale = max(want[name].norm().item(), 1e-6)
        assert p.grad is not None and max_abs(p.grad, want[name]) <= 1e-4 * scale, name


# ------------------------------------------------------------------- logits and gradients vs HF
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_match_hf(case):
    """Forward (eval) logits within 1e-4 of HF's, then the training loss and every gradient:
    HF's gradients, named as its parameters, go through the same conversion as the weights."""
    hf = make_hf(case)
    ml = from_hf(hf, make_vocab_size_divisible_by=8)
    ids = tokens()
    with torch.no_grad():
        ref = hf(ids).logits
        got = ml(ids)
    assert ref.abs().max().item() > 1.0  # the comparison is not between near-zero logits
    assert max_abs(got, ref) <= TOL, case

    assert_training_grads_match_hf(ml, hf, ids, tokens(seed=2))
    moe = [m for m in ml.modules() if type(m).__name__ == "MoELayer"]
    assert moe and all(m.router.grad.abs().sum() > 0 for m in moe)  # the router learns


def test_group_rule_and_raw_sigmoid_gates_change_the_logits():
    """The parity above is not vacuous: Megatron's group score, or renormalised sigmoid gates,
    give other logits than HF's GLM-4.5 rules."""
    ids = tokens()
    for case, field, other in [("glm4_moe", "moe_router_group_score", "topk_sum"),
                               ("glm4_moe_raw_gates", "moe_router_norm_topk_prob", True)]:
        hf = make_hf(case)
        assert getattr(from_hf(hf).config, field) != other
        with torch.no_grad():
            assert max_abs(from_hf(hf, **{field: other})(ids), hf(ids).logits) > 1e-2, case


# ------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_and_export_are_bit_identical(case, tmp_path):
    """HF's hub files (per-expert tensors, as save_pretrained writes them) -> megalite -> HF: the
    same tensors bit for bit; the in-memory stacked experts read the same. Then to_hf's directory
    loads with AutoModelForCausalLM as its own class, with HF's config fields and state dict."""
    from safetensors.torch import load_file

    hf = make_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    hub = load_file(tmp_path / "hf" / "model.safetensors")
    cfg = hf_config_to_model_config(hf.config, make_vocab_size_divisible_by=8)
    ml_sd = hf_to_megalite_state_dict(hub, cfg)
    stacked = hf_to_megalite_state_dict(hf.state_dict(), cfg)
    assert set(stacked) == set(ml_sd) and all(torch.equal(stacked[k], ml_sd[k]) for k in ml_sd)
    back = megalite_to_hf_state_dict(ml_sd, cfg)
    assert set(back) == set(hub) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    for k in back:
        assert back[k].dtype == hub[k].dtype and torch.equal(back[k], hub[k]), k
    GPTModel(cfg, ParallelState(), seed=None).load_state_dict(ml_sd, strict=True)

    out = to_hf(from_hf(tmp_path / "hf"), tmp_path / "export")  # from the directory, this time
    assert_export_loads_as(out, hf)


def cfg_experts(c) -> int:
    return next(getattr(c, n) for n in ("num_local_experts", "num_experts", "n_routed_experts")
                if getattr(c, n, None))


# Every family but Mixtral and OLMoE (all layers MoE) has a dense layer 0: a PP2 cut after it
# leaves the first stage without experts.
DENSE_FIRST = {"qwen2_moe", "qwen3_moe", "glm4_moe", "glm4_moe_raw_gates", "deepseek_v3"}


@pytest.mark.parametrize("case", list(CASES))
def test_converter_round_trip_at_tp2_and_pp2_is_bit_identical(case, tmp_path):
    """tools/checkpoint/convert.py's hf-to-megalite, then megalite-to-hf, from HF's hub files:
    at TP2 (what a TP2 x EP2 run loads: a checkpoint holds every expert by its global index,
    whatever the EP) and at PP2 cut after layer 0 (a dense first stage where the family has
    one), the same tensors bit for bit."""
    from safetensors.torch import load_file

    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    hf = make_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    hub = load_file(tmp_path / "hf" / "model.safetensors")
    if hf.config.tie_word_embeddings:
        hub.pop("lm_head.weight", None)  # written by neither side when tied
    for name, layout in (("tp2", Layout(2, 1)), ("pp2", Layout(1, 2, decoder_first=1))):
        ml, back = tmp_path / f"ml_{name}", tmp_path / f"back_{name}"
        ct.hf_to_megalite(str(tmp_path / "hf"), str(ml), layout)
        it = ml / "iter_0000000"
        shards = {d: torch.load(it / d / "model_optim_rng.pt", weights_only=True)["model"]
                  for d in sorted(p.name for p in it.iterdir() if p.is_dir())}
        experts = {d: [k for k in sd if ".mlp.weight" in k] for d, sd in shards.items()}
        if name == "tp2":
            a, b = shards["mp_rank_00_000"], shards["mp_rank_01_000"]
            attn = "layers.0.self_attention.linear_proj.weight"
            assert a[attn].shape[1] * 2 == hub["model.layers.0.self_attn.o_proj.weight"].shape[1]
            assert experts["mp_rank_00_000"] and all(  # every expert, by its global index
                a[k].shape[0] == cfg_experts(hf.config)
                for k in experts["mp_rank_00_000"])
        else:
            assert experts["mp_rank_00_001"]
            assert (experts["mp_rank_00_000"] == []) == (case in DENSE_FIRST), experts
        ct.megalite_to_hf(str(ml), str(back))
        got = load_file(back / "model.safetensors")
        assert set(got) == set(hub), (name, set(got) ^ set(hub))
        for k in hub:
            assert got[k].dtype == hub[k].dtype and torch.equal(got[k], hub[k]), (name, k)


# ------------------------------------------------------------------------- the layer pattern
@pytest.mark.parametrize("hf_fields, freq", [
    (dict(decoder_sparse_step=1, mlp_only_layers=[]), "1"),
    (dict(decoder_sparse_step=2, mlp_only_layers=[]), "[0,1,0,1]"),  # Megatron's 2 is [1,0,1,0]
    (dict(decoder_sparse_step=1, mlp_only_layers=[0, 3]), "[0,1,1,0]"),
    (dict(decoder_sparse_step=2, mlp_only_layers=[1]), "[0,0,0,1]"),
    (dict(first_k_dense_replace=1), "[0,1,1,1]"),
])
def test_hf_sparse_layers_map_through_the_list_pattern(hf_fields, freq):
    from types import SimpleNamespace

    from megalite.convert.hf import DEEPSEEK_MOE, FAMILIES, layer_freq_text

    m = DEEPSEEK_MOE if "first_k_dense_replace" in hf_fields else FAMILIES["qwen3_moe"].moe
    c = SimpleNamespace(num_hidden_layers=4, **hf_fields)
    pattern = _hf_moe_pattern(c, m)
    assert layer_freq_text(pattern) == freq
    assert ModelConfig(num_layers=4, num_experts=4, moe_layer_freq=freq).moe_layer_pattern() \
        == pattern
    back = SimpleNamespace(num_hidden_layers=4, **_hf_pattern_fields(pattern, m, "X", freq))
    assert _hf_moe_pattern(back, m) == pattern  # the export spells the same layers


# ------------------------------------------------------------------------------- export choice
def _llama_moe(**kw):
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_experts=4,
                       moe_router_topk=2, position_embedding_type="rope", normalization="RMSNorm",
                       swiglu=True, add_bias_linear=False, **kw)


def test_a_model_trained_here_exports_as_the_first_family_that_holds_it():
    assert hf_architecture(_llama_moe()) == "MixtralForCausalLM"
    assert hf_architecture(_llama_moe(moe_shared_expert_intermediate_size=16,
                                      moe_shared_expert_gate=True)) == "Qwen2MoeForCausalLM"
    assert hf_architecture(_llama_moe(moe_layer_freq="[0,1]", qk_layernorm=True)) \
        == "Qwen3MoeForCausalLM"
    assert hf_architecture(_llama_moe(qk_layernorm=True, qk_layernorm_scope="projection")) \
        == "OlmoeForCausalLM"
    glm = _llama_moe(moe_layer_freq="[0,1]", moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=48,
                     moe_ffn_hidden_size=24, rotary_percent=0.5)
    assert hf_architecture(glm) == "Glm4MoeForCausalLM"
    assert model_config_to_hf_config(glm).n_shared_experts == 2


@pytest.mark.parametrize("kw, match", [
    # sigmoid routing without the correction bias: GLM-4.5 always has one
    (dict(moe_router_score_function="sigmoid"), "no Hugging Face architecture holds"),
    # a softmax router and a dense first layer, but no family has per-projection q/k norms there
    (dict(moe_layer_freq="[0,1]", qk_layernorm=True, qk_layernorm_scope="projection"),
     "OlmoeForCausalLM makes every layer MoE"),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
          moe_shared_expert_intermediate_size=20, moe_ffn_hidden_size=8),
     "not a multiple of --moe-ffn-hidden-size 8"),
])
def test_export_refuses_models_no_moe_family_holds(kw, match):
    with pytest.raises(ConfigError, match=match):
        hf_architecture(_llama_moe(**kw))


def test_export_refuses_a_change_the_recorded_class_cannot_hold():
    cfg = hf_config_to_model_config(make_hf("glm4_moe").config)
    cfg.moe_layer_freq = "[1,0,1]"  # dense in the middle: not first_k_dense_replace
    with pytest.raises(ConfigError, match="cannot be exported as Glm4MoeForCausalLM, which it was "
                                          "imported from: .*first_k_dense_replace"):
        hf_architecture(cfg)


# -------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("case, change, match", [
    ("mixtral", dict(router_jitter_noise=0.1), "mixtral router_jitter_noise=0.1 is not supp"),
    ("olmoe", dict(clip_qkv=8.0), "olmoe clip_qkv=8.0 is not supported"),
    ("qwen2_moe", dict(use_sliding_window=True), "qwen2_moe use_sliding_window=True"),
    ("qwen3_moe", dict(attention_bias=True), r"qwen3_moe attention_bias=True .*o_proj"),
    ("olmoe", dict(head_dim=4), "olmoe head_dim=4 must be hidden_size / num_attention_heads"),
    ("qwen3_moe", dict(rope_parameters=dict(BASE["rope_parameters"], partial_rotary_factor=0.5)),
     "qwen3_moe partial_rotary_factor=0.5 is not supported"),
    ("glm4_moe", dict(n_shared_experts=0), "glm4_moe n_shared_experts=0 is not supported"),
    ("glm4_moe", dict(num_experts_per_tok=1), "num_experts_per_tok=1 with norm_topk_prob"),
    ("qwen3_moe", dict(num_experts=0), "qwen3_moe num_experts=0"),
    ("deepseek_v3", dict(rope_interleave=False), "deepseek_v3 rope_interleave=False is not "),
    ("deepseek_v3", dict(attention_bias=True), "deepseek_v3 attention_bias=True is not supp"),
    ("deepseek_v3", dict(num_key_value_heads=2), "must equal num_attention_heads"),
    ("deepseek_v3", dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 is not supported"),
    ("deepseek_v3", dict(rope_parameters=dict(DEEPSEEK["rope_parameters"], attention_factor=1.5)),
     "yarn rope_parameters attention_factor is not supported"),
    ("deepseek_v3", dict(rope_parameters=dict(DEEPSEEK["rope_parameters"], mscale=None)),
     "yarn mscale_all_dim=0.6 without mscale is not supported"),
    ("deepseek_v3", dict(rope_parameters=dict(DEEPSEEK["rope_parameters"], rope_type="dynamic")),
     "rope type 'dynamic' is not supported"),
])
def test_unsupported_hf_fields_are_one_line_errors(case, change, match):
    import transformers

    prefix, extra = CASES[case]
    config = getattr(transformers, prefix + "Config")(
        **copy.deepcopy({**BASE, "vocab_size": VOCAB, **extra}))
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(ConfigError, match=match) as e:
        hf_config_to_model_config(config)
    assert "\n" not in str(e.value)


def _refused_configs():
    from transformers import DeepseekV3Config, Llama4Config, Llama4TextConfig

    fp8 = DeepseekV3Config(**copy.deepcopy({**BASE, "vocab_size": VOCAB, **DEEPSEEK}))
    fp8.quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
                               "weight_block_size": [128, 128]}  # as DeepSeek-V3's hub files
    return [(Llama4TextConfig(), r"llama4_text is not supported: its chunked attention "
                                 r"\(attention_chunk_size=8192\) and NoPE layers \(no_rope_layers"),
            (Llama4Config(), r"llama4 is not supported: its chunked attention"),
            (fp8, r"deepseek_v3 quantization_config \(quant_method 'fp8'\) is not supported")]


def test_families_megalite_cannot_hold_are_refused_by_the_field(tmp_path):
    """Llama 4 (chunked attention, NoPE layers) and FP8 hub weights: one line naming the field,
    from a config, from a directory's config.json (the converter's reader, before any weight is
    read), and FP8 from its weight_scale_inv tensors alone."""
    from safetensors.torch import save_file

    from megalite.checkpoint import convert as ct

    for i, (config, match) in enumerate(_refused_configs()):
        with pytest.raises(ConfigError, match=match) as e:
            hf_config_to_model_config(config)
        assert "\n" not in str(e.value)
        config.save_pretrained(tmp_path / str(i))  # config.json only: no weights needed
        with pytest.raises(ConfigError, match=match):
            ct.HFSource(str(tmp_path / str(i)))
    hf = make_hf("deepseek_v3")
    sd = dict(hf.state_dict())
    scale = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"
    sd[scale] = torch.ones(1, 1)
    fp8 = rf"FP8 weights \({scale}\) are not supported"
    with pytest.raises(ConfigError, match=fp8):
        hf_to_megalite_state_dict(sd, hf_config_to_model_config(hf.config))
    hf.save_pretrained(tmp_path / "fp8")
    save_file({scale: torch.ones(1, 1)}, tmp_path / "fp8" / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=fp8):
        ct.HFSource(str(tmp_path / "fp8"))


@pytest.mark.parametrize("kw, match", [
    (dict(moe_router_norm_topk_prob=False), "--no-moe-router-norm-topk-prob needs "
                                            "--moe-router-score-function sigmoid"),
    (dict(qk_layernorm_scope="projection"), "--qk-layernorm-scope projection needs "
                                            "--qk-layernorm"),
    (dict(rotary_percent=0.3), "--rotary-percent must be in"),  # 3 of 10 dims: not pairs
    (dict(rotary_percent=1.5), "--rotary-percent must be in"),
])
def test_new_flags_are_checked(kw, match):
    with pytest.raises(ConfigError, match=match):
        _llama_moe(kv_channels=10, **kw).validate()


def test_new_flags_reach_the_model_config():
    from megalite.arguments import parse_args

    m = parse_args(["--rotary-percent", "0.5", "--qk-layernorm", "--qk-layernorm-scope",
                    "projection", "--num-experts", "4", "--moe-router-score-function", "sigmoid",
                    "--no-moe-router-norm-topk-prob", "--position-embedding-type", "rope"]).model
    assert (m.rotary_percent, m.rotary_dim, m.qk_layernorm_scope) == (0.5, 32, "projection")
    assert m.moe_router_norm_topk_prob is False


# -------------------------------------------------------- training in parallel = one process
def _checkpoint(case, tmp_path, tp: int):
    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    hf = make_hf(case, vocab=300)  # pretrain_utils.TINY's vocabulary: NullTokenizer's ids
    hf.save_pretrained(tmp_path / f"{case}_hf")
    out = tmp_path / f"{case}_tp{tp}"
    ct.hf_to_megalite(str(tmp_path / f"{case}_hf"), str(out), Layout(tp, 1))
    args = json.loads((out / "iter_0000000" / "args.json").read_text())
    assert args["model"]["hf_architecture"] == type(hf).__name__
    return out


def test_use_checkpoint_args_needs_no_moe_flag_for_an_ep_run(tmp_path):
    """The command line's model is not the run's under --use-checkpoint-args: an EP2 (TP2)
    layout parses with no --num-experts, and args.json's model is checked against it once read,
    a bad one in one line."""
    from megalite.arguments import parse_args
    from megalite.checkpoint.format import with_checkpoint_args

    ckpt = _checkpoint("mixtral", tmp_path, 2)
    base = ["--load", str(ckpt), "--use-checkpoint-args", "--tensor-model-parallel-size", "2",
            "--sequence-parallel"]
    cfg = with_checkpoint_args(parse_args(base + ["--expert-model-parallel-size", "2"]))
    assert cfg.model.num_experts == 4 and cfg.model.hf_architecture == "MixtralForCausalLM"
    cfg.validate(world_size=4)
    bad = with_checkpoint_args(parse_args(base + ["--expert-model-parallel-size", "3"]))
    with pytest.raises(ConfigError, match=r"--num-experts \(4\) must be divisible by "
                                          r"--expert-model-parallel-size \(3\)"):
        bad.validate(world_size=6)
    with pytest.raises(ConfigError, match="need --num-experts"):  # still refused without a load
        parse_args(["--expert-model-parallel-size", "2"])


# the families trained at EP2 and exported; OLMoE also against one process
TRAINED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v3")


def test_imported_moe_models_train_at_ep2_and_export_to_hf(tmp_path):
    """Each family imported by the converter, trained 2 steps by pretrain.py at EP2 with
    --use-checkpoint-args and no other model flag (OLMoE, its q/k norm statistic summed over TP,
    at TP2 + SP x EP2), all in one world of two processes, saved, exported by megalite-to-hf:
    from_pretrained loads it as its own class with every weight, the trained weights differ from
    the imported ones, and HF's logits are megalite's. OLMoE gives one process's losses and grad
    norms (the other families' shapes: tests/test_moe_parallel.py)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dist_utils import run_distributed
    from megalite.checkpoint import convert as ct
    from pretrain_utils import flags, pretrain_cases, read_metrics, run_main

    def argv(ckpt, name, *layout):
        return flags("--load", ckpt, "--use-checkpoint-args", "--tokenizer-type",
                     "NullTokenizer", "--eval-iters", "0", *layout, train_iters=2,
                     metrics_file=tmp_path / f"{name}.jsonl")

    ep2 = ["--expert-model-parallel-size", "2"]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
           "--expert-tensor-parallel-size", "1"]
    runs = [argv(_checkpoint(c, tmp_path, 2 if c == "olmoe" else 1), c, *ep2,
                 *(tp2 if c == "olmoe" else []), "--save", tmp_path / f"{c}_trained")
            for c in TRAINED]
    assert all(run_distributed(pretrain_cases, 2, runs, timeout=300))
    for c in ("olmoe",):
        assert run_main(argv(_checkpoint(c, tmp_path / "one", 1), f"{c}_one")) == 0
        ref, got = (read_metrics(tmp_path / f"{n}.jsonl") for n in (f"{c}_one", c))
        assert [r["iteration"] for r in got] == [r["iteration"] for r in ref] == [1, 2]
        for a, b in zip(ref, got):
            for key in ("lm_loss", "grad_norm"):
                assert abs(b[key] - a[key]) <= 1e-5 * abs(a[key]), (c, a["iteration"], key,
                                                                   b[key], a[key])
        assert ref[0]["lm_loss"] != ref[1]["lm_loss"]  # the model trains

    ids = tokens()
    for c in TRAINED:
        out = ct.megalite_to_hf(str(tmp_path / f"{c}_trained"), str(tmp_path / f"{c}_export"))
        hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert type(hf).__name__ == CASES[c][0] + "ForCausalLM", c
        assert not info["missing_keys"] and not info["unexpected_keys"], (c, info)
        before = load_file(tmp_path / f"{c}_hf" / "model.safetensors")
        after = load_file(f"{out}/model.safetensors")  # the hub form: per-expert tensors
        assert set(after) == set(before), c
        moved = [k for k in before if not torch.equal(before[k], after[k])]
        assert len(moved) > len(before) // 2, c  # trained: (almost) every tensor moved
        with torch.no_grad():
            got = hf.eval()(ids).logits
            assert max_abs(from_hf(hf, make_vocab_size_divisible_by=8)(ids), got) <= TOL, c
