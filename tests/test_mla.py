"""Multi-latent attention (megalite/models/mla.py, docs/models.md "Multi-latent attention"):
the layer equals HF's DeepseekV3Attention on the same weights, forward and backward, with and
without a q latent, with plain and YaRN RoPE (its frequencies, cos/sin factor and DeepSeek's
softmax scale); TP2 (+ SP), CP2 (p2p, allgather, a2a), PP2 and DP2 ZeRO-3 with full
recomputation pretrain runs equal one process; the FLOP and parameter counts match the layer;
bad flag combinations are refused in one line; YaRN imports for a Llama, and a model trained
here exports as DeepSeek-V3 (its HF parity: tests/test_convert_hf_moe.py)."""

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import ConfigError, ModelConfig

H, HEADS, S, B = 32, 4, 12, 2
MLA_DIMS = dict(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, rope_original_max_position_embeddings=4,
            beta_fast=8.0, beta_slow=0.5, mscale=0.8, mscale_all_dim=0.6)
# HF DeepseekV3Attention name -> megalite SelfAttention name
HF_TO_MEGALITE = {"q_proj": "mla.linear_q_proj", "q_a_proj": "mla.linear_q_down_proj",
                  "q_a_layernorm": "mla.q_layernorm", "q_b_proj": "mla.linear_q_up_proj",
                  "kv_a_proj_with_mqa": "mla.linear_kv_down_proj",
                  "kv_a_layernorm": "mla.kv_layernorm", "kv_b_proj": "mla.linear_kv_up_proj",
                  "o_proj": "linear_proj"}


def mla_config(q_lora_rank=None, **overrides) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, norm_epsilon=1e-6, rotary_base=500.0,
                multi_latent_attention=True, q_lora_rank=q_lora_rank, **MLA_DIMS)
    return ModelConfig(**{**base, **overrides})


def _hf_attention(cfg: ModelConfig):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention, DeepseekV3RotaryEmbedding)

    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rotary_scaling_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
                    beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow, mscale=cfg.mscale,
                    mscale_all_dim=cfg.mscale_all_dim)
    hf_cfg = DeepseekV3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_head_dim, qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
        v_head_dim=cfg.v_head_dim, rope_interleave=False, rms_norm_eps=cfg.norm_epsilon,
        max_position_embeddings=16, rope_parameters=rope, attention_bias=False)
    hf_cfg._attn_implementation = "eager"
    return DeepseekV3Attention(hf_cfg, 0), DeepseekV3RotaryEmbedding(hf_cfg)


@pytest.mark.parametrize("q_lora_rank,rope", [(None, "rope"), (12, "yarn")])
def test_mla_equals_hf_deepseek_v3_attention(q_lora_rank, rope):
    """fp32, forward and backward within 1e-5: every weight's gradient and the input's."""
    from megalite.models.transformer import SelfAttention

    torch.manual_seed(0)
    cfg = mla_config(q_lora_rank, **(YARN if rope == "yarn" else {})).validate()
    hf, hf_rope = _hf_attention(cfg)
    ours = SelfAttention(cfg, 0)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "layernorm" not in name else 1.0))
            params[HF_TO_MEGALITE[name.rsplit(".", 1)[0]] + ".weight"].copy_(p)
    x = torch.randn(B, S, H, requires_grad=True)
    cos, sin = hf_rope(x, torch.arange(S)[None].expand(B, S))
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    want = hf(x, (cos, sin), mask)[0]
    xs = x.detach().transpose(0, 1).clone().requires_grad_(True)  # sequence-first [s, b, h]
    got = ours(xs).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(want)
    (want * dy).sum().backward()
    (got * dy).sum().backward()
    torch.testing.assert_close(xs.grad.transpose(0, 1), x.grad, rtol=1e-5, atol=1e-5)
    for name, p in hf.named_parameters():
        mine = params[HF_TO_MEGALITE[name.rsplit(".", 1)[0]] + ".weight"]
        torch.testing.assert_close(mine.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
    if rope == "yarn":  # the two YaRN parts are exercised: frequencies and temperatures
        assert ours.softmax_scale != (8 + 4) ** -0.5 and ours.rotary.attention_factor != 1.0


# ------------------------------------------------- an unfused reference, at TP 1 and TP 2
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, pos, base):  # rotate-half RoPE over the last dim, positions on dim 1
    d = x.shape[-1]
    freqs = pos[:, None].double() / base ** (torch.arange(0, d, 2).double() / d)
    emb = torch.cat([freqs, freqs], dim=-1).float()[None, :, None]  # [1, s, 1, d]
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()


def mla_reference(x, w, cfg):
    """MLA written out from its formulas (megalite/models/mla.py's docstring) on whole weights
    ``w`` (megalite's names), no TP: x [b, s, h] -> [b, s, h]."""
    b, s, _ = x.shape
    n, dn, dr, dv = (cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
                     cfg.v_head_dim)
    eps, pos = cfg.norm_epsilon, torch.arange(s)
    if cfg.q_lora_rank is None:
        q = x @ w["mla.linear_q_proj.weight"].T
    else:
        c_q = _rms(x @ w["mla.linear_q_down_proj.weight"].T, w["mla.q_layernorm.weight"], eps)
        q = c_q @ w["mla.linear_q_up_proj.weight"].T
    q_nope, q_pe = q.view(b, s, n, dn + dr).split([dn, dr], dim=-1)
    c_kv, k_pe = (x @ w["mla.linear_kv_down_proj.weight"].T).split([cfg.kv_lora_rank, dr], -1)
    kv = _rms(c_kv, w["mla.kv_layernorm.weight"], eps) @ w["mla.linear_kv_up_proj.weight"].T
    k_nope, v = kv.view(b, s, n, dn + dv).split([dn, dv], dim=-1)
    q = torch.cat([q_nope, _rotate(q_pe, pos, cfg.rotary_base)], dim=-1)
    k_pe = _rotate(k_pe[:, :, None], pos, cfg.rotary_base).expand(b, s, n, dr)  # one shared head
    k = torch.cat([k_nope, k_pe], dim=-1)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * (dn + dr) ** -0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnqk,bknd->bqnd", scores.softmax(-1), v).reshape(b, s, n * dv)
    return out @ w["linear_proj.weight"].T


# how each weight is split over TP: the up projections by rows (whole heads per rank), the
# output projection by columns; the down projections and the latent norms replicated
_SPLIT_DIM = {"mla.linear_q_proj.weight": 0, "mla.linear_q_up_proj.weight": 0,
              "mla.linear_kv_up_proj.weight": 0, "linear_proj.weight": 1}


def mla_against_reference(rank, world_size, q_lora_rank, sp):
    """SelfAttention (MLA) at TP ``world_size`` against :func:`mla_reference`: the output, the
    input's gradient, every weight's gradient (this rank's slice), within 1e-5."""
    from megalite import collectives as C
    from megalite.models.transformer import SelfAttention
    from megalite.parallel_state import initialize_model_parallel

    group = None
    if world_size > 1:
        group = initialize_model_parallel(world_size, 1, backend="gloo", device="cpu",
                                          set_default=False).tp_group
    cfg = mla_config(q_lora_rank).validate(world_size)
    ours = SelfAttention(cfg, 0, tp_group=group, sequence_parallel=sp)
    torch.manual_seed(0)  # the same whole weights and input on every rank
    whole = {n: (torch.randn(p.shape[:_SPLIT_DIM.get(n, 0)] + (p.shape[_SPLIT_DIM[n]] *
             world_size,) + p.shape[_SPLIT_DIM[n] + 1:]) if n in _SPLIT_DIM else
             torch.randn(p.shape)) * (1.0 if "layernorm" in n else 0.3)
             for n, p in ours.named_parameters()}
    whole = {n: t.requires_grad_(True) for n, t in whole.items()}
    x = torch.randn(B, S, H, requires_grad=True)
    want = mla_reference(x, whole, cfg)
    dy = torch.randn_like(want)
    (want * dy).sum().backward()

    def mine(n, t):
        return t.chunk(world_size, dim=_SPLIT_DIM[n])[rank] if n in _SPLIT_DIM else t

    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(mine(n, whole[n]))
    xs = x.detach().transpose(0, 1).contiguous()  # sequence-first [s, b, h]
    dys = dy.transpose(0, 1)
    if sp:  # each rank holds s/t tokens going in and coming out
        xs, dys = (t.chunk(world_size, dim=0)[rank].contiguous() for t in (xs, dys))
    xs.requires_grad_(True)
    got = ours(xs)
    (got * dys).sum().backward()
    want_s = want.detach().transpose(0, 1)
    want_dx = x.grad.transpose(0, 1)
    if sp:
        want_s, want_dx = (t.chunk(world_size, dim=0)[rank] for t in (want_s, want_dx))
    torch.testing.assert_close(got, want_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, want_dx, rtol=1e-5, atol=1e-5)
    for n, p in ours.named_parameters():
        g = p.grad
        if sp and n not in _SPLIT_DIM:  # partial over TP under SP: summed after backward
            C.all_reduce(g, group=group)
        torch.testing.assert_close(g, mine(n, whole[n].grad), rtol=1e-5, atol=1e-5, msg=n)
    return True


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_equals_an_unfused_reference_at_tp1(q_lora_rank):
    assert mla_against_reference(0, 1, q_lora_rank, sp=False)


def _tp2_cases(rank, world_size):
    return all(mla_against_reference(rank, world_size, q, sp) for q in (None, 12)
               for sp in (False, True))


def test_mla_equals_an_unfused_reference_at_tp2():
    """Both q paths, without SP (the f operators sum the replicated weights' gradients) and
    with SP (their partial gradients, summed over TP as finalize_model_grads does)."""
    from dist_utils import run_distributed

    assert all(run_distributed(_tp2_cases, 2, timeout=120))


ITERS = 4
MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--position-embedding-type", "rope",
       "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
Q_LORA = ["--q-lora-rank", "12"]
CP2 = ["--context-parallel-size", "2", "--cp-comm-type"]
# name: (model flags, layout flags), all on 2 ranks; the model flags alone are the one-process run.
# TP without SP: the f operators (the up projections', k_pe's) sum the latents' gradients; with
# SP the replicated down projections and latent norms are partial over TP, summed after backward.
CASES = {"tp2_sp": (Q_LORA, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
         "tp2": ([], ["--tensor-model-parallel-size", "2"]),
         "cp2_p2p": (Q_LORA, CP2 + ["p2p"]),  # V padded to the q/k width for the ring
         "cp2_allgather": (Q_LORA, CP2 + ["allgather"]),
         "cp2_a2a": (Q_LORA, CP2 + ["a2a"]),
         "pp2": (Q_LORA, ["--pipeline-model-parallel-size", "2"]),
         # parameters sharded over DP (the replicated latents' weights too), layers recomputed
         "dp2_zero3_recompute": (Q_LORA, ["--zero-stage", "3", "--recompute-granularity",
                                          "full"])}


def _argv(model, layout, metrics):
    from pretrain_utils import flags

    return flags(*MLA, *model, *layout, train_iters=ITERS, metrics_file=metrics, eval_iters=0)


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory):
    from dist_utils import run_distributed
    from pretrain_utils import pretrain_cases, single_process_refs

    d = tmp_path_factory.mktemp("mla")
    runs = [_argv(model, layout, d / f"{name}.jsonl") for name, (model, layout) in CASES.items()]
    assert all(run_distributed(pretrain_cases, 2, runs, timeout=600))
    refs = single_process_refs((m for m, _ in CASES.values()), lambda m, out: _argv(m, [], out), d)
    return d, refs


@pytest.mark.parametrize("name", list(CASES))
def test_mla_layout_matches_one_process(mla_runs, name):
    """Losses and grad norms of every iteration within 1e-5 of one process."""
    from pretrain_utils import assert_same_run, read_metrics

    d, refs = mla_runs
    ref, got = read_metrics(refs[tuple(CASES[name][0])]), read_metrics(d / f"{name}.jsonl")
    assert_same_run(ref, got, ITERS, name=name)
    assert len({round(r["lm_loss"], 4) for r in ref}) == ITERS  # the losses do move


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_parameter_and_flop_counts_are_the_layers(q_lora_rank):
    """num_parameters is the built model's; the attention FLOPs count MLA's own projections
    (2 per weight per token) and its q·k and v widths in the core."""
    from megalite.logging import attention_flops, model_flops_per_sequence
    from megalite.models.gpt import GPTModel

    cfg = mla_config(q_lora_rank, vocab_size=100, make_vocab_size_divisible_by=4,
                     untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg, seed=None)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    attn = model.layers["0"].self_attention
    weights = sum(p.numel() for n, p in attn.named_parameters() if "layernorm" not in n)
    assert cfg.attention_weights() == weights
    n, dqk, dv, L = HEADS, 8 + 4, 6, cfg.num_layers
    assert attention_flops(cfg) == 3 * 2 * (n * dqk + n * dv) * L * S * S
    plain = ModelConfig(**{**cfg.to_dict(), "multi_latent_attention": False, **{
        k: ModelConfig().to_dict()[k] for k in (*MLA_DIMS, "q_lora_rank")}})
    assert (model_flops_per_sequence(cfg) - attention_flops(cfg)
            - model_flops_per_sequence(plain) + attention_flops(plain)
            == 3 * S * L * 2 * (weights - plain.attention_weights()))


REFUSED = {  # flags -> a piece of the one-line message
    ("--q-lora-rank", "8"): "--q-lora-rank needs --multi-latent-attention",
    ("--mscale-all-dim", "1"): "--mscale-all-dim needs --rope-type yarn",
    ("--rope-type", "yarn"): "--rope-type yarn needs --position-embedding-type rope",
    ("--multi-latent-attention",): "needs --position-embedding-type rope",
    ("--multi-latent-attention", "--position-embedding-type", "rope"): "--disable-bias-linear",
}
MLA_OK = ["--multi-latent-attention", "--position-embedding-type", "rope",
          "--disable-bias-linear", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
          "--v-head-dim", "8"]
REFUSED.update({tuple(MLA_OK + list(extra)): msg for extra, msg in {
    ("--group-query-attention", "--num-query-groups", "2"): "has no query groups",
    ("--qk-layernorm",): "does not support --qk-layernorm",
    ("--sliding-window", "4"): "does not support --sliding-window",
    ("--rotary-percent", "0.5"): "does not support --rotary-percent",
    ("--qk-pos-emb-head-dim", "3"): "--qk-pos-emb-head-dim must be a positive even number",
    ("--kv-lora-rank", "0"): "--kv-lora-rank must be a positive integer",
    ("--rope-type", "yarn", "--beta-slow", "40"): "0 < --beta-slow < --beta-fast",
    ("--rope-type", "yarn", "--rope-scaling-factor", "8"): "no --rope-scaling-factor",
    ("--v-head-dim", "16", "--context-parallel-size", "2", "--seq-length", "16"):
        "needs --v-head-dim (16) <= --qk-head-dim + --qk-pos-emb-head-dim (12); use a2a",
}.items()})


@pytest.mark.parametrize("argv", list(REFUSED), ids=[REFUSED[a][:40] for a in REFUSED])
def test_bad_combinations_are_refused_in_one_line(argv):
    with pytest.raises(ConfigError) as e:
        parse_args(list(argv))
    assert REFUSED[argv] in str(e.value) and "\n" not in str(e.value)
    parse_args(MLA_OK + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"])  # valid


def test_yarn_llama_imports_with_hf_logits():
    """YaRN outside MLA (Qwen3 long context ships it): frequencies and the cos/sin factor, no
    softmax factor, as HF's Llama computes them; logits within 1e-4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megalite.convert import from_hf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=H, num_attention_heads=HEADS, intermediate_size=48,
        vocab_size=100, max_position_embeddings=16, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                         "original_max_position_embeddings": 4, "beta_fast": 8.0,
                         "beta_slow": 0.5})).eval()
    with torch.no_grad():  # large weights: a wrong factor moves the logits far past 1e-4
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ml = from_hf(hf, make_vocab_size_divisible_by=4)
    assert (ml.config.rope_type, ml.config.mscale, ml.config.mscale_all_dim) == ("yarn", 1, 0)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ml(ids), hf(ids).logits, rtol=0, atol=1e-4)


DEEPSEEK_MOE = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=24,
                    moe_layer_freq="[0,1]", moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=24,
                    moe_router_num_groups=4, moe_router_group_topk=2,
                    moe_router_group_score="top2_sum", ffn_hidden_size=48,
                    untie_embeddings_and_output_weights=True)


def test_an_mla_model_trained_here_exports_as_deepseek_v3():
    """The first (only) family that holds MLA; its YaRN settings must have an HF spelling.
    (Import, logits, gradients and round trips: tests/test_convert_hf_moe.py's deepseek_v3.)"""
    import dataclasses

    from megalite.convert.hf import hf_architecture, model_config_to_hf_config

    cfg = mla_config(12, **DEEPSEEK_MOE)
    assert hf_architecture(cfg) == "DeepseekV3ForCausalLM"
    hf = model_config_to_hf_config(cfg)
    assert (hf.q_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim,
            hf.rope_interleave, hf.n_group, hf.num_nextn_predict_layers) == (12, 8, 4, 6, True,
                                                                             4, 0)
    with pytest.raises(ConfigError, match="DeepseekV3ForCausalLM: --mscale 0.8 with "
                                          "--mscale-all-dim 0.0 has no HF yarn spelling"):
        hf_architecture(dataclasses.replace(cfg, **{**YARN, "mscale_all_dim": 0.0}))
    with pytest.raises(ConfigError, match="no Hugging Face architecture holds"):
        hf_architecture(mla_config(12))  # dense: DeepSeek-V3 has experts
