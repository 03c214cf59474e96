"""Hugging Face <-> megalite conversion: GPT-2, Llama (3.1+), Qwen2, Qwen3 and Mistral.

Two layers of API:

* **Pure tensor mappings**, written per transformer layer so a streaming tool can convert one layer
  at a time without holding the whole model: :func:`convert_layer_hf_to_megalite`,
  :func:`convert_layer_megalite_to_hf`, :func:`convert_non_layer_hf_to_megalite`,
  :func:`convert_non_layer_megalite_to_hf`, and the key lists :func:`hf_layer_keys`,
  :func:`hf_non_layer_keys`, :func:`megalite_layer_keys`, :func:`megalite_non_layer_keys`.
  :func:`hf_to_megalite_state_dict` / :func:`megalite_to_hf_state_dict` apply them to a whole
  state dict.
* Whole models (:func:`from_hf`, :func:`to_hf`) live with the reader of HF directories, in
  convert/checkpoint_tools.py, which imports this module (never the other way).

Key naming (docs/models.md has the full table). HF names are the ``state_dict`` names of
``GPT2LMHeadModel`` (``transformer.h.{i}.attn.c_attn.weight``, ...) and ``LlamaForCausalLM``
(``model.layers.{i}.self_attn.q_proj.weight``, ...); megalite names are the full (tp=1) names of
``GPTModel.state_dict()`` (``layers.{i}.self_attention.linear_qkv.weight``, ...).

Layout facts the mapping encodes:

* megalite's fused QKV weight is laid out per query group: for each of the g groups, its a/g query
  heads, then its key head, then its value head, each ``kv_channels`` rows
  (megalite/models/transformer.py). HF Llama keeps q/k/v separate, with query head j served by
  key/value head j // (a/g) (``repeat_kv``); GPT-2 has one ``c_attn`` = [q; k; v] (MHA, g = a).
* HF checkpoints of Llama are already in the "rotate half" RoPE convention that
  megalite/models/rotary.py uses, so q/k rows need no permutation.
* GPT-2's ``Conv1D`` stores weights as [in, out], the transpose of ``nn.Linear``.
* SwiGLU's fc1 is [gate; up] stacked along dim 0; HF Llama has ``gate_proj`` and ``up_proj``.
* Vocab-sized tensors are padded with zero rows to ``cfg.padded_vocab_size(1)`` in a full megalite
  state dict and stripped back to ``cfg.vocab_size`` on export.
* Tied embeddings: megalite has no ``output_layer.weight`` on a single stage; the HF export omits
  ``lm_head.weight`` (as ``save_pretrained`` does) and HF re-ties it on load.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Mapping

import torch

from megalite.config import ConfigError, ModelConfig
from megalite.convert.sharding import (
    EMBEDDING_WEIGHT_NAME,
    OUTPUT_WEIGHT_NAME,
    pad_vocab,
)

# Qwen2, Qwen3 and Mistral share Llama's tensor layout ("llama" below) with a few options:
# q/k/v-only bias (Qwen2), per-head q/k RMSNorm (Qwen3), sliding-window attention (all three).
_ARCHITECTURE_OF_FAMILY = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "mistral": "MistralForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURE_OF_FAMILY.values())
FAMILY_OF_MODEL_TYPE = {k: k for k in _ARCHITECTURE_OF_FAMILY}  # HF model_type -> family

# HF activation names -> megalite ModelConfig.activation (GPT-2's default "gelu_new" is the tanh
# approximation 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), Hendrycks & Gimpel 2016).
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                     "relu": "relu"}
_GPT2_ACTIVATIONS_BACK = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}

# HF buffers that are not parameters and carry nothing megalite needs (causal masks, RoPE cache).
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def unsupported_architecture(name: str) -> ConfigError:
    return ConfigError(f"unsupported Hugging Face architecture {name!r}: megalite converts "
                       f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def hf_family(hf_config) -> str:
    model_type = getattr(hf_config, "model_type", None)
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        archs = getattr(hf_config, "architectures", None) or [model_type]
        raise unsupported_architecture(archs[0])
    return family


def model_family(cfg: ModelConfig) -> str:
    """"gpt2" or "llama": which HF tensor layout holds this megalite configuration (Qwen2, Qwen3
    and Mistral use Llama's; :func:`hf_architecture` picks the class)."""
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
_LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_position_embeddings"}


def _rope(hf_config) -> dict:
    """RoPE base and scaling as ModelConfig fields. transformers >= 5 keeps them in
    ``rope_parameters``; older versions in ``rope_theta`` and ``rope_scaling``. megalite computes
    the plain RoPE of Su et al. and Llama 3.1's "llama3" scaling (models/rotary.py)."""
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.update(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"rope type {rope_type!r} is not supported: megalite implements the "
                          f"default rotary embedding and 'llama3' scaling")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    out = {"rotary_base": float(theta if theta is not None else 10000.0)}
    if rope_type == "llama3":
        out.update({ml: params[hf] for hf, ml in _LLAMA3_ROPE.items()})
    return out


def _hf_rope(cfg: ModelConfig, config_cls) -> dict:
    """Inverse of :func:`_rope`: the HF config kwargs."""
    params = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        params.update({"rope_type": "llama3"},
                      **{hf: getattr(cfg, ml) for hf, ml in _LLAMA3_ROPE.items()})
    # transformers >= 5 takes rope_parameters; older versions take rope_theta and rope_scaling.
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        return {"rope_parameters": params}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": cfg.rotary_base,
            "rope_scaling": scaling if cfg.rope_scaling_factor is not None else None}


def _sliding_window(c, family: str) -> dict:
    """Which layers HF gives a sliding window, as ModelConfig fields. Mistral windows every layer
    when ``sliding_window`` is set; Qwen2/Qwen3 only the layers ``layer_types`` marks (derived by
    HF from ``use_sliding_window`` and ``max_window_layers``): a ``sliding_window`` value alone,
    as released Qwen2 configs carry with use_sliding_window false, windows nothing."""
    window = getattr(c, "sliding_window", None)
    if family == "mistral":
        types = getattr(c, "layer_types", None) or []
        if window is not None and any(t != "sliding_attention" for t in types):
            raise ConfigError("Mistral layer_types with full-attention layers (alternating "
                              "attention) are not supported: megalite windows every Mistral layer")
        return {"sliding_window": window, "max_window_layers": 0}
    if family not in ("qwen2", "qwen3"):
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


def hf_config_to_model_config(hf_config, **overrides) -> ModelConfig:
    """A megalite :class:`ModelConfig` equivalent to a ``GPT2Config`` or ``LlamaConfig``.

    ``seq_length`` defaults to the HF ``max_position_embeddings``; ``overrides`` (any ModelConfig
    field, e.g. ``seq_length``, ``make_vocab_size_divisible_by``, ``params_dtype``) win.
    GPT-2's ``embd_pdrop`` is not separate in megalite: ``resid_pdrop`` becomes ``hidden_dropout``.
    """
    family = hf_family(hf_config)
    c = hf_config
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
            max_position_embeddings=c.n_positions, vocab_size=c.vocab_size,
            position_embedding_type="learned_absolute", normalization="LayerNorm",
            norm_epsilon=c.layer_norm_epsilon, activation=act, swiglu=False, add_bias_linear=True,
            add_qkv_bias=True,
            untie_embeddings_and_output_weights=not getattr(c, "tie_word_embeddings", True),
            hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop,
            init_method_std=c.initializer_range)
    else:
        if c.hidden_act != "silu":
            raise ConfigError(f"{family} hidden_act {c.hidden_act!r} is not supported; megalite's "
                              f"SwiGLU uses silu")
        attention_bias = bool(getattr(c, "attention_bias", False))
        mlp_bias = bool(getattr(c, "mlp_bias", False))
        if family != "llama" and attention_bias:
            # Qwen3's attention_bias also puts a bias on o_proj, which megalite ties to the MLP
            # biases (add_bias_linear), which Qwen3 does not have.
            raise ConfigError(f"{family} attention_bias=True (a bias on o_proj as well as q/k/v) "
                              f"is not supported: megalite biases o_proj only with the MLP")
        if attention_bias != mlp_bias:
            # megalite has one switch for the output projection and both MLP linears
            # (add_bias_linear), so HF's o_proj (attention_bias) and MLP (mlp_bias) must agree.
            raise ConfigError(f"Llama attention_bias={attention_bias} with mlp_bias={mlp_bias} is "
                              f"not supported: megalite needs both equal (add_bias_linear)")
        heads = c.num_attention_heads
        kwargs = dict(
            num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads,
            num_query_groups=getattr(c, "num_key_value_heads", None) or heads,
            kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
            ffn_hidden_size=c.intermediate_size, seq_length=c.max_position_embeddings,
            max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
            position_embedding_type="rope", normalization="RMSNorm",
            norm_epsilon=c.rms_norm_eps, activation="silu", swiglu=True,
            add_bias_linear=attention_bias, add_qkv_bias=attention_bias or family == "qwen2",
            qk_layernorm=family == "qwen3",
            untie_embeddings_and_output_weights=not getattr(c, "tie_word_embeddings", False),
            hidden_dropout=0.0, attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
            init_method_std=c.initializer_range, **_rope(c), **_sliding_window(c, family))
    kwargs.update(hf_architecture=_ARCHITECTURE_OF_FAMILY[family], **overrides)
    return ModelConfig(**kwargs).validate()


def _cannot_hold(cfg: ModelConfig, family: str):
    """Why HF ``family`` cannot hold this llama-layout model (None if it can)."""
    window = cfg.sliding_window is not None
    if family == "llama" and (cfg.qk_layernorm or window
                              or cfg.add_qkv_bias != cfg.add_bias_linear):
        return "it has no q/k norm, no sliding window and one bias flag for q/k/v and o_proj"
    if family == "mistral" and (cfg.qk_layernorm or cfg.add_qkv_bias or cfg.add_bias_linear
                                or (window and cfg.max_window_layers)):
        return "it has no bias, no q/k norm and windows every layer or none"
    if family == "qwen2" and (cfg.qk_layernorm or not cfg.add_qkv_bias or cfg.add_bias_linear):
        return "it has biases on q/k/v (--add-qkv-bias) only and no q/k norm"
    if family == "qwen3" and (not cfg.qk_layernorm or cfg.add_qkv_bias or cfg.add_bias_linear):
        return "it has q/k norms (--qk-layernorm) and no bias"
    return None


def hf_architecture(cfg: ModelConfig) -> str:
    """The HF class a megalite model exports as: the one it was imported from
    (``cfg.hf_architecture``), else the first of GPT-2 / Llama / Qwen2 / Qwen3 / Mistral that
    holds it."""
    if model_family(cfg) == "gpt2":
        if cfg.qk_layernorm or cfg.sliding_window is not None:
            raise ConfigError("GPT2LMHeadModel has no q/k norm and no sliding window: drop "
                              "--qk-layernorm / --sliding-window to export as GPT-2")
        return "GPT2LMHeadModel"
    families = [f for f in _ARCHITECTURE_OF_FAMILY if f != "gpt2"]
    recorded = {a: f for f, a in _ARCHITECTURE_OF_FAMILY.items()}.get(cfg.hf_architecture)
    if recorded in families:
        why = _cannot_hold(cfg, recorded)
        if why is not None:
            raise ConfigError(f"this model cannot be exported as {cfg.hf_architecture}, which it "
                              f"was imported from: {why}")
        return cfg.hf_architecture
    for f in families:
        if _cannot_hold(cfg, f) is None:
            return _ARCHITECTURE_OF_FAMILY[f]
    raise ConfigError("no Hugging Face architecture holds this model (q/k norms need no bias "
                      "(Qwen3); a q/k/v-only bias needs no q/k norm (Qwen2); a window over "
                      "only the last layers needs Qwen2 or Qwen3)")


def model_config_to_hf_config(cfg: ModelConfig, **hf_overrides):
    """The HF config (``GPT2Config``, ``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config`` or
    ``MistralConfig``, by :func:`hf_architecture`) for a megalite model (``hf_overrides`` win),
    with ``architectures`` set so ``AutoModelForCausalLM`` picks the LM-head class."""
    import transformers

    family = model_family(cfg)
    arch = hf_architecture(cfg)
    if family == "gpt2":
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
        config_cls = transformers.GPT2Config
    else:
        if cfg.activation != "silu":
            raise ConfigError(f"{arch}'s MLP is SwiGLU with silu, got {cfg.activation!r}")
        config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        kwargs = dict(
            num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels,
            intermediate_size=cfg.ffn_hidden_size,
            max_position_embeddings=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.norm_epsilon, hidden_act="silu",
            attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
            tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None,
            **_hf_rope(cfg, config_cls))
        if arch == "LlamaForCausalLM":
            kwargs.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
        elif arch == "MistralForCausalLM":
            kwargs.update(sliding_window=cfg.sliding_window)
        else:  # Qwen2, Qwen3: layers >= max_window_layers get the window when it is used
            window = cfg.sliding_window is not None
            kwargs.update(use_sliding_window=window, sliding_window=cfg.sliding_window,
                          max_window_layers=cfg.max_window_layers if window else cfg.num_layers)
    kwargs.update(hf_overrides)
    hf_config = config_cls(**kwargs)
    hf_config.architectures = [arch]
    # transformers 5 spells the weight dtype "dtype", older versions "torch_dtype".
    setattr(hf_config, "dtype" if "dtype" in hf_config.to_dict() else "torch_dtype",
            cfg.params_dtype)
    return hf_config


# ============================================================================ key names per layer
_GPT2_LAYER = {  # megalite suffix -> (HF suffix, Conv1D i.e. stored transposed)
    "input_layernorm.weight": ("ln_1.weight", False),
    "input_layernorm.bias": ("ln_1.bias", False),
    "self_attention.linear_proj.weight": ("attn.c_proj.weight", True),
    "self_attention.linear_proj.bias": ("attn.c_proj.bias", False),
    "pre_mlp_layernorm.weight": ("ln_2.weight", False),
    "pre_mlp_layernorm.bias": ("ln_2.bias", False),
    "mlp.linear_fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.linear_fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.linear_fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.linear_fc2.bias": ("mlp.c_proj.bias", False),
}
_LLAMA_LAYER = {  # one-to-one tensors; qkv and SwiGLU fc1 are fused below
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}


def _hf_layer_prefix(family: str, i: int) -> str:
    return f"transformer.h.{i}." if family == "gpt2" else f"model.layers.{i}."


def _has_bias(cfg: ModelConfig, megalite_suffix: str) -> bool:
    """Whether the tensor exists in this model (named for the biases, most of which may not)."""
    if "q_layernorm" in megalite_suffix or "k_layernorm" in megalite_suffix:
        return cfg.qk_layernorm
    if megalite_suffix.endswith(".weight"):
        return True
    if "layernorm" in megalite_suffix:
        return cfg.normalization == "LayerNorm"
    if "linear_qkv" in megalite_suffix:
        return bool(cfg.add_qkv_bias)
    return bool(cfg.add_bias_linear)


def megalite_layer_keys(layer_idx: int, cfg: ModelConfig) -> List[str]:
    """Full megalite names of layer ``layer_idx``'s tensors, in a fixed order."""
    suffixes = ["input_layernorm.weight", "input_layernorm.bias",
                "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
                "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
    return [f"layers.{layer_idx}.{s}" for s in suffixes if _has_bias(cfg, s)]


def hf_layer_keys(layer_idx: int, cfg: ModelConfig) -> List[str]:
    """Full HF names of layer ``layer_idx``'s tensors (what a streaming reader must load)."""
    family = model_family(cfg)
    p = _hf_layer_prefix(family, layer_idx)
    if family == "gpt2":
        keys = ["attn.c_attn.weight", "attn.c_attn.bias"]
        keys += [hf for ml, (hf, _) in _GPT2_LAYER.items()]
        return [p + k for k in keys]
    keys = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.qk_layernorm:
        keys += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        keys.append(f"self_attn.{proj}.weight")
        if cfg.add_qkv_bias if proj != "o_proj" else cfg.add_bias_linear:
            keys.append(f"self_attn.{proj}.bias")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        keys.append(f"mlp.{proj}.weight")
        if cfg.add_bias_linear:
            keys.append(f"mlp.{proj}.bias")
    return [p + k for k in keys]


def megalite_non_layer_keys(cfg: ModelConfig) -> List[str]:
    keys = [EMBEDDING_WEIGHT_NAME]
    if cfg.position_embedding_type == "learned_absolute":
        keys.append("embedding.position_embeddings.weight")
    keys.append("final_layernorm.weight")
    if cfg.normalization == "LayerNorm":
        keys.append("final_layernorm.bias")
    if cfg.untie_embeddings_and_output_weights:
        keys.append(OUTPUT_WEIGHT_NAME)
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
    return {k: m[k] for k in megalite_non_layer_keys(cfg)}


def hf_non_layer_keys(cfg: ModelConfig) -> List[str]:
    return list(_non_layer_map(cfg).values())


# ===================================================================== fused QKV: group layout
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Separate q [a*d, ...], k [g*d, ...], v [g*d, ...] (weights or biases, rows = heads in order)
    -> megalite's fused [g * (a/g + 2) * d, ...]: per group, its a/g q heads, its k head, its v
    head.
    """
    g, d = cfg.num_query_groups, cfg.kv_channels
    hpg = cfg.num_attention_heads // g
    rest = tuple(q.shape[1:])
    fused = torch.cat([q.reshape((g, hpg * d) + rest), k.reshape((g, d) + rest),
                       v.reshape((g, d) + rest)], dim=1)
    return fused.reshape((g * (hpg + 2) * d,) + rest).contiguous()


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig):
    """Inverse of :func:`fuse_qkv`: returns (q, k, v) with rows in head order."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    hpg = cfg.num_attention_heads // g
    rest = tuple(qkv.shape[1:])
    q, k, v = qkv.reshape((g, (hpg + 2) * d) + rest).split([hpg * d, d, d], dim=1)
    return (q.reshape((g * hpg * d,) + rest).contiguous(), k.reshape((g * d,) + rest).contiguous(),
            v.reshape((g * d,) + rest).contiguous())


def _get(tensors: Mapping[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise ValueError(f"{where} is missing tensor {key!r}") from None


# ============================================================================ per-layer mappings
def convert_layer_hf_to_megalite(layer_idx: int, hf_tensors: Mapping[str, torch.Tensor],
                                 cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """HF tensors of layer ``layer_idx`` (full HF names, see :func:`hf_layer_keys`; other keys are
    ignored) -> megalite tensors of that layer (full names, :func:`megalite_layer_keys`)."""
    family = model_family(cfg)
    p = _hf_layer_prefix(family, layer_idx)
    out_p = f"layers.{layer_idx}."
    where = f"HF layer {layer_idx}"
    out: Dict[str, torch.Tensor] = {}
    if family == "gpt2":
        h = cfg.hidden_size
        # Conv1D stores [h, 3h]; nn.Linear's layout is [3h, h]
        c_attn_w = _get(hf_tensors, p + "attn.c_attn.weight", where).t()
        c_attn_b = _get(hf_tensors, p + "attn.c_attn.bias", where)
        out[out_p + "self_attention.linear_qkv.weight"] = fuse_qkv(*c_attn_w.split(h, 0), cfg)
        out[out_p + "self_attention.linear_qkv.bias"] = fuse_qkv(*c_attn_b.split(h, 0), cfg)
        for ml, (hf, conv1d) in _GPT2_LAYER.items():
            t = _get(hf_tensors, p + hf, where)
            out[out_p + ml] = t.t().contiguous() if conv1d else t
        return out
    for kind in ["weight"] + (["bias"] if cfg.add_qkv_bias else []):
        q, k, v = (_get(hf_tensors, f"{p}self_attn.{x}_proj.{kind}", where) for x in "qkv")
        out[out_p + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, cfg)
    for kind in ["weight"] + (["bias"] if cfg.add_bias_linear else []):
        gate = _get(hf_tensors, f"{p}mlp.gate_proj.{kind}", where)
        up = _get(hf_tensors, f"{p}mlp.up_proj.{kind}", where)
        out[out_p + f"mlp.linear_fc1.{kind}"] = torch.cat([gate, up], dim=0)  # [gate; up]
    for ml, hf in _LLAMA_LAYER.items():
        if _has_bias(cfg, ml):
            out[out_p + ml] = _get(hf_tensors, p + hf, where)
    return out


def convert_layer_megalite_to_hf(layer_idx: int, ml_tensors: Mapping[str, torch.Tensor],
                                 cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`convert_layer_hf_to_megalite` (full megalite names in, HF names out)."""
    family = model_family(cfg)
    p = _hf_layer_prefix(family, layer_idx)
    in_p = f"layers.{layer_idx}."
    where = f"megalite layer {layer_idx}"
    out: Dict[str, torch.Tensor] = {}
    qkv_w = _get(ml_tensors, in_p + "self_attention.linear_qkv.weight", where)
    if family == "gpt2":
        qkv_b = _get(ml_tensors, in_p + "self_attention.linear_qkv.bias", where)
        out[p + "attn.c_attn.weight"] = torch.cat(split_qkv(qkv_w, cfg), 0).t().contiguous()
        out[p + "attn.c_attn.bias"] = torch.cat(split_qkv(qkv_b, cfg), 0)
        for ml, (hf, conv1d) in _GPT2_LAYER.items():
            t = _get(ml_tensors, in_p + ml, where)
            out[p + hf] = t.t().contiguous() if conv1d else t
        return out
    for kind in ["weight"] + (["bias"] if cfg.add_qkv_bias else []):
        qkv = _get(ml_tensors, in_p + f"self_attention.linear_qkv.{kind}", where)
        for name, t in zip("qkv", split_qkv(qkv, cfg)):
            out[f"{p}self_attn.{name}_proj.{kind}"] = t
    for kind in ["weight"] + (["bias"] if cfg.add_bias_linear else []):
        gate, up = _get(ml_tensors, in_p + f"mlp.linear_fc1.{kind}", where).chunk(2, dim=0)
        out[f"{p}mlp.gate_proj.{kind}"] = gate.contiguous()
        out[f"{p}mlp.up_proj.{kind}"] = up.contiguous()
    for ml, hf in _LLAMA_LAYER.items():
        if _has_bias(cfg, ml):
            out[p + hf] = _get(ml_tensors, in_p + ml, where)
    return out


def convert_non_layer_hf_to_megalite(hf_tensors: Mapping[str, torch.Tensor],
                                     cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Embeddings, final norm and (untied) output layer; vocab tensors zero-padded to
    ``cfg.padded_vocab_size(1)`` rows."""
    out = {}
    for ml, hf in _non_layer_map(cfg).items():
        t = _get(hf_tensors, hf, "HF state dict")
        if ml in (EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME):
            t = pad_vocab(t, cfg.vocab_size, cfg.padded_vocab_size(1))
        out[ml] = t
    return out


def convert_non_layer_megalite_to_hf(ml_tensors: Mapping[str, torch.Tensor],
                                     cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`convert_non_layer_hf_to_megalite`; vocab padding stripped. With tied
    embeddings ``lm_head.weight`` is left out, as HF's ``save_pretrained`` does."""
    out = {}
    for ml, hf in _non_layer_map(cfg).items():
        t = _get(ml_tensors, ml, "megalite state dict")
        if ml in (EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME):
            # A slice would keep the padded storage alive (and safetensors saves whole storages).
            t = t[: cfg.vocab_size].clone()
        out[hf] = t
    return out


# ======================================================================= whole state dicts
def _normalize_hf_keys(hf_state_dict: Mapping[str, torch.Tensor], family: str):
    """GPT-2 checkpoints saved from ``GPT2Model`` (e.g. the original ``gpt2`` upload) have no
    ``transformer.`` prefix; give them the LM-head model's names."""
    if family != "gpt2" or any(k.startswith("transformer.") for k in hf_state_dict):
        return dict(hf_state_dict)
    return {(k if k.startswith("lm_head.") else "transformer." + k): v
            for k, v in hf_state_dict.items()}


def hf_to_megalite_state_dict(hf_state_dict: Mapping[str, torch.Tensor],
                              model_config: ModelConfig) -> Dict[str, torch.Tensor]:
    """A full (tp=1) megalite state dict from an HF state dict. Every HF tensor must be used
    (apart from buffers such as causal masks, and a tied ``lm_head.weight``)."""
    cfg = model_config
    family = model_family(cfg)
    sd = _normalize_hf_keys(hf_state_dict, family)
    out = convert_non_layer_hf_to_megalite(sd, cfg)
    used = set(hf_non_layer_keys(cfg))
    for i in range(cfg.num_layers):
        out.update(convert_layer_hf_to_megalite(i, sd, cfg))
        used.update(hf_layer_keys(i, cfg))
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
    unused = [k for k in sd if k not in used and not k.endswith(IGNORED_HF_SUFFIXES)]
    if unused:
        raise ValueError(f"HF state dict has {len(unused)} tensor(s) megalite does not map "
                         f"(config mismatch?): {', '.join(unused[:5])}")
    return out


def megalite_to_hf_state_dict(full_state_dict: Mapping[str, torch.Tensor],
                              model_config: ModelConfig) -> Dict[str, torch.Tensor]:
    """An HF state dict from a full (tp=1) megalite state dict (vocab padding stripped)."""
    cfg = model_config
    out = convert_non_layer_megalite_to_hf(full_state_dict, cfg)
    for i in range(cfg.num_layers):
        out.update(convert_layer_megalite_to_hf(i, full_state_dict, cfg))
    return out


def special_token_ids(tokenizer) -> Dict[str, int]:
    """The tokenizer's bos/eos/pad ids, for the exported config.json."""
    return {k: v for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if (v := getattr(tokenizer, k, None)) is not None}
