"""DeepSeek-V3's multi-token-prediction layers through Hugging Face conversion
(megalite/convert/hf.py; docs/models.md, "Multi-token prediction").

HF's DeepseekV3ForCausalLM builds no MTP layer and its save_pretrained writes none, so the hub
layout is made here: a tiny random 2-layer model's files (MLA, a dense layer then an MoE one of
4 experts), plus depth 1 as DeepSeek's files hold it under ``model.layers.2.``: a decoder layer
(the one a 3-layer HF model of the same config saves), enorm, hnorm, eh_proj, shared_head.norm,
and the copies of the embedding and output head. Checked: the import keeps every MTP tensor where
models/mtp.py reads it, the main logits equal HF's, the export (to_hf, the state dicts and the
offline converter at TP2 and PP2) gives back every hub tensor bit for bit with the config's
num_nextn_predict_layers; HF's own files (no MTP tensors) import without MTP; bad input is one
line. Then the planner (megalite/planner.py): its parameter count against the module's, its
compute against the FLOPs the depths add, and its memory against a measured pretrain.py run.
"""

import copy
import json

import pytest
import torch

from megalite.config import ConfigError, ModelConfig
from megalite.convert import (
    from_hf,
    hf_to_megalite_state_dict,
    megalite_to_hf_state_dict,
    model_config_to_hf_config,
    to_hf,
)
from megalite.convert.hf import hf_architecture
from test_convert_hf_moe import BASE, CASES, DEEPSEEK, max_abs, tokens  # the same VOCAB and SEQ

VOCAB, TOL = 100, 1e-4
CONFIG = dict(BASE, vocab_size=VOCAB, **dict(DEEPSEEK, n_routed_experts=4, n_group=2,
                                             topk_group=1, num_nextn_predict_layers=1))
MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
           "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "final_layernorm.weight"}


def make_hf(layers: int, seed: int = 0, case: str = "deepseek_v3"):
    """A DeepSeek-V3 (or ``case``'s family from test_convert_hf_moe, with one MTP depth) of
    ``layers`` decoder layers, every parameter and correction bias drawn with a large std (a
    misplaced tensor moves the logits far beyond the tolerance)."""
    import transformers

    prefix, extra = ("DeepseekV3", CONFIG) if case == "deepseek_v3" else CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, prefix + "Config")(**copy.deepcopy(
        {**BASE, "vocab_size": VOCAB, **extra, "num_nextn_predict_layers": 1,
         "num_hidden_layers": layers}))
    model = getattr(transformers, prefix + "ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model.eval()


def hub_layout(d, case: str = "deepseek_v3"):
    """(HF 2-layer model, HF 3-layer model, directory in DeepSeek's hub layout, its tensors)."""
    from safetensors.torch import load_file, save_file

    hf, hf3 = make_hf(2, case=case), make_hf(3, seed=1, case=case)
    hf.save_pretrained(d / "hf")
    hf3.save_pretrained(d / "hf3")
    sd = load_file(d / "hf" / "model.safetensors")
    assert not any(k.startswith("model.layers.2.") for k in sd)  # HF writes no MTP layer
    sd.update({k: v for k, v in load_file(d / "hf3" / "model.safetensors").items()
               if k.startswith("model.layers.2.")})
    g = torch.Generator().manual_seed(2)
    h = CONFIG["hidden_size"]
    for name, shape in (("enorm", [h]), ("hnorm", [h]), ("eh_proj", [h, 2 * h]),
                        ("shared_head.norm", [h])):
        sd[f"model.layers.2.{name}.weight"] = torch.randn(shape, generator=g)
    sd["model.layers.2.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd["model.layers.2.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, d / "hf" / "model.safetensors", metadata={"format": "pt"})
    return hf, hf3, d / "hf", sd


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return hub_layout(tmp_path_factory.mktemp("mtp"))


def test_import_keeps_mtp_and_main_logits_equal_hf(hub):
    """The directory imports with --mtp-num-layers 1: depth 1's own tensors as written, its
    transformer layer equal to what a 3-layer model's layer 2 imports as (an MoE layer with MLA,
    of the last layer's kind); the main logits within 1e-4 of HF's."""
    hf, hf3, path, sd = hub
    ml = from_hf(path)
    assert ml.config.mtp_num_layers == 1 and len(ml.mtp.layers) == 1
    params = dict(ml.named_parameters())
    for hf_name, ml_name in MTP_OWN.items():
        assert torch.equal(params[f"mtp.layers.0.{ml_name}"], sd[f"model.layers.2.{hf_name}"])
    three = from_hf(hf3).state_dict()
    layer = {k[len("mtp.layers.0.transformer_layer."):]: v for k, v in ml.state_dict().items()
             if k.startswith("mtp.layers.0.transformer_layer.")}
    assert "mlp.weight1" in layer and "self_attention.mla.linear_kv_up_proj.weight" in layer
    assert layer.keys() == {k[len("layers.2."):] for k in three if k.startswith("layers.2.")}
    assert all(torch.equal(v, three["layers.2." + k]) for k, v in layer.items())
    ids = tokens()
    with torch.no_grad():
        ref, got = hf(ids).logits, ml(ids)
    assert ref.abs().max().item() > 1.0
    assert max_abs(got, ref) <= TOL


def test_export_is_bit_identical(hub, tmp_path):
    """to_hf and the state-dict functions give back every hub tensor (names, dtypes, values: the
    embedding and head copies included) and num_nextn_predict_layers 1."""
    from safetensors.torch import load_file

    _, _, path, sd = hub
    ml = from_hf(path)
    out = to_hf(ml, tmp_path / "export")
    for back in (load_file(out / "model.safetensors"),
                 megalite_to_hf_state_dict(hf_to_megalite_state_dict(sd, ml.config), ml.config)):
        assert set(back) == set(sd), set(back) ^ set(sd)
        for k in sd:
            assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_glm45_mtp_imports_and_exports_bit_identically(tmp_path):
    """GLM-4.5 stores its MTP layer as DeepSeek-V3 does (same field, same names): it imports with
    its depth (a layer of GQA, q/k norm and MoE, its last layer's kind), the main logits equal
    HF's, and to_hf gives back every hub tensor bit for bit."""
    from safetensors.torch import load_file

    hf, _, path, sd = hub_layout(tmp_path, "glm4_moe")
    ml = from_hf(path)
    assert ml.config.mtp_num_layers == 1 and ml.config.qk_layernorm
    params = dict(ml.named_parameters())
    for hf_name, ml_name in MTP_OWN.items():
        assert torch.equal(params[f"mtp.layers.0.{ml_name}"], sd[f"model.layers.2.{hf_name}"])
    with torch.no_grad():
        assert max_abs(ml(tokens()), hf(tokens()).logits) <= TOL
    back = load_file(to_hf(ml, tmp_path / "export") / "model.safetensors")
    assert set(back) == set(sd), set(back) ^ set(sd)
    assert all(back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]) for k in sd)


def test_converter_round_trip_at_tp2_and_pp2_is_bit_identical(hub, tmp_path):
    """tools/checkpoint/convert.py's hf-to-megalite and back: at TP2, and at PP2 where depth 1
    sits on the last stage with the output head."""
    from safetensors.torch import load_file

    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    _, _, path, sd = hub
    for name, layout in (("tp2", Layout(2, 1)), ("pp2", Layout(1, 2))):
        ml, back = tmp_path / f"ml_{name}", tmp_path / f"back_{name}"
        ct.hf_to_megalite(str(path), str(ml), layout)
        if name == "pp2":
            last = torch.load(ml / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt",
                              weights_only=True)["model"]
            assert "mtp.layers.0.eh_proj.weight" in last
        ct.megalite_to_hf(str(ml), str(back))
        got = load_file(back / "model.safetensors")
        assert set(got) == set(sd), (name, set(got) ^ set(sd))
        for k in sd:
            assert got[k].dtype == sd[k].dtype and torch.equal(got[k], sd[k]), (name, k)


def test_hf_files_without_mtp_import_without_it(hub):
    """HF's save_pretrained keeps num_nextn_predict_layers but writes no MTP tensor; such files,
    and an HF model in memory, import as the main model alone, and export with 0."""
    hf, _, path, _ = hub
    for ml in (from_hf(hf), from_hf(path.parent / "hf3")):
        assert ml.config.mtp_num_layers is None and ml.mtp is None
        assert model_config_to_hf_config(ml.config).num_nextn_predict_layers == 0


def test_bad_input_is_one_line(hub):
    """A hub copy of the embedding that differs from the embedding (megalite's depths share it);
    a model with MTP exported as a family without MTP layers."""
    _, _, path, sd = hub
    ml = from_hf(path)
    bad = dict(sd, **{"model.layers.2.embed_tokens.weight": sd["model.embed_tokens.weight"] + 1})
    with pytest.raises(ValueError, match="model.layers.2.embed_tokens.weight differs from "
                                         "model.embed_tokens.weight, which megalite's MTP"):
        hf_to_megalite_state_dict(bad, ml.config)
    llama = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                        activation="silu", add_bias_linear=False, mtp_num_layers=1)
    with pytest.raises(ConfigError, match="mtp_num_layers=None \\(not 1\\)"):
        hf_architecture(llama)
    gpt2 = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                       mtp_num_layers=1)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no q/k norm, sliding window or "
                                          "MTP layers"):
        hf_architecture(gpt2)


# --------------------------------------------------------------------------------- the planner
@pytest.mark.parametrize("kw", [{}, dict(untie_embeddings_and_output_weights=True),
                                dict(num_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2)],
                         ids=["tied", "untied", "moe"])
def test_planner_counts_the_mtp_modules_parameters(kw):
    """stage_params with two MTP depths equals the parameters of the GPTModel pretrain.py builds:
    one process, and the last of two stages (its depths, eh_proj, norms and the embedding's copy
    the depths embed with; an MoE model's depths are MoE layers)."""
    from megalite.models import GPTModel
    from megalite.parallel_state import ParallelState
    from megalite.planner import Layout, Model, stage_params

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=500, mtp_num_layers=2, **kw)
    m = Model.from_config(cfg, "cpu")
    for lay, r, pre, layers in ((Layout(), 0, True, (0, 2)), (Layout(1, 2), 1, False, (1, 2))):
        model = GPTModel(cfg, ParallelState(), pre_process=pre, post_process=True,
                         layer_range=layers, seed=None, device="meta")
        assert len(model.mtp.layers) == 2
        assert stage_params(m, lay, r) == sum(p.numel() for p in model.parameters()), (lay, kw)


def test_planner_step_time_grows_by_the_mtp_flops():
    """One MTP depth of an 8-layer 7B-shaped model: the step's compute grows as the FLOPs grow,
    a ninth layer, one more output head and eh_proj (6 x 2h x h per token), within 3%."""
    import dataclasses

    from megalite.logging import model_flops_per_sequence
    from megalite.planner import GPUS, Cluster, Layout, Model, step_time

    cfg = ModelConfig(num_layers=8, hidden_size=4096, num_attention_heads=32, seq_length=4096,
                      vocab_size=128000, params_dtype="bfloat16", position_embedding_type="rope",
                      normalization="RMSNorm", swiglu=True, ffn_hidden_size=11008)
    lay, cl = Layout(2, 1, 1, 4, 1, True), Cluster(8, 8, GPUS["H100-80GB"])
    one = dataclasses.replace(cfg, mtp_num_layers=1)
    grown = (step_time(Model.from_config(one), lay, cl, 64)["compute_s"]
             / step_time(Model.from_config(cfg), lay, cl, 64)["compute_s"])
    V, h, s = cfg.padded_vocab_size(2), cfg.hidden_size, cfg.seq_length
    flops = model_flops_per_sequence(cfg, V)
    more = model_flops_per_sequence(dataclasses.replace(cfg, num_layers=9), V) - flops \
        + 3 * 2 * h * V * s + 3 * 2 * 2 * h * h * s
    assert abs(grown / (1 + more / flops) - 1) < 0.03, (grown, more / flops)


def test_pretrain_estimate_with_mtp_within_5_percent(tmp_path):
    """DualPipeV at PP 2 (2 processes): rank 0 holds the head, the MTP depth and the embedding's
    copy it embeds with; its logged estimate is within 5% of the measured peak (without MTP's
    terms, a one-process run's estimate was 20% below its peak)."""
    from test_planner import _pretrain_estimate

    est, got, _ = _pretrain_estimate(tmp_path, 2, "--micro-batch-size", "1",
                                     "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                     "dualpipev", "--untie-embeddings-and-output-weights",
                                     "--position-embedding-type", "rope", "--mtp-num-layers", "1")
    assert abs(got / est - 1) < 0.05, (est, got)
