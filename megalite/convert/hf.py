"""Hugging Face <-> megalite conversion of configs and tensors, per transformer layer (so a
streaming tool converts one layer at a time) and for whole state dicts; whole models live in
convert/hf_files.py, which imports this module (never the other way). Each family is one row of
:data:`FAMILIES`, read by the import and written by the export. The families, key names, tensor
layouts and what each family maps or refuses: docs/models.md.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from megalite.config import CHECKPOINT_ARG, SHAPE, ConfigError, ModelConfig, dtype_from_name
from megalite.convert.mxfp4 import dequantize_mxfp4
from megalite.convert.sharding import (
    EMBEDDING_WEIGHT_NAME,
    OUTPUT_WEIGHT_NAME,
    pad_vocab,
)


# ======================================================================================= families
@dataclass(frozen=True)
class MoeSpec:
    """How one HF family spells its mixture-of-experts block: config fields and tensor names."""

    num_experts: str  # config field of E
    expert_ffn: str  # config field of each expert's width
    block: str = "mlp"  # the MoE block's module in hub files
    expert_names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    norm_topk_prob: Optional[str] = "norm_topk_prob"  # None: the k gates are always renormalised
    router: str = "softmax"  # or "deepseek" (sigmoid; docs/models.md, "Routing")
    gate: str = "gate"  # the router's module
    # GPT-OSS: hub files hold the experts stacked (gate_up_proj [E, h, 2f], gate and up columns
    # interleaved; down_proj [E, f, h]), each with a bias, and the router has a bias
    stacked: bool = False
    shared: Optional[str] = None  # module of the shared expert
    shared_gate: Optional[str] = None  # module of its sigmoid gate (Qwen2-MoE)
    shared_size: Optional[str] = None  # config field of its width, or
    shared_count: Optional[str] = None  # of its width in expert widths (n_shared_experts)
    # which layers are MoE: "all", "sparse_step" (decoder_sparse_step, mlp_only_layers) or
    # "first_k_dense" (first_k_dense_replace): docs/models.md, "The layer pattern"
    layers: str = "all"


@dataclass(frozen=True)
class Family:
    """One HF family: its class and how its config and tensors differ from Llama's."""

    architecture: str
    layout: str = "llama"  # "gpt2" or "llama": the attention and norm tensors' naming
    qkv_bias: Union[bool, str] = False  # a q/k/v-only bias: always (True) or by this config field
    linear_bias: bool = False  # Llama: attention_bias biases o_proj as well (with mlp_bias)
    qk_norm: Optional[str] = None  # "head" or "projection" (ModelConfig.qk_layernorm_scope)
    qk_norm_field: Optional[str] = None  # the config field that switches it (else always on)
    # how a sliding window is configured: "mistral", "qwen" or "skip" (GPT-OSS's layer_types)
    window: Optional[str] = None
    partial_rotary: bool = False  # its attention honours partial_rotary_factor
    sinks: bool = False  # a learned logit per head in every softmax (self_attn.sinks)
    # config field counting the multi-token-prediction layers: DeepSeek-V3's after the last
    # layer, or Qwen's mtp.* (the hybrid families: _qwen_mtp)
    mtp_field: Optional[str] = None
    refused: Tuple[Tuple[str, object], ...] = ()  # (config field, the only value megalite holds)
    moe: Optional[MoeSpec] = None
    mla: bool = False  # DeepSeek's multi-latent attention (models/mla.py; _rope_pairs)
    # Gated DeltaNet layers beside gated softmax ones, zero-centred norms: the in projections
    # "fused" per key-head group (Qwen3-Next) or "split" by kind (Qwen3.5); see _LINEAR_LAYER
    linear: Optional[str] = None


# GLM-4.5's MoE block, and DeepSeek-V3's (docs/models.md, the MoE families' table)
DEEPSEEK_MOE = MoeSpec("n_routed_experts", "moe_intermediate_size", router="deepseek",
                       shared="shared_experts", shared_count="n_shared_experts",
                       layers="first_k_dense")
_QWEN_MOE = dict(num_experts="num_experts", expert_ffn="moe_intermediate_size",
                 layers="sparse_step")
_NO_WINDOW = (("use_sliding_window", False),)
_QWEN_SHARED = dict(shared="shared_expert", shared_gate="shared_expert_gate",
                    shared_size="shared_expert_intermediate_size")
_HYBRID = dict(qk_norm="head", partial_rotary=True, mtp_field="mtp_num_hidden_layers")

# HF model_type -> its family. Qwen2, Qwen3, Mistral and the MoE families share Llama's layout.
FAMILIES: Dict[str, Family] = {
    "gpt2": Family("GPT2LMHeadModel", layout="gpt2"),
    "llama": Family("LlamaForCausalLM", linear_bias=True),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, window="qwen"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm="head", window="qwen"),
    "mistral": Family("MistralForCausalLM", window="mistral"),
    "mixtral": Family("MixtralForCausalLM", window="mistral",
                      refused=(("router_jitter_noise", 0.0),),
                      moe=MoeSpec("num_local_experts", "intermediate_size",
                                  block="block_sparse_moe", expert_names=("w1", "w3", "w2"),
                                  norm_topk_prob=None)),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", qkv_bias="qkv_bias", refused=_NO_WINDOW,
                        moe=MoeSpec(**_QWEN_MOE, **_QWEN_SHARED)),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm="head", refused=_NO_WINDOW,
                        moe=MoeSpec(**_QWEN_MOE)),
    "olmoe": Family("OlmoeForCausalLM", qk_norm="projection", refused=(("clip_qkv", None),),
                    moe=MoeSpec("num_experts", "intermediate_size")),
    "glm4_moe": Family("Glm4MoeForCausalLM", qkv_bias="attention_bias", qk_norm="head",
                       qk_norm_field="use_qk_norm", partial_rotary=True,
                       mtp_field="num_nextn_predict_layers", moe=DEEPSEEK_MOE),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", mla=True, mtp_field="num_nextn_predict_layers",
                          refused=(("attention_bias", False), ("pretraining_tp", 1),
                                   ("rope_interleave", True)),
                          moe=DEEPSEEK_MOE),
    "qwen3_next": Family("Qwen3NextForCausalLM", **_HYBRID, linear="fused",
                         moe=MoeSpec(**_QWEN_MOE, **_QWEN_SHARED)),
    "qwen3_5_text": Family("Qwen3_5ForCausalLM", **_HYBRID, linear="split"),
    "qwen3_5_moe_text": Family("Qwen3_5MoeForCausalLM", **_HYBRID, linear="split",
                               moe=MoeSpec("num_experts", "moe_intermediate_size",
                                           norm_topk_prob=None, **_QWEN_SHARED)),
    "gpt_oss": Family("GptOssForCausalLM", linear_bias=True, window="skip", sinks=True,
                      moe=MoeSpec("num_local_experts", "intermediate_size", gate="router",
                                  norm_topk_prob=None, stacked=True)),
}
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())
# vision-language wrappers: their text model imports (config under text_config, weights under
# model.language_model.*), the vision tower is refused; the export writes the text family
WRAPPERS = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForConditionalGeneration"),
            "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration")}
IMPORTED_ARCHITECTURES = SUPPORTED_ARCHITECTURES + tuple(a for _, a in WRAPPERS.values())
FAMILY_OF_MODEL_TYPE = {k: k for k in FAMILIES}  # HF model_type -> family
FAMILY_OF_MODEL_TYPE.update({k: f for k, (f, _) in WRAPPERS.items()})
_FAMILY_OF_ARCHITECTURE = {f.architecture: k for k, f in FAMILIES.items()}

# HF activation names -> ModelConfig.activation (GPT-2's "gelu_new" is gelu's tanh approximation)
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                     "relu": "relu"}
_GPT2_ACTIVATIONS_BACK = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}

# HF buffers that are not parameters and carry nothing megalite needs (causal masks, RoPE cache).
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def unsupported_architecture(name: str) -> ConfigError:
    return ConfigError(f"unsupported Hugging Face architecture {name!r}: megalite converts "
                       f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def refused_hf_config(raw: Mapping) -> Optional[str]:
    """Why a config.json (as a dict) of a family megalite knows of but cannot hold is refused,
    naming the field, or None (docs/models.md, "Refused families")."""
    model_type = raw.get("model_type")
    if model_type in ("llama4", "llama4_text"):
        text = raw.get("text_config") or raw
        nope = [i for i, rope in enumerate(text.get("no_rope_layers") or []) if not rope]
        return (f"{model_type} is not supported: its chunked attention (attention_chunk_size="
                f"{text.get('attention_chunk_size')}) and NoPE layers (no_rope_layers: "
                f"{len(nope)} layer(s) without RoPE) have no megalite equivalent")
    q = raw.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, Mapping) else getattr(q, "quant_method", q)
    if q and method != "mxfp4":  # MXFP4 experts (GPT-OSS) are dequantised: convert/mxfp4.py
        return (f"{model_type} quantization_config (quant_method {method!r}) is not supported: "
                f"megalite imports unquantised weights (dequantise the checkpoint to bf16 first)")
    return None


def check_hf_weight_names(names, where: str = "HF state dict") -> None:
    """FP8 hub weights without their quantization_config, a vision tower: refused by the tensor
    that shows them."""
    scale = next((k for k in names if k.endswith("weight_scale_inv")), None)
    if scale is not None:
        raise ConfigError(f"{where}: FP8 weights ({scale}) are not supported: megalite imports "
                          f"unquantised weights (dequantise the checkpoint to bf16 first)")
    extra = next((k for k in names if k.startswith("model.visual.")), None)
    if extra is not None:
        raise ConfigError(f"{where}: {extra} is not supported: megalite imports the text model "
                          f"without vision tower (model.visual.*); HF's *ForCausalLM "
                          f"from_pretrained, then save_pretrained, leaves it out")


def hf_family(hf_config) -> str:
    model_type = getattr(hf_config, "model_type", None)
    refusal = refused_hf_config(hf_config.to_dict() if hasattr(hf_config, "to_dict") else {
        "model_type": model_type})
    if refusal is not None:
        raise ConfigError(refusal)
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        archs = getattr(hf_config, "architectures", None) or [model_type]
        raise unsupported_architecture(archs[0])
    return family


def model_family(cfg: ModelConfig) -> str:
    """"gpt2" or "llama": which HF tensor layout holds this megalite configuration (every family
    but GPT-2 uses Llama's; :func:`hf_architecture` picks the class)."""
    if (cfg.position_embedding_type == "learned_absolute" and cfg.normalization == "LayerNorm"
            and not cfg.swiglu):
        return "gpt2"
    if cfg.position_embedding_type == "rope" and cfg.normalization == "RMSNorm" and cfg.swiglu:
        return "llama"
    raise ConfigError(
        f"no Hugging Face architecture holds this model (position embedding "
        f"{cfg.position_embedding_type}, {cfg.normalization}, swiglu={cfg.swiglu}): "
        f"GPT2LMHeadModel needs learned_absolute + LayerNorm + no SwiGLU, LlamaForCausalLM "
        f"rope + RMSNorm + SwiGLU")


# ========================================================================================= config
# Each _x(hf_config, family) reads a part of an HF config as ModelConfig fields; _hf_x(cfg, ...)
# is its inverse, the HF config kwargs.
_LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_position_embeddings"}


def _rope(hf_config, family: str) -> dict:
    """RoPE base, scaling and partial rotation as ModelConfig fields (``rope_parameters`` in
    transformers >= 5; ``rope_theta``, ``rope_scaling``, ``partial_rotary_factor`` before)."""
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.update(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3", "yarn"):
        raise ConfigError(f"rope type {rope_type!r} is not supported: megalite implements the "
                          f"default rotary embedding, 'llama3' and 'yarn' scaling")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    out = {"rotary_base": float(theta if theta is not None else 10000.0)}
    if rope_type == "llama3":
        out.update({ml: params[hf] for hf, ml in _LLAMA3_ROPE.items()})
    if rope_type == "yarn":
        out.update(_yarn(params, hf_config))
    partial = params.get("partial_rotary_factor",
                         getattr(hf_config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    if partial != 1.0 and not FAMILIES[family].partial_rotary:
        raise ConfigError(f"{family} partial_rotary_factor={partial} is not supported: its HF "
                          f"attention rotates whole heads (megalite's --rotary-percent)")
    out["rotary_percent"] = partial
    return out


def _yarn(params: dict, hf_config) -> dict:
    """HF's yarn ``rope_parameters`` as ModelConfig fields (docs/models.md, "YaRN RoPE")."""
    if params.get("attention_factor") is not None:
        raise ConfigError("yarn rope_parameters attention_factor is not supported: megalite "
                          "derives the cos/sin factor from mscale and mscale_all_dim")
    # as HF's config standardisation and _compute_yarn_parameters fill them in
    original = params.get("original_max_position_embeddings") or hf_config.max_position_embeddings
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        if mscale_all_dim:
            raise ConfigError(f"yarn mscale_all_dim={mscale_all_dim} without mscale is not "
                              f"supported (HF's cos/sin factor then ignores it)")
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor),
                rope_original_max_position_embeddings=int(original),
                beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), mscale=float(mscale),
                mscale_all_dim=float(mscale_all_dim),
                rope_yarn_truncate=params.get("truncate") is not False)


def _hf_rope(cfg: ModelConfig, config_cls, fam: Family) -> dict:
    params = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        params.update({"rope_type": "llama3"},
                      **{hf: getattr(cfg, ml) for hf, ml in _LLAMA3_ROPE.items()})
    if cfg.rope_type == "yarn":
        m, m_all = cfg.mscale, cfg.mscale_all_dim
        if not (m and m_all or m == 1.0 and not m_all):
            raise ConfigError(f"--mscale {cfg.mscale} with --mscale-all-dim "
                              f"{cfg.mscale_all_dim} has no HF yarn spelling: HF takes the "
                              f"ratio only when both are non-zero, else mscale 1")
        params.update(rope_type="yarn", factor=cfg.rotary_scaling_factor,
                      original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
                      beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow)
        if (m, m_all) != (1.0, 0.0):  # else HF's default factor, as GPT-OSS's config leaves it
            params.update(mscale=m, mscale_all_dim=m_all)
        if not cfg.rope_yarn_truncate:
            params["truncate"] = False
    partial = {"partial_rotary_factor": cfg.rotary_percent} if fam.partial_rotary else {}
    # transformers >= 5 takes rope_parameters; older versions take rope_theta and rope_scaling.
    if _accepts(config_cls, "rope_parameters"):
        return {"rope_parameters": {**params, **partial}}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    scaled = cfg.rope_scaling_factor is not None or cfg.rope_type == "yarn"
    return {"rope_theta": cfg.rotary_base, "rope_scaling": scaling if scaled else None,
            **partial}


def _accepts(config_cls, name: str) -> bool:
    return name in inspect.signature(config_cls.__init__).parameters


def _sliding_window(c, family: str) -> dict:
    """Which layers HF windows, as ModelConfig fields (docs/models.md, "Sliding window")."""
    rule = FAMILIES[family].window
    window = getattr(c, "sliding_window", None)
    if rule == "mistral":
        types = getattr(c, "layer_types", None) or []
        if window is not None and any(t != "sliding_attention" for t in types):
            raise ConfigError(f"{family.capitalize()} layer_types with full-attention layers "
                              f"(alternating attention) are not supported: megalite windows "
                              f"every layer")
        return {"sliding_window": window, "max_window_layers": 0}
    if rule == "skip":  # GPT-OSS: layer n (from 1) full when N divides n, windowed otherwise
        types, n = list(c.layer_types), c.num_hidden_layers
        if window is None and "sliding_attention" not in types:
            return {"sliding_window": None}
        freq = next((k for k in range(1, n + 2) if types == [
            "sliding_attention" if (i + 1) % k else "full_attention" for i in range(n)]), None)
        if window is None or freq is None:
            raise ConfigError(f"{family} layer_types {types} (sliding_window {window}) are not "
                              f"supported: megalite makes every N-th layer full attention "
                              f"(--window-attn-skip-freq N) and windows the others")
        return {"sliding_window": window, "window_attn_skip_freq": freq if freq <= n else None}
    if rule != "qwen":
        return {}
    types = getattr(c, "layer_types", None) or [  # older transformers: no layer_types
        "sliding_attention" if getattr(c, "use_sliding_window", False)
        and i >= c.max_window_layers else "full_attention" for i in range(c.num_hidden_layers)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConfigError(f"{family} layer_types {unknown} are not supported (full_attention and "
                          f"sliding_attention are)")
    windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if window is None or not windowed:
        return {"sliding_window": None, "max_window_layers": 0}
    if windowed != list(range(windowed[0], len(types))):
        raise ConfigError(f"{family} layer_types window layers {windowed}: megalite can window "
                          f"only a contiguous last range of layers (--max-window-layers N)")
    return {"sliding_window": window, "max_window_layers": windowed[0]}


def _hf_window(cfg: ModelConfig, fam: Family) -> dict:
    if fam.window == "mistral":
        return {"sliding_window": cfg.sliding_window}
    if fam.window == "qwen":  # layers >= max_window_layers get the window when it is used
        window = cfg.sliding_window is not None
        return {"use_sliding_window": window, "sliding_window": cfg.sliding_window,
                "max_window_layers": cfg.max_window_layers if window else cfg.num_layers}
    if fam.window == "skip":
        return {"sliding_window": cfg.sliding_window, "layer_types": [
            "full_attention" if cfg.attention_window(i) is None else "sliding_attention"
            for i in range(cfg.num_layers)]}
    return {}


def layer_freq_text(pattern: List[bool]) -> str:
    """A per-layer MoE pattern as --moe-layer-freq spells it ("1", or Megatron's 0/1 list)."""
    if all(pattern):
        return "1"
    return "[" + ",".join(str(int(x)) for x in pattern) + "]"


def _hf_moe_pattern(c, m: MoeSpec) -> List[bool]:
    """Which HF layers are MoE (docs/models.md, "The layer pattern")."""
    n = c.num_hidden_layers
    if m.layers == "sparse_step":
        step, dense = c.decoder_sparse_step, set(getattr(c, "mlp_only_layers", None) or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(n)]
    if m.layers == "first_k_dense":
        return [i >= c.first_k_dense_replace for i in range(n)]
    return [True] * n


def _hf_pattern_fields(pattern: List[bool], m: MoeSpec, arch: str, freq: str) -> dict:
    """Inverse of :func:`_hf_moe_pattern`."""
    n = len(pattern)
    if m.layers == "all":
        if not all(pattern):
            raise ConfigError(f"{arch} makes every layer MoE; --moe-layer-freq {freq} has dense "
                              f"layers")
        return {}
    if m.layers == "first_k_dense":
        k = pattern.index(True) if any(pattern) else n
        if pattern != [False] * k + [True] * (n - k):
            raise ConfigError(f"{arch}'s dense layers are the first first_k_dense_replace; "
                              f"--moe-layer-freq {freq} is not dense first, then MoE")
        return {"first_k_dense_replace": k}
    # the step that needs the fewest mlp_only_layers (the smallest such step on a tie)
    best = None
    for step in range(1, n + 2):
        if all((i + 1) % step == 0 for i in range(n) if pattern[i]):
            only = [i for i in range(n) if (i + 1) % step == 0 and not pattern[i]]
            if best is None or len(only) < len(best[1]):
                best = (step, only)
    return {"decoder_sparse_step": best[0], "mlp_only_layers": best[1]}


def _moe(c, family: str) -> dict:
    """The MoE block of an HF config as ModelConfig fields (empty for a dense family)."""
    m = FAMILIES[family].moe
    if m is None:
        return {}
    experts, f = getattr(c, m.num_experts), getattr(c, m.expert_ffn)
    if not experts:
        raise ConfigError(f"{family} {m.num_experts}={experts}: megalite imports a model without "
                          f"experts as its dense family")
    k = c.num_experts_per_tok
    norm = True if m.norm_topk_prob is None else bool(getattr(c, m.norm_topk_prob))
    out = dict(num_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=f,
               moe_layer_freq=layer_freq_text(_hf_moe_pattern(c, m)))
    if m.stacked:
        out["moe_router_linear_bias"] = True
    if m.router == "softmax":
        # renormalised softmax top-k = a softmax over the k chosen logits (megalite's default);
        # the plain top-k of a softmax over all experts is --moe-router-pre-softmax
        out["moe_router_pre_softmax"] = not norm
    else:
        if norm and k == 1:  # HF divides the one gate by itself; Megatron keeps it raw at k = 1
            raise ConfigError(f"{family} num_experts_per_tok=1 with norm_topk_prob=True (a gate "
                              f"of 1 for every token) is not supported")
        scale = float(c.routed_scaling_factor)
        out.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_norm_topk_prob=norm,
                   moe_router_topk_scaling_factor=None if scale == 1.0 else scale)
        if c.n_group > 1:  # one group limits nothing
            out.update(moe_router_num_groups=c.n_group, moe_router_group_topk=c.topk_group,
                       moe_router_group_score="top2_sum")
    if m.shared_size:
        out["moe_shared_expert_intermediate_size"] = getattr(c, m.shared_size)
    elif m.shared_count:
        n = getattr(c, m.shared_count)
        if not n:
            raise ConfigError(f"{family} {m.shared_count}={n} is not supported (HF still builds "
                              f"an empty shared expert)")
        out["moe_shared_expert_intermediate_size"] = n * f
    out["moe_shared_expert_gate"] = m.shared_gate is not None
    return out


def _hf_moe(cfg: ModelConfig, m: MoeSpec, arch: str) -> dict:
    f = cfg.moe_ffn_hidden_size
    out = {m.num_experts: cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
           m.expert_ffn: f}
    out.update(_hf_pattern_fields(cfg.moe_layer_pattern(), m, arch, cfg.moe_layer_freq))
    if m.router == "softmax":
        norm = not cfg.moe_router_pre_softmax
    else:
        norm = cfg.moe_router_norm_topk_prob
        out.update(n_group=cfg.moe_router_num_groups or 1,
                   topk_group=cfg.moe_router_group_topk or 1,
                   routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0)
    if m.norm_topk_prob:
        out[m.norm_topk_prob] = norm
    shared = cfg.moe_shared_expert_intermediate_size
    if m.shared and (not shared or (m.shared_gate is not None) != cfg.moe_shared_expert_gate):
        raise ConfigError(f"{arch} always has a shared expert"
                          f"{' with a sigmoid gate' if m.shared_gate else ' and no gate'}: "
                          f"--moe-shared-expert-intermediate-size"
                          f"{' and --moe-shared-expert-gate' if m.shared_gate else ''}")
    if m.shared_size:
        out[m.shared_size] = shared
    elif m.shared_count:
        if shared % f:
            raise ConfigError(f"{arch}'s shared experts are a whole number of experts wide: "
                              f"--moe-shared-expert-intermediate-size {shared} is not a multiple "
                              f"of --moe-ffn-hidden-size {f}")
        out[m.shared_count] = shared // f
    return out


def _mla(c, family: str) -> dict:
    """DeepSeek's multi-latent attention as ModelConfig fields (empty for other families)."""
    if not FAMILIES[family].mla:
        return {}
    if c.num_key_value_heads != c.num_attention_heads:
        raise ConfigError(f"{family} num_key_value_heads={c.num_key_value_heads} must equal "
                          f"num_attention_heads ({c.num_attention_heads}): MLA has no query "
                          f"groups")
    if c.rms_norm_eps != 1e-6:
        # HF builds the two latent norms with RMSNorm's default eps, megalite with norm_epsilon
        raise ConfigError(f"{family} rms_norm_eps={c.rms_norm_eps} is not supported: HF's latent "
                          f"norms use 1e-6 whatever it says, megalite one epsilon (1e-6 is)")
    return dict(multi_latent_attention=True, q_lora_rank=c.q_lora_rank,
                kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_nope_head_dim,
                qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim)


def _hf_mla(cfg: ModelConfig) -> dict:
    if not cfg.multi_latent_attention:
        return {}
    # RoPE rows interleaved: HF's default, which DeepSeek's checkpoints use
    return dict(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_head_dim, qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
                v_head_dim=cfg.v_head_dim, rope_interleave=True)


_LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim")  # one name on both sides


def _linear(c, family: str) -> dict:
    """HF's layer_types (Gated DeltaNet or gated softmax layers) as ModelConfig fields: the
    pattern as an interval where one matches (docs/models.md, "Hybrid families")."""
    if FAMILIES[family].linear is None:
        return {}
    mtp = getattr(c, "mtp_num_hidden_layers", 0) or 0
    if mtp > 1:  # megalite's depths each have their own norms and projection
        raise ConfigError(f"{family} mtp_num_hidden_layers={mtp} is not supported: Qwen's depths "
                          f"share one set of mtp.* norms and fc; 0 or 1 is supported")
    if mtp and c.layer_types[-1] != "full_attention":
        raise ConfigError(f"{family} mtp_num_hidden_layers=1 with a last layer of kind "
                          f"{c.layer_types[-1]} is not supported: Qwen's MTP layer is full "
                          f"attention, megalite's is of the last layer's kind")
    unknown = sorted(set(c.layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"{family} layer_types {unknown} are not supported (linear_attention "
                          f"and full_attention are)")
    p = [t == "linear_attention" for t in c.layer_types]
    freq = next((str(n) for n in range(1, len(p) + 2)
                 if p == [(i + 1) % n != 0 for i in range(len(p))]), None)
    return dict(linear_attention_freq=freq or "[" + ",".join(str(int(x)) for x in p) + "]",
                attention_output_gate=True, apply_layernorm_1p=True,
                **{k: getattr(c, k) for k in _LINEAR_FIELDS})


def hf_config_to_model_config(hf_config, **overrides) -> ModelConfig:
    """The megalite ModelConfig of a supported family's HF config (``overrides``, any ModelConfig
    field, win); a config field megalite cannot hold is a ConfigError naming it."""
    family = hf_family(hf_config)
    fam = FAMILIES[family]
    c = hf_config.text_config if hf_config.model_type in WRAPPERS else hf_config
    if family == "gpt2":
        act = _GPT2_ACTIVATIONS.get(c.activation_function)
        if act is None:
            raise ConfigError(f"GPT-2 activation_function {c.activation_function!r} is not "
                              f"supported; use one of {sorted(_GPT2_ACTIVATIONS)}")
        if (not getattr(c, "scale_attn_weights", True)
                or getattr(c, "scale_attn_by_inverse_layer_idx", False)
                or getattr(c, "add_cross_attention", False)):
            raise ConfigError("GPT-2 configs with scale_attn_weights=False, "
                              "scale_attn_by_inverse_layer_idx=True or add_cross_attention=True "
                              "are not supported (megalite scales attention by 1/sqrt(d) only)")
        kwargs = dict(
            num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
            ffn_hidden_size=c.n_inner or 4 * c.n_embd, seq_length=c.n_positions,
            max_position_embeddings=c.n_positions, position_embedding_type="learned_absolute",
            normalization="LayerNorm", norm_epsilon=c.layer_norm_epsilon, activation=act,
            swiglu=False, add_bias_linear=True, add_qkv_bias=True,
            untie_embeddings_and_output_weights=not getattr(c, "tie_word_embeddings", True),
            hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop)
    else:
        if c.hidden_act != "silu":
            raise ConfigError(f"{family} hidden_act {c.hidden_act!r} is not supported; megalite's "
                              f"SwiGLU uses silu")
        for name, only in fam.refused:
            value = getattr(c, name, only)
            if value != only:
                raise ConfigError(f"{family} {name}={value!r} is not supported (megalite has no "
                                  f"equivalent; {name}={only!r} is)")
        attention_bias = bool(getattr(c, "attention_bias", False))
        if fam.linear_bias:
            # GPT-OSS has no mlp_bias: its experts always have biases
            mlp_bias = bool(getattr(c, "mlp_bias", fam.moe is not None and fam.moe.stacked))
            if attention_bias != mlp_bias:
                # one switch (add_bias_linear) biases o_proj and both MLP linears
                raise ConfigError(f"{family} attention_bias={attention_bias} with mlp_bias="
                                  f"{mlp_bias} is not supported: megalite needs both equal "
                                  f"(add_bias_linear)")
            qkv_bias = linear_bias = attention_bias
        else:
            if attention_bias and fam.qkv_bias != "attention_bias":
                # Qwen3's (OLMoE's) attention_bias biases o_proj too, which megalite ties to the
                # MLP biases (add_bias_linear) these families do not have
                raise ConfigError(f"{family} attention_bias=True (a bias on o_proj as well as "
                                  f"q/k/v) is not supported: megalite biases o_proj only with "
                                  f"the MLP")
            qkv_bias = (bool(getattr(c, fam.qkv_bias, False)) if isinstance(fam.qkv_bias, str)
                        else fam.qkv_bias)
            linear_bias = False
        heads = c.num_attention_heads
        kv_channels = getattr(c, "head_dim", None) or c.hidden_size // heads
        qk_norm = fam.qk_norm is not None and (
            fam.qk_norm_field is None or bool(getattr(c, fam.qk_norm_field)))
        if fam.qk_norm == "projection" and kv_channels * heads != c.hidden_size:
            # HF sizes OLMoE's q norm by hidden_size, its k norm by hidden_size / heads per head
            raise ConfigError(f"{family} head_dim={kv_channels} must be hidden_size / "
                              f"num_attention_heads ({c.hidden_size // heads}): its q/k norms "
                              f"are sized by hidden_size")
        kwargs = dict(
            num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads,
            num_query_groups=getattr(c, "num_key_value_heads", None) or heads,
            kv_channels=kv_channels,
            ffn_hidden_size=c.intermediate_size, seq_length=c.max_position_embeddings,
            max_position_embeddings=c.max_position_embeddings,
            position_embedding_type="rope", normalization="RMSNorm",
            norm_epsilon=c.rms_norm_eps, activation="silu", swiglu=True,
            add_bias_linear=linear_bias, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm,
            qk_layernorm_scope=fam.qk_norm if qk_norm else "head",
            # a wrapper ties by its own field, whatever its text_config says
            untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings",
                                                            False),
            hidden_dropout=0.0, attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
            attention_sinks=fam.sinks, **{k: getattr(c, k) for k in _CLAMP if hasattr(c, k)},
            **_rope(c, family), **_sliding_window(c, family), **_moe(c, family), **_mla(c, family),
            **_linear(c, family))
    kwargs.update(vocab_size=c.vocab_size, init_method_std=c.initializer_range,
                  mtp_num_layers=(fam.mtp_field and getattr(c, fam.mtp_field, 0)) or None)
    kwargs.update(hf_architecture=fam.architecture, **overrides)
    return ModelConfig(**kwargs).validate()


# GPT-OSS's clamped SwiGLU: one name on both sides
_CLAMP = ("swiglu_limit", "swiglu_alpha")
# The ModelConfig fields an HF config does not carry: they are the megalite run's own.
_NOT_CARRIED = ("seq_length", "make_vocab_size_divisible_by", "hf_architecture")


def _carried(cfg: ModelConfig) -> dict:
    """The fields that define the model an HF config describes, each value in one spelling: two
    configs describe the same model exactly when these are equal."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)
           if f.metadata["role"] in (SHAPE, CHECKPOINT_ARG) and f.name not in _NOT_CARRIED}
    out["moe_layer_freq"] = cfg.moe_layer_pattern()  # "1" and "[1,1]" are one pattern
    unused = []  # fields that change nothing in this model
    if cfg.rope_scaling_factor is None:
        unused += [v for v in _LLAMA3_ROPE.values() if v != "rope_scaling_factor"]
    if cfg.sliding_window is None:
        unused += ["max_window_layers", "window_attn_skip_freq"]
    if cfg.swiglu_limit is None:
        unused.append("swiglu_alpha")
    if cfg.multi_latent_attention:
        unused.append("kv_channels")  # MLA's heads have their own widths
    out["linear_attention_freq"] = cfg.linear_attention_pattern()  # "2" is "[1,0]" at 2 layers
    if not any(out["linear_attention_freq"]):
        unused += _LINEAR_FIELDS
    if cfg.num_experts is None:
        unused += [k for k in out if k.startswith("moe_")]
    else:
        if all(out["moe_layer_freq"]):
            unused.append("ffn_hidden_size")  # no dense layer
        if cfg.moe_router_num_groups is None:
            unused.append("moe_router_group_score")
        unused.append("moe_router_pre_softmax" if cfg.moe_router_score_function == "sigmoid"
                      else "moe_router_norm_topk_prob")
        if out["moe_router_topk_scaling_factor"] == 1.0:
            out["moe_router_topk_scaling_factor"] = None  # a factor of 1 scales nothing
    for k in unused:
        out.pop(k, None)
    return out


def _cannot_hold(cfg: ModelConfig, family: str) -> Optional[str]:
    """Why HF ``family`` cannot hold this llama-layout model (None if it can): its export, read
    back, must be the same model."""
    try:
        back = hf_config_to_model_config(
            _hf_config(cfg, family), seq_length=cfg.seq_length,
            make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by)
    except ConfigError as e:
        return str(e)
    want, got = _carried(cfg), _carried(back)
    diff = [k for k in want if want[k] != got.get(k)]
    if not diff:
        return None
    return "it would read back as " + ", ".join(f"{k}={got.get(k)!r} (not {want[k]!r})"
                                               for k in diff[:3])


def hf_architecture(cfg: ModelConfig) -> str:
    """The HF class a megalite model exports as: the one it was imported from
    (``cfg.hf_architecture``), else the first family of :data:`FAMILIES` that holds it."""
    if model_family(cfg) == "gpt2":
        if cfg.qk_layernorm or cfg.sliding_window is not None or cfg.mtp_num_layers:
            raise ConfigError("GPT2LMHeadModel has no q/k norm, sliding window or MTP layers: "
                              "drop --qk-layernorm / --sliding-window / --mtp-num-layers to "
                              "export as GPT-2")
        if cfg.num_experts is not None:
            raise ConfigError("GPT2LMHeadModel has no experts: a mixture-of-experts model "
                              "exports as a Llama-layout family (rope, RMSNorm, SwiGLU)")
        return "GPT2LMHeadModel"
    families = [f for f, fam in FAMILIES.items() if fam.layout == "llama"]
    recorded = _FAMILY_OF_ARCHITECTURE.get(cfg.hf_architecture)
    if recorded in families:
        why = _cannot_hold(cfg, recorded)
        if why is not None:
            raise ConfigError(f"this model cannot be exported as {cfg.hf_architecture}, which it "
                              f"was imported from: {why}")
        return cfg.hf_architecture
    reasons = []
    for f in families:
        why = _cannot_hold(cfg, f)
        if why is None:
            return FAMILIES[f].architecture
        reasons.append(f"{FAMILIES[f].architecture}: {why}")
    raise ConfigError("no Hugging Face architecture holds this model (" + "; ".join(reasons)
                      + ")")


def _hf_config(cfg: ModelConfig, family: str, **hf_overrides):
    """The HF config of llama-layout ``family`` for a megalite model (no check that it holds it:
    :func:`hf_architecture` reads it back for that)."""
    import transformers

    fam = FAMILIES[family]
    arch = fam.architecture
    if cfg.activation != "silu":
        raise ConfigError(f"{arch}'s MLP is SwiGLU with silu, got {cfg.activation!r}")
    config_cls = transformers.CONFIG_MAPPING[family]  # the family is HF's model_type
    kwargs = dict(
        num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
        intermediate_size=cfg.ffn_hidden_size,
        max_position_embeddings=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.norm_epsilon, hidden_act="silu",
        attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **_hf_rope(cfg, config_cls, fam))
    if not fam.mla and (_accepts(config_cls, "head_dim")
                        or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size):
        kwargs["head_dim"] = cfg.kv_channels
    if fam.mla:
        kwargs.update(_hf_mla(cfg))
    if fam.linear_bias:
        kwargs["attention_bias"] = cfg.add_bias_linear
        if _accepts(config_cls, "mlp_bias"):
            kwargs["mlp_bias"] = cfg.add_bias_linear
    elif isinstance(fam.qkv_bias, str):
        kwargs[fam.qkv_bias] = cfg.add_qkv_bias
    if fam.qk_norm_field:
        kwargs[fam.qk_norm_field] = cfg.qk_layernorm
    kwargs.update(_hf_window(cfg, fam))
    kwargs.update({k: getattr(cfg, k) for k in _CLAMP
                   if _accepts(config_cls, k) and getattr(cfg, k) is not None})
    if fam.moe is not None and cfg.num_experts is not None:
        kwargs.update(_hf_moe(cfg, fam.moe, arch))
    if fam.mtp_field and (cfg.mtp_num_layers or not fam.linear):  # Qwen's classes lack the field
        kwargs[fam.mtp_field] = cfg.mtp_num_layers or 0
    if fam.linear:
        kwargs.update(layer_types=["linear_attention" if x else "full_attention"
                                   for x in cfg.linear_attention_pattern()],
                      **{k: getattr(cfg, k) for k in _LINEAR_FIELDS})
    kwargs.update(hf_overrides)
    return _finish(config_cls(**kwargs), arch, cfg)


def _finish(hf_config, arch: str, cfg: ModelConfig):
    hf_config.architectures = [arch]
    # transformers 5 spells the weight dtype "dtype", older versions "torch_dtype".
    setattr(hf_config, "dtype" if "dtype" in hf_config.to_dict() else "torch_dtype",
            cfg.params_dtype)
    return hf_config


def model_config_to_hf_config(cfg: ModelConfig, **hf_overrides):
    """The HF config (of the class :func:`hf_architecture` picks; ``hf_overrides`` win), with
    ``architectures`` set so ``AutoModelForCausalLM`` picks the LM-head class."""
    import transformers

    arch = hf_architecture(cfg)
    if _FAMILY_OF_ARCHITECTURE.get(arch) == "gpt_oss":
        warnings.warn(f"{arch}: the experts are written unquantised ({cfg.params_dtype}), not in "
                      f"MXFP4 as OpenAI's hub files hold them", stacklevel=2)
    if model_family(cfg) != "gpt2":
        return _hf_config(cfg, _FAMILY_OF_ARCHITECTURE[arch], **hf_overrides)
    if cfg.num_query_groups != cfg.num_attention_heads:
        raise ConfigError("GPT2LMHeadModel has no grouped-query attention: "
                          "--num-query-groups must equal --num-attention-heads")
    if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        raise ConfigError("GPT2LMHeadModel needs --kv-channels = hidden size / heads")
    if not (cfg.add_bias_linear and cfg.add_qkv_bias):
        raise ConfigError("GPT2LMHeadModel has biases on every linear layer: "
                          "--disable-bias-linear / no QKV bias cannot be exported as GPT-2")
    act = _GPT2_ACTIVATIONS_BACK.get(cfg.activation)
    if act is None:
        raise ConfigError(f"activation {cfg.activation!r} has no GPT-2 equivalent; use one of "
                          f"{sorted(_GPT2_ACTIVATIONS_BACK)}")
    kwargs = dict(
        n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
        n_inner=cfg.ffn_hidden_size, n_positions=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size, layer_norm_epsilon=cfg.norm_epsilon,
        activation_function=act, resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout, initializer_range=cfg.init_method_std,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None)
    kwargs.update(hf_overrides)
    return _finish(transformers.GPT2Config(**kwargs), "GPT2LMHeadModel", cfg)


# ============================================================================ key names per layer
# megalite suffix -> (HF suffix, whether a Conv1D weight, stored transposed)
_GPT2_LAYER = {f"{ml}.{kind}": (f"{hf}.{kind}", conv1d and kind == "weight")
               for ml, hf, conv1d in (("input_layernorm", "ln_1", False),
                                      ("self_attention.linear_proj", "attn.c_proj", True),
                                      ("pre_mlp_layernorm", "ln_2", False),
                                      ("mlp.linear_fc1", "mlp.c_fc", True),
                                      ("mlp.linear_fc2", "mlp.c_proj", True))
               for kind in ("weight", "bias")}
_LLAMA_LAYER = {  # one-to-one tensors; qkv and the MLPs are fused / stacked below
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3, OLMoE, GLM-4.5
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.sinks": "self_attn.sinks",
}
_STACKED_EXPERTS = {"mlp.weight1": "experts.gate_up_proj", "mlp.bias1": "experts.gate_up_proj_bias",
                    "mlp.weight2": "experts.down_proj", "mlp.bias2": "experts.down_proj_bias"}
_SWIGLU = ("gate_proj", "up_proj", "down_proj")  # HF's dense and shared-expert MLP linears
_LINEAR_LAYER = {  # a Gated DeltaNet layer's tensors that map one to one
    "self_attention.A_log": "linear_attn.A_log", "self_attention.dt_bias": "linear_attn.dt_bias",
    "self_attention.norm_weight": "linear_attn.norm.weight",
    "self_attention.out_proj.weight": "linear_attn.out_proj.weight",
}
_LINEAR_REGROUPED = ("in_proj.weight", "conv_weight")  # per key-head group: _linear_from_hf
# an MTP depth's own tensors, megalite -> HF in DeepSeek-V3's layout and in Qwen's (docs/models.md,
# "Multi-token prediction")
_MTP = {"enorm": ("enorm", "pre_fc_norm_embedding"), "hnorm": ("hnorm", "pre_fc_norm_hidden"),
        "eh_proj": ("eh_proj", "fc"), "final_layernorm": ("shared_head.norm", "norm")}
_MLA_LAYER = {  # DeepSeek-V3's attention, one to one (RoPE rows permuted: _rope_pairs)
    "self_attention.mla.linear_q_proj.weight": "self_attn.q_proj.weight",  # no q latent
    "self_attention.mla.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.mla.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.mla.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.mla.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.mla.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.mla.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}


def _hf_layer_prefix(i: int, cfg: ModelConfig) -> str:
    if model_family(cfg) == "gpt2":
        return f"transformer.h.{i}."
    k = i - cfg.num_layers
    return f"mtp.layers.{k}." if k >= 0 and _qwen_mtp(cfg) else f"model.layers.{i}."


def _qwen_mtp(cfg: ModelConfig) -> bool:
    """Whether the MTP depths convert in Qwen's layout (mtp.*, the hybrid families'), not in
    DeepSeek-V3's (model.layers.{L+k}.*)."""
    return bool(cfg.mtp_num_layers) and _family_part(cfg, "linear") is not None


def _layer_prefix(i: int, cfg: ModelConfig) -> str:
    """megalite's prefix of global layer i: past the last, MTP depth i - L's transformer layer
    (HF numbers it as one more decoder layer)."""
    k = i - cfg.num_layers
    return f"layers.{i}." if k < 0 else f"mtp.layers.{k}.transformer_layer."


def _mtp_layers(cfg: ModelConfig, names: Optional[Sequence[str]] = None) -> List[int]:
    """Global numbers L + k of the MTP depths' transformer layers (those ``names`` asks for)."""
    return [i for i in range(cfg.num_layers, cfg.num_layers + (cfg.mtp_num_layers or 0))
            if names is None or any(n.startswith(_layer_prefix(i, cfg)) for n in names)]


def _has_bias(cfg: ModelConfig, megalite_suffix: str) -> bool:
    """Whether the tensor exists in this model (named for the biases, most of which may not)."""
    if "q_layernorm" in megalite_suffix or "k_layernorm" in megalite_suffix:
        return cfg.qk_layernorm
    if megalite_suffix.endswith("sinks"):
        return cfg.attention_sinks
    if megalite_suffix.endswith(".weight"):
        return True
    if "layernorm" in megalite_suffix:
        return cfg.normalization == "LayerNorm"
    if "linear_qkv" in megalite_suffix:
        return bool(cfg.add_qkv_bias)
    return bool(cfg.add_bias_linear)


_ATTENTION_SUFFIXES = (
    "input_layernorm.weight", "input_layernorm.bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.sinks",
    "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias")
_MLP_SUFFIXES = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                 "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")


def _moe_suffixes(cfg: ModelConfig) -> List[str]:
    """megalite/moe/layer.py's tensors of an MoE layer (the expert bias is a buffer)."""
    out = ["mlp.router"] + (["mlp.router_bias"] if cfg.moe_router_linear_bias else [])
    out += ["mlp.expert_bias"] if cfg.moe_router_enable_expert_bias else []
    out += ["mlp.weight1", "mlp.weight2"] + (["mlp.bias1", "mlp.bias2"] if cfg.add_bias_linear
                                             else [])
    if cfg.moe_shared_expert_intermediate_size:
        out += [s.replace("mlp.", "mlp.shared_expert.") for s in _MLP_SUFFIXES
                if _has_bias(cfg, s)]
        if cfg.moe_shared_expert_gate:
            out.append("mlp.shared_gate")
    return out


def _mla_items(cfg: ModelConfig) -> List[Tuple[str, str]]:
    """(megalite, HF) suffixes of an MLA layer's attention tensors (q projection or q latent)."""
    drop = (("linear_q_down_proj", "q_layernorm", "linear_q_up_proj") if cfg.q_lora_rank is None
            else ("linear_q_proj",))
    return [(ml, hf) for ml, hf in _MLA_LAYER.items() if ml.split(".")[2] not in drop]


def _rope_pairs(t: torch.Tensor, cfg: ModelConfig, name: str, back: bool = False):
    """HF's interleaved RoPE rows -> the rotate-half order, or ``back``, in the tensors that hold
    them (docs/models.md, "Hugging Face" under "Multi-latent attention")."""
    dn, dr, rkv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.kv_lora_rank
    if name.endswith(("linear_q_proj.weight", "linear_q_up_proj.weight")):
        width = dn + dr
    elif name.endswith("linear_kv_down_proj.weight"):
        width = rkv + dr
    else:
        return t
    order = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
    if back:
        order = torch.argsort(order)
    blocks = t.reshape((-1, width) + tuple(t.shape[1:]))
    out = blocks.clone()
    out[:, width - dr:] = blocks[:, width - dr + order]
    return out.reshape(t.shape)


def megalite_layer_keys(layer_idx: int, cfg: ModelConfig) -> List[str]:
    """Full megalite names of layer ``layer_idx``'s tensors, in a fixed order."""
    mla, linear = cfg.multi_latent_attention, cfg.is_linear_attention_layer(layer_idx)
    suffixes = [s for s in _ATTENTION_SUFFIXES if _has_bias(cfg, s)
                and not (mla and "linear_qkv" in s) and not (linear and "self_attention" in s)]
    suffixes += [ml for ml, _ in _mla_items(cfg)] if mla else []
    if linear:
        suffixes += list(_LINEAR_LAYER) + [f"self_attention.{n}" for n in _LINEAR_REGROUPED]
    if cfg.is_moe_layer(layer_idx):
        suffixes += _moe_suffixes(cfg)
    else:
        suffixes += [s for s in _MLP_SUFFIXES if _has_bias(cfg, s)]
    return [_layer_prefix(layer_idx, cfg) + s for s in suffixes]


@lru_cache(maxsize=64)
def _family_of(cfg_items: tuple) -> Family:
    cfg = ModelConfig(**dict(cfg_items))
    return FAMILIES[_FAMILY_OF_ARCHITECTURE[hf_architecture(cfg)]]


def _family_part(cfg: ModelConfig, part: str):
    """``part`` ("moe" or "linear") of the family this model converts as: the recorded one's
    when it has one, else that of :func:`hf_architecture`'s family (cached)."""
    recorded = FAMILIES.get(_FAMILY_OF_ARCHITECTURE.get(cfg.hf_architecture))
    if recorded is not None and getattr(recorded, part) is not None:
        return getattr(recorded, part)
    return getattr(_family_of(tuple(sorted(cfg.to_dict().items()))), part)


def _moe_spec(cfg: ModelConfig) -> MoeSpec:
    return _family_part(cfg, "moe")


def _linear_in(cfg: ModelConfig) -> Tuple[str, ...]:
    """HF's in projections of a Gated DeltaNet layer."""
    if _family_part(cfg, "linear") == "fused":
        return ("in_proj_qkvz", "in_proj_ba")
    return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _linear_keys(prefix: str, bias: bool, names: Sequence[str] = _SWIGLU) -> List[str]:
    return [f"{prefix}{n}.{kind}" for n in names for kind in ("weight", "bias")[:1 + bias]]


def _layer_pairs(layer_idx: int, cfg: ModelConfig) -> List[Tuple[str, str]]:
    """(megalite, HF) suffixes of layer ``layer_idx``'s tensors that map one to one (GPT-2's
    Conv1D weights transposed, MLA's RoPE rows permuted: :func:`_one_to_one`)."""
    if model_family(cfg) == "gpt2":
        return [(ml, hf) for ml, (hf, _) in _GPT2_LAYER.items()]
    linear = cfg.is_linear_attention_layer(layer_idx)
    pairs = [(ml, hf) for ml, hf in _LLAMA_LAYER.items() if _has_bias(cfg, ml)
             and not (linear and "self_attention" in ml)]
    pairs += _mla_items(cfg) if cfg.multi_latent_attention else []
    pairs += list(_LINEAR_LAYER.items()) if linear else []
    if cfg.is_moe_layer(layer_idx):
        m = _moe_spec(cfg)
        pairs.append(("mlp.router", f"{m.block}.{m.gate}.weight"))
        if cfg.moe_router_linear_bias:
            pairs.append(("mlp.router_bias", f"{m.block}.{m.gate}.bias"))
        if m.stacked:  # GPT-OSS's experts: one tensor each (gate and up interleaved: _one_to_one)
            pairs += [(ml, f"{m.block}.{hf}") for ml, hf in _STACKED_EXPERTS.items()
                      if "weight" in ml or cfg.add_bias_linear]
        if cfg.moe_router_enable_expert_bias:
            pairs.append(("mlp.expert_bias", f"{m.block}.gate.e_score_correction_bias"))
        if cfg.moe_shared_expert_intermediate_size and cfg.moe_shared_expert_gate:
            pairs.append(("mlp.shared_gate", f"{m.block}.{m.shared_gate}.weight"))
    return pairs


def _one_to_one(t: torch.Tensor, ml: str, cfg: ModelConfig, back: bool = False) -> torch.Tensor:
    if model_family(cfg) == "gpt2":
        return t.t().contiguous() if _GPT2_LAYER[ml][1] else t
    if ml.endswith(("weight1", "bias1")):  # GPT-OSS's [g0, u0, g1, u1, ...] <-> [gate | up]
        return (torch.stack(t.chunk(2, -1), -1).flatten(-2) if back
                else torch.cat([t[..., ::2], t[..., 1::2]], -1))
    return _rope_pairs(t, cfg, ml, back) if cfg.multi_latent_attention else t


def _experts_hf_keys(p: str, cfg: ModelConfig) -> List[str]:
    m = _moe_spec(cfg)
    keys = [f"{p}{m.block}.experts.{e}.{n}.weight" for e in range(cfg.num_experts)
            for n in m.expert_names if not m.stacked]
    if cfg.moe_shared_expert_intermediate_size:
        keys += _linear_keys(f"{p}{m.block}.{m.shared}.", cfg.add_bias_linear)
    return keys


def hf_layer_keys(layer_idx: int, cfg: ModelConfig) -> List[str]:
    """Full HF names of layer ``layer_idx``'s tensors (what a streaming reader must load)."""
    family = model_family(cfg)
    p = _hf_layer_prefix(layer_idx, cfg)
    keys = [hf for _, hf in _layer_pairs(layer_idx, cfg)]
    if family == "gpt2":
        return [p + k for k in keys + ["attn.c_attn.weight", "attn.c_attn.bias"]]
    if cfg.is_linear_attention_layer(layer_idx):
        keys += [f"linear_attn.{n}.weight" for n in _linear_in(cfg) + ("conv1d",)]
    elif not cfg.multi_latent_attention:
        keys += _linear_keys("self_attn.", cfg.add_qkv_bias, ("q_proj", "k_proj", "v_proj"))
    if cfg.is_moe_layer(layer_idx):
        return [p + k for k in keys] + _experts_hf_keys(p, cfg)
    return [p + k for k in keys + _linear_keys("mlp.", cfg.add_bias_linear)]


def megalite_non_layer_keys(cfg: ModelConfig) -> List[str]:
    keys = [EMBEDDING_WEIGHT_NAME]
    if cfg.position_embedding_type == "learned_absolute":
        keys.append("embedding.position_embeddings.weight")
    keys.append("final_layernorm.weight")
    if cfg.normalization == "LayerNorm":
        keys.append("final_layernorm.bias")
    if cfg.untie_embeddings_and_output_weights:
        keys.append(OUTPUT_WEIGHT_NAME)
    for i in _mtp_layers(cfg):  # each MTP depth's norms and projection, then its layer
        keys += [f"mtp.layers.{i - cfg.num_layers}.{n}.weight" for n in _MTP]
        keys += megalite_layer_keys(i, cfg)
    return keys


def _non_layer_map(cfg: ModelConfig) -> Dict[str, str]:
    """megalite name -> HF name for the tensors outside the transformer layers."""
    if model_family(cfg) == "gpt2":
        m = {EMBEDDING_WEIGHT_NAME: "transformer.wte.weight",
             "embedding.position_embeddings.weight": "transformer.wpe.weight",
             "final_layernorm.weight": "transformer.ln_f.weight",
             "final_layernorm.bias": "transformer.ln_f.bias",
             OUTPUT_WEIGHT_NAME: "lm_head.weight"}
    else:
        m = {EMBEDDING_WEIGHT_NAME: "model.embed_tokens.weight",
             "final_layernorm.weight": "model.norm.weight",
             OUTPUT_WEIGHT_NAME: "lm_head.weight"}
        qwen = _qwen_mtp(cfg)  # one depth at most (_linear), its tensors under mtp.
        m.update({f"mtp.layers.{i - cfg.num_layers}.{ml}.weight":
                  f"mtp.{hf[1]}.weight" if qwen else f"model.layers.{i}.{hf[0]}.weight"
                  for i in _mtp_layers(cfg) for ml, hf in _MTP.items()})
    return {k: m[k] for k in megalite_non_layer_keys(cfg) if k in m}


def hf_non_layer_keys(cfg: ModelConfig, names: Optional[Sequence[str]] = None) -> List[str]:
    """HF names of the non-layer tensors (of megalite ``names`` only, if given)."""
    m = _non_layer_map(cfg)
    keys = [m[k] for k in (m if names is None else names) if k in m]
    return keys + [k for i in _mtp_layers(cfg, names) for k in hf_layer_keys(i, cfg)]


def mtp_copies(cfg: ModelConfig) -> Dict[str, str]:
    """HF name -> HF name of the tensor it repeats: the embedding and output head that DeepSeek's
    hub files hold again in each MTP layer (Qwen's do not). The import reads the model's own; the
    export writes the copies back."""
    if _qwen_mtp(cfg):
        return {}
    embedding = "model.embed_tokens.weight"
    head = embedding if cfg.tie_embeddings else "lm_head.weight"
    return {f"model.layers.{i}.{n}": main for i in _mtp_layers(cfg) for n, main in
            (("embed_tokens.weight", embedding), ("shared_head.head.weight", head))}


# ===================================================================== fused QKV: group layout
def group_cat(parts: Sequence[torch.Tensor], g: int) -> torch.Tensor:
    """Tensors [g*w_i, ...] of g groups each -> one new [g * sum(w_i), ...], the parts' rows of
    group 0, then of group 1, ..."""
    rest = tuple(parts[0].shape[1:])
    return torch.cat([t.reshape((g, -1) + rest) for t in parts], 1).reshape((-1,) + rest)


def group_split(t: torch.Tensor, widths: Sequence[int], g: int) -> List[torch.Tensor]:
    """Inverse of :func:`group_cat` (each part contiguous)."""
    rest = tuple(t.shape[1:])
    return [x.reshape((-1,) + rest).contiguous()
            for x in t.reshape((g, -1) + rest).split(list(widths), 1)]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig,
             gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Separate q [a*d, ...], k [g*d, ...], v [g*d, ...] (rows = heads in order; ``gate``
    [a*d, ...] with --attention-output-gate) -> megalite's fused [g * (a/g + 2) * d, ...]
    (docs/models.md, "Fused QKV, per query group")."""
    parts = [q, k, v] + ([gate] if gate is not None else [])
    return group_cat(parts, cfg.num_query_groups)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig):
    """Inverse of :func:`fuse_qkv`: returns (q, k, v) with rows in head order (and the gate)."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    hpg = cfg.num_attention_heads // g
    return group_split(qkv, [hpg * d, d, d] + [hpg * d] * cfg.attention_output_gate, g)


def _get(tensors: Mapping[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise ValueError(f"{where} is missing tensor {key!r}") from None


# ============================================================================ per-layer mappings
def _swiglu_from_hf(t, hf_p: str, ml_p: str, bias: bool, where: str) -> dict:
    """HF's gate/up/down linears under ``hf_p`` -> megalite's MLP under ``ml_p``, fc1 = [gate; up]
    (the dense MLP and the shared expert)."""
    out = {}
    for kind in ["weight"] + (["bias"] if bias else []):
        gate, up, down = (_get(t, f"{hf_p}{n}.{kind}", where) for n in _SWIGLU)
        out[f"{ml_p}linear_fc1.{kind}"] = torch.cat([gate, up], dim=0)
        out[f"{ml_p}linear_fc2.{kind}"] = down
    return out


def _swiglu_to_hf(t, ml_p: str, hf_p: str, bias: bool, where: str) -> dict:
    """Inverse of :func:`_swiglu_from_hf`."""
    out = {}
    for kind in ["weight"] + (["bias"] if bias else []):
        gate, up = _get(t, f"{ml_p}linear_fc1.{kind}", where).chunk(2, dim=0)
        out[f"{hf_p}gate_proj.{kind}"] = gate.contiguous()
        out[f"{hf_p}up_proj.{kind}"] = up.contiguous()
        out[f"{hf_p}down_proj.{kind}"] = _get(t, f"{ml_p}linear_fc2.{kind}", where)
    return out


def _experts_from_hf(t, p: str, out_p: str, cfg: ModelConfig, where: str) -> dict:
    """HF experts and shared expert -> MoELayer's tensors (docs/models.md, "Experts' tensors")."""
    m = _moe_spec(cfg)
    if m.stacked:  # one to one (_layer_pairs), no shared expert
        return {}
    b = f"{p}{m.block}."
    # copied expert by expert into the stacked tensors: no [gate; up] copies beside them, so a
    # layer of experts is held twice at most (docs/models.md, "Converter memory")
    w1 = w2 = None
    for e in range(cfg.num_experts):
        gate, up, down = (_get(t, f"{b}experts.{e}.{n}.weight", where) for n in m.expert_names)
        if w1 is None:
            f, h = gate.shape
            w1 = gate.new_empty((cfg.num_experts, h, 2 * f))
            w2 = down.new_empty((cfg.num_experts,) + tuple(down.t().shape))
        w1[e, :, :f].copy_(gate.t())
        w1[e, :, f:].copy_(up.t())
        w2[e].copy_(down.t())
    out = {out_p + "mlp.weight1": w1, out_p + "mlp.weight2": w2}
    if cfg.moe_shared_expert_intermediate_size:
        out.update(_swiglu_from_hf(t, f"{b}{m.shared}.", out_p + "mlp.shared_expert.",
                                   cfg.add_bias_linear, where))
    return out


def _experts_to_hf(t, in_p: str, p: str, cfg: ModelConfig, where: str) -> dict:
    """Inverse of :func:`_experts_from_hf`."""
    m = _moe_spec(cfg)
    if m.stacked:
        return {}
    b = f"{p}{m.block}."
    out = {}
    w1, w2 = _get(t, in_p + "mlp.weight1", where), _get(t, in_p + "mlp.weight2", where)
    for e in range(cfg.num_experts):
        gate, up = w1[e].t().chunk(2, dim=0)
        for n, x in zip(m.expert_names, (gate, up, w2[e].t())):
            out[f"{b}experts.{e}.{n}.weight"] = x.contiguous()
    if cfg.moe_shared_expert_intermediate_size:
        out.update(_swiglu_to_hf(t, in_p + "mlp.shared_expert.", f"{b}{m.shared}.",
                                 cfg.add_bias_linear, where))
    return out


def _linear_from_hf(t, p: str, ml_p: str, cfg: ModelConfig, where: str) -> dict:
    """HF's Gated DeltaNet in projections and conv1d under ``p`` -> megalite's, regrouped per
    key-head group (docs/models.md, "Hybrid families")."""
    g, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    dv = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    ins = [_get(t, f"{p}{n}.weight", where) for n in _linear_in(cfg)]
    if len(ins) == 4:  # split by kind: q, k, v of every head in one, then z, b, a
        ins = list(ins[0].split([g * dk, g * dk, dv])) + ins[1:]
    conv = _get(t, p + "conv1d.weight", where)[:, 0]  # [channels, 1, width]: one filter each
    return {ml_p + "in_proj.weight": group_cat(ins, g),
            ml_p + "conv_weight": group_cat(conv.split([g * dk, g * dk, dv]), g)}


def _linear_to_hf(t, ml_p: str, p: str, cfg: ModelConfig, where: str) -> dict:
    """Inverse of :func:`_linear_from_hf`."""
    g, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r = cfg.linear_num_value_heads // g
    rdv = r * cfg.linear_value_head_dim
    w, names = _get(t, ml_p + "in_proj.weight", where), _linear_in(cfg)
    if len(names) == 2:  # fused: per group [q, k, v, z] and [b, a]
        parts = group_split(w, [2 * dk + 2 * rdv, 2 * r], g)
    else:
        q, k, v, *parts = group_split(w, [dk, dk, rdv, rdv, r, r], g)
        parts = [torch.cat([q, k, v])] + parts
    conv = group_split(_get(t, ml_p + "conv_weight", where), [dk, dk, rdv], g)
    out = {f"{p}{n}.weight": x for n, x in zip(names, parts)}
    out[p + "conv1d.weight"] = torch.cat(conv).unsqueeze(1)
    return out


def convert_layer_hf_to_megalite(layer_idx: int, hf_tensors: Mapping[str, torch.Tensor],
                                 cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """HF tensors of layer ``layer_idx`` (full HF names, see :func:`hf_layer_keys`; other keys are
    ignored) -> megalite tensors of that layer (full names, :func:`megalite_layer_keys`)."""
    family = model_family(cfg)
    p, out_p = _hf_layer_prefix(layer_idx, cfg), _layer_prefix(layer_idx, cfg)
    where = f"HF layer {layer_idx}"
    out = {out_p + ml: _one_to_one(_get(hf_tensors, p + hf, where), ml, cfg)
           for ml, hf in _layer_pairs(layer_idx, cfg)}
    if family == "gpt2":
        for kind in ("weight", "bias"):
            c_attn = _get(hf_tensors, f"{p}attn.c_attn.{kind}", where)
            if kind == "weight":  # Conv1D stores [h, 3h]; nn.Linear's layout is [3h, h]
                c_attn = c_attn.t()
            out[f"{out_p}self_attention.linear_qkv.{kind}"] = fuse_qkv(
                *c_attn.split(cfg.hidden_size, 0), cfg)
        return out
    if cfg.is_linear_attention_layer(layer_idx):
        out.update(_linear_from_hf(hf_tensors, p + "linear_attn.", out_p + "self_attention.",
                                   cfg, where))
    elif not cfg.multi_latent_attention:
        for kind in ["weight"] + (["bias"] if cfg.add_qkv_bias else []):
            q, k, v = (_get(hf_tensors, f"{p}self_attn.{x}_proj.{kind}", where) for x in "qkv")
            gate = None
            if cfg.attention_output_gate:  # HF's q_proj rows: per head [q (d), gate (d)]
                heads = q.reshape((cfg.num_attention_heads, 2, -1) + q.shape[1:])
                q, gate = heads[:, 0].flatten(0, 1), heads[:, 1].flatten(0, 1)
            out[out_p + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, cfg, gate)
    if cfg.is_moe_layer(layer_idx):
        out.update(_experts_from_hf(hf_tensors, p, out_p, cfg, where))
    else:
        out.update(_swiglu_from_hf(hf_tensors, p + "mlp.", out_p + "mlp.", cfg.add_bias_linear,
                                   where))
    return out


def convert_layer_megalite_to_hf(layer_idx: int, ml_tensors: Mapping[str, torch.Tensor],
                                 cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`convert_layer_hf_to_megalite` (full megalite names in, HF names out; the
    experts in the form of hub files: per expert, GPT-OSS's stacked)."""
    family = model_family(cfg)
    p, in_p = _hf_layer_prefix(layer_idx, cfg), _layer_prefix(layer_idx, cfg)
    where = f"megalite layer {layer_idx}"
    out = {p + hf: _one_to_one(_get(ml_tensors, in_p + ml, where), ml, cfg, back=True)
           for ml, hf in _layer_pairs(layer_idx, cfg)}
    if family == "gpt2":
        for kind in ("weight", "bias"):
            qkv = _get(ml_tensors, f"{in_p}self_attention.linear_qkv.{kind}", where)
            c_attn = torch.cat(split_qkv(qkv, cfg), 0)
            out[f"{p}attn.c_attn.{kind}"] = c_attn.t().contiguous() if kind == "weight" else c_attn
        return out
    if cfg.is_linear_attention_layer(layer_idx):
        out.update(_linear_to_hf(ml_tensors, in_p + "self_attention.", p + "linear_attn.", cfg,
                                 where))
    elif not cfg.multi_latent_attention:
        for kind in ["weight"] + (["bias"] if cfg.add_qkv_bias else []):
            qkv = _get(ml_tensors, in_p + f"self_attention.linear_qkv.{kind}", where)
            q, k, v, *gate = split_qkv(qkv, cfg)
            if gate:  # back to HF's per-head [q, gate] rows
                heads = (cfg.num_attention_heads, -1) + tuple(q.shape[1:])
                q = torch.stack([q.reshape(heads), gate[0].reshape(heads)], 1).flatten(0, 2)
            for name, t in zip("qkv", (q, k, v)):
                out[f"{p}self_attn.{name}_proj.{kind}"] = t
    if cfg.is_moe_layer(layer_idx):
        out.update(_experts_to_hf(ml_tensors, in_p, p, cfg, where))
    else:
        out.update(_swiglu_to_hf(ml_tensors, in_p + "mlp.", p + "mlp.", cfg.add_bias_linear,
                                 where))
    return out


def convert_non_layer_hf_to_megalite(hf_tensors: Mapping[str, torch.Tensor],
                                     cfg: ModelConfig, names: Optional[Sequence[str]] = None
                                     ) -> Dict[str, torch.Tensor]:
    """Embeddings, final norm and (untied) output layer (or only megalite ``names`` of them);
    vocab tensors zero-padded to ``cfg.padded_vocab_size(1)`` rows."""
    out = {}
    for ml, hf in _non_layer_map(cfg).items():
        if names is not None and ml not in names:
            continue
        t = _get(hf_tensors, hf, "HF state dict")
        if ml in (EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME):
            t = pad_vocab(t, cfg.vocab_size, cfg.padded_vocab_size(1))
        out[ml] = t
    for i in _mtp_layers(cfg, names):
        out.update(convert_layer_hf_to_megalite(i, hf_tensors, cfg))
    return out


def convert_non_layer_megalite_to_hf(ml_tensors: Mapping[str, torch.Tensor],
                                     cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`convert_non_layer_hf_to_megalite` (a tied ``lm_head.weight`` left out)."""
    out = {}
    for ml, hf in _non_layer_map(cfg).items():
        t = _get(ml_tensors, ml, "megalite state dict")
        if ml in (EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME):
            # A slice would keep the padded storage alive (and safetensors saves whole storages).
            t = t[: cfg.vocab_size].clone()
        out[hf] = t
    for i in _mtp_layers(cfg):
        out.update(convert_layer_megalite_to_hf(i, ml_tensors, cfg))
    out.update({k: out[main].clone() for k, main in mtp_copies(cfg).items()})
    return out


# ======================================================================= whole state dicts
_STACKED = re.compile(r"(model\.layers\.\d+\.)mlp\.(experts\.gate_up_proj|experts\.down_proj|"
                      r"gate\.weight)$")


def _normalize_hf_keys(hf_state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig):
    """HF state dicts in the names hub files use: ``GPT2Model``'s get the ``transformer.`` prefix,
    stacked experts are split into per-expert views (docs/models.md, "Experts' tensors")."""
    family = model_family(cfg)
    if family == "gpt2":
        if any(k.startswith("transformer.") for k in hf_state_dict):
            return dict(hf_state_dict)
        return {(k if k.startswith("lm_head.") else "transformer." + k): v
                for k, v in hf_state_dict.items()}
    # a vision-language wrapper's text model (WRAPPERS)
    hf_state_dict = {k.replace("model.language_model.", "model.", 1): v
                     for k, v in hf_state_dict.items()}
    for k in [k for k in hf_state_dict if k.endswith("_blocks")]:  # MXFP4 (GPT-OSS's experts)
        name = k[: -len("_blocks")]
        hf_state_dict[name] = dequantize_mxfp4(hf_state_dict.pop(k), hf_state_dict.pop(
            name + "_scales"), dtype_from_name(cfg.params_dtype))
    if cfg.num_experts is None or _moe_spec(cfg).stacked:
        return hf_state_dict
    m, out = _moe_spec(cfg), {}
    f, h = cfg.moe_ffn_hidden_size, cfg.hidden_size
    for k, v in hf_state_dict.items():
        match = _STACKED.match(k)
        if match is None:
            out[k] = v
            continue
        b, what = f"{match.group(1)}{m.block}.", match.group(2)
        if what == "gate.weight":
            out[b + "gate.weight"] = v
            continue
        want = (cfg.num_experts, 2 * f, h) if what.endswith("gate_up_proj") else (
            cfg.num_experts, h, f)
        if tuple(v.shape) != want:
            raise ValueError(f"HF tensor {k} has shape {tuple(v.shape)}, the config implies "
                             f"{want}")
        gate, up, down = m.expert_names
        for e in range(cfg.num_experts):
            if what.endswith("gate_up_proj"):
                out[f"{b}experts.{e}.{gate}.weight"] = v[e, :f]
                out[f"{b}experts.{e}.{up}.weight"] = v[e, f:]
            else:
                out[f"{b}experts.{e}.{down}.weight"] = v[e]
    return out


def hf_to_megalite_state_dict(hf_state_dict: Mapping[str, torch.Tensor],
                              model_config: ModelConfig) -> Dict[str, torch.Tensor]:
    """A full (tp=1) megalite state dict from an HF state dict, hub-file or in-memory names. An
    HF tensor left unused is an error (docs/models.md, "Hugging Face key mapping")."""
    cfg = model_config
    check_hf_weight_names(hf_state_dict)
    sd = _normalize_hf_keys(hf_state_dict, cfg)
    out = convert_non_layer_hf_to_megalite(sd, cfg)
    used = set(hf_non_layer_keys(cfg))
    for i in range(cfg.num_layers):
        out.update(convert_layer_hf_to_megalite(i, sd, cfg))
        used.update(hf_layer_keys(i, cfg))
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
    copies = mtp_copies(cfg)
    differ = next((k for k, main in copies.items() if k in sd and not sd[k].equal(sd[main])), None)
    if differ is not None:
        raise ValueError(f"HF state dict: {differ} differs from {copies[differ]}, which "
                         f"megalite's MTP layers share")
    used.update(copies)
    unused = [k for k in sd if k not in used and not k.endswith(IGNORED_HF_SUFFIXES)]
    if unused:
        raise ValueError(f"HF state dict has {len(unused)} tensor(s) megalite does not map "
                         f"(config mismatch?): {', '.join(unused[:5])}")
    return out


def megalite_to_hf_state_dict(full_state_dict: Mapping[str, torch.Tensor],
                              model_config: ModelConfig) -> Dict[str, torch.Tensor]:
    """An HF state dict (hub-file names) from a full (tp=1) megalite state dict."""
    cfg = model_config
    out = convert_non_layer_megalite_to_hf(full_state_dict, cfg)
    for i in range(cfg.num_layers):
        out.update(convert_layer_megalite_to_hf(i, full_state_dict, cfg))
    return out


def special_token_ids(tokenizer) -> Dict[str, int]:
    """The tokenizer's bos/eos/pad ids, for the exported config.json."""
    return {k: v for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if (v := getattr(tokenizer, k, None)) is not None}
