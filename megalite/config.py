"""Typed configuration: every setting declared once, every check in a validate (docs/design.md,
"Conventions" and "Adding a setting")."""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import List, Optional, Sequence, Union

# Context-parallel attention implementations (--cp-comm-type; docs/context_parallel.md).
CP_COMM_TYPES = ("p2p", "allgather", "a2a")
# The pipeline schedules (docs/pipeline_parallel.md); the V ones place two chunks per rank in a V
# (chunk 0 of rank r is virtual stage r, chunk 1 is 2p-1-r), so rank 0 holds embedding and loss.
V_SCHEDULES = ("zb-v", "dualpipev")
SCHEDULES = ("1f1b", "interleaved", "zb-h1") + V_SCHEDULES
# ZeRO-3 gathers a unit's parameters for its backward and frees them after; the zero-bubble
# schedules defer weight gradients, which would keep every unit gathered until its W pass.
ZERO3_SCHEDULES = ("1f1b", "interleaved")

# The --help groups, in the order pretrain.py prints them.
GROUPS = ("model", "multi-latent attention", "linear attention", "mixture of experts",
          "parallelism", "batch",
          "mixed precision", "optimizer and learning rate", "data parallelism and ZeRO",
          "activation recomputation", "speed (docs/performance.md)", "checkpoints", "data",
          "logging and evaluation", "misc")
# The balancing losses megalite implements (docs/moe.md); Megatron also has sinkhorn and lists of
# types, which ModelConfig.validate refuses by name rather than with argparse's generic message.
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
# Roles of model fields, features a setting needs and declared bounds: docs/design.md, "Adding a
# setting". A feature maps to (whether the model has it, what the error asks for).
SHAPE, CHECKPOINT_ARG, RUN = "shape", "checkpoint-arg", "run"
MOE, MLA, YARN, LINEAR = "moe", "mla", "yarn", "linear"
_FEATURES = {
    LINEAR: (lambda m: m.linear_attention_freq is not None,
             "--linear-attention-freq: without it every layer is softmax attention"),
    MOE: (lambda m: m.num_experts is not None,
          "--num-experts N: without it every layer is a dense MLP"),
    MLA: (lambda m: m.multi_latent_attention, "--multi-latent-attention"),
    YARN: (lambda m: m.rope_type == "yarn", "--rope-type yarn"),
}


POSITIVE, POSITIVE_INT = "positive", "a positive integer"
NON_NEGATIVE, AT_LEAST_ONE = ">= 0", ">= 1"
_BOUNDS = {POSITIVE: lambda v: v > 0, POSITIVE_INT: lambda v: v > 0, NON_NEGATIVE: lambda v: v >= 0,
           AT_LEAST_ONE: lambda v: v >= 1}


class ConfigError(ValueError):
    """A configuration problem; the message names the offending flag(s) and what would be valid."""


def setting(default, help: Optional[str] = None, *, group: Optional[str] = None,
            flag: Optional[str] = None, choices: Optional[Sequence] = None,
            role: Optional[str] = None, layout: bool = False, no_flag: Optional[str] = None,
            shown: Optional[str] = None, feature: Optional[str] = None,
            bound: Optional[str] = None, **cli):
    """Declare one setting; each keyword is described in docs/design.md, "Adding a setting"
    (``cli``: extra argparse keywords such as nargs and const)."""
    return field(default=default, metadata=dict(
        help=help, group=group, flag=flag, choices=choices, role=role, layout=layout,
        no_flag=no_flag, shown=shown, feature=feature, bound=bound, cli=cli))


def moe_setting(default, help: Optional[str] = None, **kw):
    """A mixture-of-experts setting: in that --help group, and needing --num-experts."""
    return setting(default, help, group="mixture of experts", feature=MOE, **kw)


def check_features(section, model: "ModelConfig") -> None:
    """Refuse a setting of ``section`` changed from its default whose feature ``model`` lacks."""
    for f in fields(section):
        feature = f.metadata.get("feature")
        if feature and getattr(section, f.name) != f.default and not _FEATURES[feature][0](model):
            raise ConfigError(f"{flag_name(f)} needs {_FEATURES[feature][1]}")


def flag_name(f) -> Optional[str]:
    """The command-line flag of dataclass field ``f`` (None if it has none)."""
    if f.metadata.get("no_flag"):
        return None
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def dtype_from_name(name: str):
    """The torch dtype of a ``params_dtype`` name (float32, bfloat16, float16; validated here)."""
    import torch  # here only: the rest of this module needs no torch

    return getattr(torch, name)


def check_expert_grid_divisible(world_size: int, etp: int, ep: int, pp: int) -> int:
    """The expert-data-parallel size of the folded expert grid (docs/moe.md)."""
    if etp < 1 or ep < 1 or pp < 1 or world_size % (etp * ep * pp):
        raise ConfigError(
            f"world size ({world_size}) / --pipeline-model-parallel-size ({pp}) must be divisible "
            f"by --expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}), "
            f"each >= 1 (the expert grid reuses each stage's TP x CP x DP ranks)")
    return world_size // (etp * ep * pp)


_LAYER_FREQ_HELP = ("an integer N (layer i, from 0, is MoE when N divides i) or a 0/1 list "
                    "pattern such as [1,0,1,1] or ([0]*3+[1]*29)")


def parse_moe_layer_freq(text: str, flag: str = "--moe-layer-freq") -> Union[int, List[int]]:
    """--moe-layer-freq (or ``flag``, another per-layer pattern) as Megatron reads it, without
    eval: an integer N, or a list built from integer lists, ``[x]*n`` repeats and ``+``
    concatenation, optionally in parentheses."""
    bad = ConfigError(f"{flag} must be {_LAYER_FREQ_HELP}, got {text!r}")
    if str(text).strip().isdigit():
        return int(text)
    if not re.fullmatch(r"[\d\[\]()+*,\s]+", str(text)):
        raise bad

    def is_int(node) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) is int

    def value(node) -> list:  # [n, ...], list + list or list * n; any other node is refused
        if isinstance(node, ast.List) and all(map(is_int, node.elts)):
            return [x.value for x in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return value(node.left) + value(node.right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and is_int(node.right):
            return value(node.left) * node.right.value
        raise bad

    try:
        return value(ast.parse(str(text).strip(), mode="eval").body)
    except SyntaxError:
        raise bad from None


def default_schedule(v: Optional[int]) -> str:
    """The schedule without --pipeline-schedule: interleaved with virtual stages, else 1F1B."""
    return "interleaved" if (v or 1) > 1 else "1f1b"


def check_zero3_schedule(zero_stage: int, schedule: Optional[str]) -> None:
    if zero_stage == 3 and schedule is not None and schedule not in ZERO3_SCHEDULES:
        raise ConfigError(f"--zero-stage 3 does not support --pipeline-schedule {schedule} "
                          f"(deferred weight gradients would keep every unit gathered until its "
                          f"W pass); use 1f1b or interleaved, or --zero-stage 1/2")


def _layers_over(num_layers: int, pp: int, n: int, what: str) -> int:
    """L / (PP x n), the other of V and K: L = PP x V x K."""
    if n <= 0 or pp <= 0 or num_layers % (n * pp) != 0:
        raise ConfigError(f"--num-layers ({num_layers}) must be divisible by "
                          f"--pipeline-model-parallel-size ({pp}) x {what} ({n}), both positive "
                          f"(virtual stages: --num-virtual-stages-per-pipeline-rank V or "
                          f"--num-layers-per-virtual-pipeline-stage K, L = PP x V x K)")
    return num_layers // (n * pp)


def virtual_stages(num_layers: int, pp: int, layers_per_virtual_stage: int) -> int:
    """V from K (--num-layers-per-virtual-pipeline-stage)."""
    return _layers_over(num_layers, pp, layers_per_virtual_stage, "the layers per virtual stage")


def layers_per_virtual_stage(num_layers: int, pp: int, v: Optional[int]) -> Optional[int]:
    """K from V (``ParallelConfig.virtual_pipeline_model_parallel_size``); None without."""
    if not v or v == 1:
        return None
    return _layers_over(num_layers, pp, v, "the virtual stages per rank")


def check_routing(m: "ModelConfig") -> None:
    """The router's rules (megalite/moe/router.py), checked once by ModelConfig.validate; the
    choices of --moe-router-score-function / --moe-router-group-score by its _check_choices."""
    e, k, g, gk = m.num_experts, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk
    if not 1 <= k <= e:
        raise ConfigError(f"--moe-router-topk ({k}) must be between 1 and --num-experts ({e})")
    softmax = m.moe_router_score_function == "softmax"
    if k == 1 and softmax and not m.moe_router_pre_softmax:
        # a softmax over one logit is constant 1: the router would get no gradient at all
        raise ConfigError("--moe-router-topk 1 with softmax scores needs "
                          "--moe-router-pre-softmax (or --moe-router-score-function sigmoid)")
    if m.moe_router_enable_expert_bias and softmax:
        raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                          "sigmoid (as Megatron)")
    if not m.moe_router_norm_topk_prob and softmax:
        # softmax gates over the k are normalised by construction; unnormalised ones are the
        # top-k of a softmax over all experts
        raise ConfigError("--no-moe-router-norm-topk-prob needs --moe-router-score-function "
                          "sigmoid; for softmax gates that are not renormalised use "
                          "--moe-router-pre-softmax")
    if (g is None) != (gk is None):
        raise ConfigError(f"group-limited routing needs both --moe-router-num-groups and "
                          f"--moe-router-group-topk, got {g} and {gk}")
    if g is None:
        return
    if g < 1 or e % g:
        raise ConfigError(f"--moe-router-num-groups ({g}) must divide --num-experts ({e})")
    if not 1 <= gk <= g:
        raise ConfigError(f"--moe-router-group-topk ({gk}) must be between 1 and "
                          f"--moe-router-num-groups ({g})")
    if k > gk * (e // g):
        raise ConfigError(f"--moe-router-topk ({k}) exceeds the {gk * (e // g)} experts "
                          f"of the --moe-router-group-topk ({gk}) groups a token picks")
    if m.moe_router_group_score == "topk_sum" and k < gk:
        raise ConfigError(f"--moe-router-topk ({k}) must be >= --moe-router-group-topk "
                          f"({gk}) with topk_sum group scores (the top k/group_topk)")
    if m.moe_router_group_score == "top2_sum" and e // g < 2:
        raise ConfigError(f"--moe-router-group-score top2_sum needs at least 2 experts "
                          f"per group, --num-experts ({e}) / --moe-router-num-groups "
                          f"({g}) gives {e // g}")


class _Section:
    """Read-only once frozen (``MegaliteConfig.resolve`` freezes what it returns)."""

    _frozen = False
    GROUP = "misc"  # the --help group of fields that do not name one

    def __setattr__(self, name, value):
        if self._frozen:
            raise AttributeError(f"{type(self).__name__}.{name}: the configuration is read-only "
                                 f"once resolved; build a new one with dataclasses.replace")
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict:
        return asdict(self)

    def _check_choices(self) -> None:
        """Every declared ``choices`` and ``bound``, for library users too (not only argparse)."""
        for f in fields(self):
            ok, bound = f.metadata.get("choices"), f.metadata.get("bound")
            value, name = getattr(self, f.name), flag_name(f) or f"{type(self).__name__}.{f.name}"
            if ok is not None and value not in ok and not (value is None and f.default is None):
                raise ConfigError(f"{name} must be one of {', '.join(map(str, ok))}, got {value!r}")
            if bound and value is not None and not _BOUNDS[bound](value):
                raise ConfigError(f"{name} must be {bound}, got {value}")

    def validate(self):
        self._check_choices()
        return self


@dataclass
class ModelConfig(_Section):
    """What the model computes: its shape and numerics (names as Megatron-LM's flags)."""

    GROUP = "model"
    num_layers: int = setting(6, role=SHAPE, bound=POSITIVE_INT)
    hidden_size: int = setting(384, role=SHAPE, bound=POSITIVE_INT)
    num_attention_heads: int = setting(6, role=SHAPE, bound=POSITIVE_INT)
    ffn_hidden_size: Optional[int] = setting(None, "default 4 x hidden size", role=SHAPE,
                                             bound=POSITIVE_INT)
    num_query_groups: Optional[int] = setting(
        None, "KV heads, with --group-query-attention (default: one per attention head)",
        role=SHAPE, bound=POSITIVE_INT)
    kv_channels: Optional[int] = setting(None, "head dim; default h / heads", role=SHAPE,
                                         bound=POSITIVE_INT)
    seq_length: int = setting(256, role=CHECKPOINT_ARG, bound=POSITIVE_INT)
    max_position_embeddings: Optional[int] = setting(None, "default seq length", role=SHAPE)
    # Embedding rows before padding: until resolve, the size of the BPE (or mock tokenizer) to
    # build; then the tokenizer's own (or the checkpoint's, with --use-checkpoint-args).
    vocab_size: int = setting(8192, "the byte-level BPE's size (a given tokenizer's own wins)",
                              group="data", role=SHAPE, bound=POSITIVE_INT,
                              shown="--vocab-size (or the tokenizer: --tokenizer-type/"
                                    "--tokenizer-model)")
    # Ids the tokenizer produces when it has fewer than vocab_size (None: vocab_size). Rows at or
    # beyond it are treated like the padding: never predicted, masked out of the softmax and loss.
    tokenizer_vocab_size: Optional[int] = setting(None, role=RUN, no_flag="derived by resolve")
    make_vocab_size_divisible_by: int = setting(128, role=SHAPE, bound=POSITIVE_INT)
    position_embedding_type: str = setting("learned_absolute", choices=("learned_absolute", "rope"),
                                           role=SHAPE)
    rotary_base: float = setting(10000.0, role=CHECKPOINT_ARG)
    rotary_percent: float = setting(
        1.0, "share of each q/k head that RoPE rotates (GLM-4.5: 0.5); the rest is not rotated",
        role=CHECKPOINT_ARG)
    rope_scaling_factor: Optional[float] = setting(
        None, "llama3 RoPE scaling (Llama 3.1+); default none", role=CHECKPOINT_ARG)
    rope_low_freq_factor: float = setting(1.0, role=CHECKPOINT_ARG)
    rope_high_freq_factor: float = setting(4.0, role=CHECKPOINT_ARG)
    rope_original_max_position_embeddings: int = setting(8192, role=CHECKPOINT_ARG,
                                                         bound=POSITIVE_INT)
    qk_layernorm: bool = setting(False, "RMSNorm over each q and k head", role=SHAPE)
    qk_layernorm_scope: str = setting(
        "head", "with --qk-layernorm: head (one [d] weight shared by the heads: Qwen3, Megatron) "
        "or projection (over each token's whole q and k projections: OLMoE)",
        choices=("head", "projection"), role=SHAPE)
    sliding_window: Optional[int] = setting(
        None, "W: query q attends keys q-W < k <= q (Megatron --window-size W-1 0)",
        role=CHECKPOINT_ARG, bound=POSITIVE_INT)
    max_window_layers: int = setting(
        0, "with --sliding-window: the first N layers keep full attention", role=CHECKPOINT_ARG,
        bound=NON_NEGATIVE)
    window_attn_skip_freq: Optional[int] = setting(
        None, "with --sliding-window: layer n (from 1) is full attention when N divides n "
        "(GPT-OSS: 2)", role=CHECKPOINT_ARG, bound=POSITIVE_INT)
    # YaRN RoPE scaling with Megatron's names (docs/models.md, "Multi-latent attention")
    rope_type: str = setting(
        "rope", "rope, or yarn (Megatron's default for MLA; at --rotary-scaling-factor 1 the two "
        "are the same)", choices=("rope", "yarn"), role=CHECKPOINT_ARG)
    rotary_scaling_factor: float = setting(1.0, "yarn: context extension factor s",
                                           role=CHECKPOINT_ARG, feature=YARN)
    beta_fast: float = setting(32.0, "yarn: dims turning more often than this over the original "
                               "context keep their frequency", role=CHECKPOINT_ARG, feature=YARN)
    beta_slow: float = setting(1.0, "yarn: dims turning less often than this are interpolated",
                               role=CHECKPOINT_ARG, feature=YARN)
    mscale: float = setting(1.0, "yarn: m of the cos/sin factor (0.1 m ln s + 1) / "
                            "(0.1 m_all ln s + 1)", role=CHECKPOINT_ARG, feature=YARN)
    mscale_all_dim: float = setting(0.0, "yarn: m_all; MLA also scales its softmax by "
                                    "(0.1 m_all ln s + 1)^2", role=CHECKPOINT_ARG, feature=YARN)
    rope_yarn_truncate: bool = setting(
        True, "yarn: floor/ceil the correction range to whole dims (--no-rope-yarn-truncate: "
        "GPT-OSS's truncate false)", role=CHECKPOINT_ARG, feature=YARN)
    # Multi-latent attention (DeepSeek-V2/V3; models/mla.py, docs/models.md).
    multi_latent_attention: bool = setting(
        False, "MLA: q and k/v from low-rank latents, one RoPE key shared by the heads",
        group="multi-latent attention", role=SHAPE)
    q_lora_rank: Optional[int] = setting(
        None, "rank of the q latent (default none: a plain q projection)",
        group="multi-latent attention", role=SHAPE, feature=MLA, bound=POSITIVE_INT)
    kv_lora_rank: int = setting(32, "rank of the compressed k/v latent",
                                group="multi-latent attention", role=SHAPE, feature=MLA,
                                bound=POSITIVE_INT)
    qk_head_dim: int = setting(128, "q/k head dim without RoPE", group="multi-latent attention",
                               role=SHAPE, feature=MLA, bound=POSITIVE_INT)
    qk_pos_emb_head_dim: int = setting(64, "the RoPE part of each q/k head (its k is shared)",
                                       group="multi-latent attention", role=SHAPE, feature=MLA)
    v_head_dim: int = setting(128, group="multi-latent attention", role=SHAPE, feature=MLA,
                              bound=POSITIVE_INT)
    # Hybrid linear attention (Qwen3-Next, Qwen3.5; models/linear_attention.py, docs/models.md)
    linear_attention_freq: Optional[str] = setting(
        None, "which layers are Gated DeltaNet linear attention: an integer N (every N-th layer, "
        "i + 1 divisible by N, keeps softmax attention: Qwen3-Next's full_attention_interval) or "
        "a 0/1 list such as [1,1,1,0] (1: linear); default none", group="linear attention",
        role=SHAPE)
    linear_num_key_heads: int = setting(16, "key (and query) heads of a linear-attention layer",
                                        group="linear attention", role=SHAPE, feature=LINEAR,
                                        bound=POSITIVE_INT)
    linear_num_value_heads: int = setting(32, "value heads, a multiple of the key heads",
                                          group="linear attention", role=SHAPE, feature=LINEAR,
                                          bound=POSITIVE_INT)
    linear_key_head_dim: int = setting(128, group="linear attention", role=SHAPE,
                                       feature=LINEAR, bound=POSITIVE_INT)
    linear_value_head_dim: int = setting(128, group="linear attention", role=SHAPE,
                                         feature=LINEAR, bound=POSITIVE_INT)
    linear_conv_kernel_dim: int = setting(4, "width of the causal depthwise convolution",
                                          group="linear attention", role=SHAPE, feature=LINEAR,
                                          bound=POSITIVE_INT)
    attention_output_gate: bool = setting(
        False, "softmax attention's output times sigmoid of a per-head gate projected beside q "
        "(Qwen3-Next, Qwen3.5)", role=SHAPE)
    apply_layernorm_1p: bool = setting(
        False, "zero-centred norm weights: the norms scale by 1 + w, w starting at 0 (Qwen3-Next,"
        " Qwen3.5; weight decay pulls the scale towards 1)", role=SHAPE)
    attention_sinks: bool = setting(
        False, "a learned logit per head in every softmax denominator (GPT-OSS)", role=SHAPE)
    mtp_num_layers: Optional[int] = setting(
        None, "multi-token prediction depths (DeepSeek-V3's MTP)", role=SHAPE, bound=POSITIVE_INT)
    mtp_loss_scaling_factor: float = setting(
        0.1, "weight of the MTP losses' mean over depths in the loss", role=CHECKPOINT_ARG)
    normalization: str = setting("LayerNorm", choices=("LayerNorm", "RMSNorm"), role=SHAPE)
    norm_epsilon: float = setting(1e-5, role=CHECKPOINT_ARG)
    activation: str = setting("gelu", choices=("gelu", "gelu_tanh", "silu", "relu"),
                              role=CHECKPOINT_ARG, no_flag="gelu, silu with --swiglu; HF sets it")
    swiglu: bool = setting(False, role=SHAPE)
    swiglu_limit: Optional[float] = setting(
        None, "clamped SwiGLU (GPT-OSS: 7): gate <= L, -L <= up <= L, out (up + 1) * gate * "
        "sigmoid(alpha * gate)", role=CHECKPOINT_ARG, bound=POSITIVE)
    swiglu_alpha: float = setting(1.702, "alpha of --swiglu-limit's gate", role=CHECKPOINT_ARG)
    add_bias_linear: bool = setting(True, role=SHAPE, no_flag="--disable-bias-linear")
    add_qkv_bias: Optional[bool] = setting(  # None: same as add_bias_linear
        None, role=SHAPE, no_flag="--add-qkv-bias", shown="--disable-bias-linear / --add-qkv-bias")
    untie_embeddings_and_output_weights: bool = setting(False, role=SHAPE)
    # The Hugging Face class this model was imported from (e.g. "Qwen2ForCausalLM"): the export
    # writes it back, where the shape alone could be read as more than one family.
    hf_architecture: Optional[str] = setting(None, role=CHECKPOINT_ARG,
                                             no_flag="written by the HF import")
    hidden_dropout: float = setting(0.0, role=RUN)
    attention_dropout: float = setting(0.0, role=RUN)
    init_method_std: float = setting(0.02, role=CHECKPOINT_ARG)
    # Mixture of experts (docs/moe.md): every moe_setting needs num_experts.
    num_experts: Optional[int] = setting(
        None, "E experts in each MoE layer (default: a dense MLP in every layer)",
        group="mixture of experts", role=SHAPE, bound=AT_LEAST_ONE)
    moe_router_topk: int = moe_setting(2, "k experts each token is routed to",
                                       role=CHECKPOINT_ARG)
    moe_ffn_hidden_size: Optional[int] = moe_setting(
        None, "each expert's MLP width (default --ffn-hidden-size)", role=SHAPE,
        bound=POSITIVE_INT)
    moe_layer_freq: str = moe_setting("1", f"which layers are MoE: {_LAYER_FREQ_HELP}",
                                      role=SHAPE)
    moe_router_score_function: str = moe_setting(
        "softmax", "how router logits become scores", choices=("softmax", "sigmoid"),
        role=CHECKPOINT_ARG)
    moe_router_pre_softmax: bool = moe_setting(
        False, "softmax over all experts before the top-k (Switch, Qwen2-MoE)",
        role=CHECKPOINT_ARG)
    moe_router_topk_scaling_factor: Optional[float] = moe_setting(
        None, "multiply the gates by this (DeepSeek-V3: 2.5)", role=CHECKPOINT_ARG)
    moe_router_num_groups: Optional[int] = moe_setting(
        None, "group-limited routing: G groups of experts", role=CHECKPOINT_ARG)
    moe_router_group_topk: Optional[int] = moe_setting(
        None, "group-limited routing: each token picks its k experts from this many groups",
        role=CHECKPOINT_ARG)
    moe_router_group_score: str = moe_setting(
        "topk_sum", "how a group is scored: topk_sum (Megatron's rule) or top2_sum (HF "
        "DeepSeek-V3 / GLM-4-MoE); megalite's flag, not Megatron's",
        choices=("topk_sum", "top2_sum"), role=CHECKPOINT_ARG)
    moe_router_norm_topk_prob: bool = moe_setting(
        True, "sigmoid scores: renormalise the k gates to sum to 1 (Megatron always does); "
        "--no-moe-router-norm-topk-prob keeps the raw sigmoid gates (HF's norm_topk_prob=False; "
        "megalite's flag, not Megatron's)", role=CHECKPOINT_ARG)
    moe_router_dtype: str = moe_setting(
        "fp32", "dtype of the router logits; Megatron's default is no cast, megalite computes "
        "them in fp32 by default as Megatron's README recommends", choices=("fp32", "fp64"),
        role=RUN)
    moe_router_enable_expert_bias: bool = moe_setting(  # SHAPE: the bias is a buffer it adds
        False, "loss-free balancing: a per-expert bias for the choice only (sigmoid scores)",
        role=SHAPE)
    moe_router_linear_bias: bool = moe_setting(
        False, "the router's linear layer has a bias: it moves the choice and the gates (GPT-OSS)",
        role=SHAPE)
    moe_router_bias_update_rate: float = moe_setting(
        1e-3, "step of the expert-bias update", role=RUN)
    moe_router_load_balancing_type: str = moe_setting(
        "aux_loss", f"balancing loss: {', '.join(MOE_LOAD_BALANCING_TYPES)} (Megatron's sinkhorn "
        "is not implemented; global_aux_loss's gradient is DP times Megatron's at the same "
        "coefficient, so that DP ranks equal one process: docs/moe.md)",
        role=RUN, metavar="{" + ",".join(MOE_LOAD_BALANCING_TYPES) + "}")
    moe_aux_loss_coeff: float = moe_setting(0.0, "alpha of the balancing loss", role=RUN)
    moe_z_loss_coeff: Optional[float] = moe_setting(None, "beta of the router z-loss (ST-MoE)",
                                                    role=RUN)
    moe_expert_capacity_factor: Optional[float] = moe_setting(
        None, "cap each expert at this times a balanced load, dropping the rest (default "
        "dropless)", role=RUN, bound=POSITIVE)
    moe_token_drop_policy: str = moe_setting(
        "probs", "over capacity keep the highest gates (probs) or the earliest tokens (position)",
        choices=("probs", "position"), role=RUN)
    moe_pad_expert_input_to_capacity: bool = moe_setting(
        False, "pad every expert's input to the capacity (fixed shapes)", role=RUN)
    moe_shared_expert_intermediate_size: Optional[int] = moe_setting(
        None, "width of the shared expert every token also passes through (default none)",
        role=SHAPE, bound=POSITIVE_INT)
    moe_shared_expert_gate: bool = moe_setting(
        False, "Qwen2-MoE's sigmoid gate on the shared expert's output (megatron-core's "
        "moe_shared_expert_gate)", role=SHAPE)
    moe_router_force_load_balancing: bool = moe_setting(
        False, "route tokens evenly whatever the router says (benchmarks only)", role=RUN)
    params_dtype: str = setting("float32", choices=("float32", "bfloat16", "float16"), role=RUN,
                                no_flag="--bf16 / --fp16")

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size is None and self.num_experts is not None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size  # (dense: stays None, the default)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if (self.kv_channels is None and self.num_attention_heads > 0
                and self.hidden_size % self.num_attention_heads == 0):
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.add_qkv_bias is None:
            self.add_qkv_bias = self.add_bias_linear
        if self.swiglu and self.activation == "gelu":
            self.activation = "silu"

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """Vocab padded to a multiple of make_vocab_size_divisible_by * tp (docs/theory.md)."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def output_vocab_size(self) -> int:
        """The ids the model may predict: the logits and the loss stop here."""
        return self.tokenizer_vocab_size or self.vocab_size

    def attention_window(self, layer_number: int) -> Optional[int]:
        """W if global layer ``layer_number`` (0-based) attends to a sliding window of W keys,
        None if it attends to every earlier position."""
        if self.sliding_window is None or layer_number < self.max_window_layers:
            return None
        if self.window_attn_skip_freq and (layer_number + 1) % self.window_attn_skip_freq == 0:
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        """The dims of each q/k head RoPE rotates (--rotary-percent, as Megatron rounds it)."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def _moe_layer_freq(self) -> Union[int, List[int]]:
        """--moe-layer-freq parsed and checked against --num-layers (one home for both)."""
        freq = parse_moe_layer_freq(self.moe_layer_freq)
        if isinstance(freq, int) and freq < 1:
            raise ConfigError(f"--moe-layer-freq must be {_LAYER_FREQ_HELP}, got {freq}")
        if isinstance(freq, list) and (len(freq) != self.num_layers or set(freq) - {0, 1}):
            raise ConfigError(f"--moe-layer-freq {self.moe_layer_freq} must list one 0 (dense) or "
                              f"1 (MoE) per layer, --num-layers ({self.num_layers}) in all; got "
                              f"{len(freq)} values {sorted(set(freq))}")
        return freq

    def moe_layer_pattern(self) -> List[bool]:
        """Per layer (0-based, global numbering), whether it is an MoE layer."""
        if self.num_experts is None:
            return [False] * self.num_layers
        freq = self._moe_layer_freq()
        if isinstance(freq, int):
            return [i % freq == 0 for i in range(self.num_layers)]
        return [bool(x) for x in freq]

    def is_moe_layer(self, layer_number: int) -> bool:
        """MTP's layers (numbers L..L+D-1, models/mtp.py) are of the last layer's kind."""
        return self.moe_layer_pattern()[min(layer_number, self.num_layers - 1)]

    def linear_attention_pattern(self) -> List[bool]:
        """Per layer (0-based, global numbering), whether it is a Gated DeltaNet layer."""
        if self.linear_attention_freq is None:
            return [False] * self.num_layers
        freq = parse_moe_layer_freq(self.linear_attention_freq, "--linear-attention-freq")
        if isinstance(freq, int):
            if freq < 1:
                raise ConfigError(f"--linear-attention-freq must be >= 1, got {freq}")
            return [(i + 1) % freq != 0 for i in range(self.num_layers)]
        if len(freq) != self.num_layers or set(freq) - {0, 1}:
            raise ConfigError(f"--linear-attention-freq {self.linear_attention_freq} must list "
                              f"one 0 (softmax) or 1 (linear) per layer, --num-layers "
                              f"({self.num_layers}) in all")
        return [bool(x) for x in freq]

    def is_linear_attention_layer(self, layer_number: int) -> bool:
        return self.linear_attention_pattern()[min(layer_number, self.num_layers - 1)]

    def linear_attention_weights(self) -> int:
        """Weights of one Gated DeltaNet layer that each token multiplies once (2 FLOPs each): the
        in projection (q, k, v, z, b, a), the depthwise convolution over q, k, v and the out
        projection (the per-head vectors and the norm aside)."""
        dk = self.linear_num_key_heads * self.linear_key_head_dim
        dv = self.linear_num_value_heads * self.linear_value_head_dim
        return self.hidden_size * (2 * dk + 2 * dv + 2 * self.linear_num_value_heads) \
            + (2 * dk + dv) * self.linear_conv_kernel_dim + dv * self.hidden_size

    def validate(self, tensor_model_parallel_size: int = 1) -> "ModelConfig":
        t = tensor_model_parallel_size
        self._check_choices()
        if self.tokenizer_vocab_size is not None and self.tokenizer_vocab_size > self.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.tokenizer_vocab_size} ids but the model's vocabulary "
                f"has {self.vocab_size} rows (--vocab-size / the checkpoint): every id the "
                f"tokenizer produces needs an embedding row")
        if self.kv_channels is None:  # only derived when h divides evenly (__post_init__)
            raise ConfigError(
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads}), or give the head dim with --kv-channels")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ConfigError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.num_query_groups})")
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(self, name) % t != 0:
                raise ConfigError(f"{_flag(name)} ({getattr(self, name)}) must be divisible by "
                                  f"--tensor-model-parallel-size ({t})")
        if (self.position_embedding_type == "rope" and self.kv_channels % 2 != 0
                and not self.multi_latent_attention):  # MLA: its RoPE dims, _validate_mla
            raise ConfigError(f"rope needs an even head dim, got {self.kv_channels}")
        if not 0.0 < self.rotary_percent <= 1.0 or (
                self.position_embedding_type == "rope" and self.rotary_dim % 2 != 0) or (
                self.rotary_percent < 1.0 and self.position_embedding_type != "rope"):
            raise ConfigError(
                f"--rotary-percent must be in (0, 1] with --position-embedding-type rope and "
                f"rotate an even number of each head's {self.kv_channels} dims, got "
                f"{self.rotary_percent}")
        if self.qk_layernorm_scope != "head" and not self.qk_layernorm:
            raise ConfigError("--qk-layernorm-scope projection needs --qk-layernorm")
        if self.rope_scaling_factor is not None and (
                self.position_embedding_type != "rope" or self.rope_scaling_factor < 1.0
                or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ConfigError("--rope-scaling-factor needs --position-embedding-type rope, a "
                              "factor >= 1 and 0 < --rope-low-freq-factor < "
                              "--rope-high-freq-factor")
        if (self.seq_length > self.max_position_embeddings
                and self.position_embedding_type == "learned_absolute"):
            raise ConfigError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings})")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{_flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.swiglu_limit is not None and not self.swiglu:
            raise ConfigError("--swiglu-limit needs --swiglu (it clamps SwiGLU's gate and up)")
        if self.window_attn_skip_freq and self.sliding_window is None:
            raise ConfigError("--window-attn-skip-freq needs --sliding-window (the window of the "
                              "layers it does not make full)")
        if self.attention_sinks and (self.multi_latent_attention or self.attention_dropout > 0):
            raise ConfigError("--attention-sinks needs softmax attention without dropout: drop "
                              "--multi-latent-attention and --attention-dropout")
        check_features(self, self)
        self._validate_linear_attention(t)
        self._validate_moe()
        self._validate_yarn()
        self._validate_mla()
        return self

    def _validate_yarn(self) -> None:
        if self.rope_type != "yarn":
            return
        if self.position_embedding_type != "rope" or self.rope_scaling_factor is not None:
            raise ConfigError("--rope-type yarn needs --position-embedding-type rope and no "
                              "--rope-scaling-factor (llama3 scaling is the other rule)")
        if not (self.rotary_scaling_factor >= 1 and 0 < self.beta_slow < self.beta_fast):
            raise ConfigError(
                f"--rope-type yarn needs --rotary-scaling-factor >= 1 (got "
                f"{self.rotary_scaling_factor}) and 0 < --beta-slow < --beta-fast (got "
                f"{self.beta_slow}, {self.beta_fast})")

    def _validate_linear_attention(self, t: int) -> None:
        if not any(self.linear_attention_pattern()):
            return
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"--linear-num-value-heads ({self.linear_num_value_heads}) must be "
                              f"a multiple of --linear-num-key-heads ({self.linear_num_key_heads})")
        if self.linear_num_key_heads % t:
            raise ConfigError(f"--linear-num-key-heads ({self.linear_num_key_heads}) must be "
                              f"divisible by --tensor-model-parallel-size ({t}): each rank holds "
                              f"whole key heads and their value heads")
        if self.multi_latent_attention:
            raise ConfigError("--linear-attention-freq with --multi-latent-attention: a hybrid "
                              "model's softmax layers are plain attention")

    def _validate_mla(self) -> None:
        """What multi-latent attention does not combine with is refused by name, one line each."""
        if not self.multi_latent_attention:
            return
        mla = "--multi-latent-attention"
        if self.position_embedding_type != "rope":
            raise ConfigError(f"{mla} needs --position-embedding-type rope (its decoupled RoPE "
                              f"key), got {self.position_embedding_type}")
        if self.num_query_groups != self.num_attention_heads:
            raise ConfigError(f"{mla} has no query groups (every head has its own k and v from "
                              f"the latent): drop --group-query-attention / --num-query-groups")
        for bad, what in ((self.qk_layernorm, "--qk-layernorm (MLA normalises its latents)"),
                          (self.sliding_window is not None, "--sliding-window"),
                          (self.rotary_percent != 1.0, "--rotary-percent below 1 (MLA rotates "
                                                       "--qk-pos-emb-head-dim dims)"),
                          (self.add_bias_linear or self.add_qkv_bias,
                           "linear biases: pass --disable-bias-linear")):
            if bad:
                raise ConfigError(f"{mla} does not support {what}")
        if self.qk_pos_emb_head_dim < 2 or self.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"--qk-pos-emb-head-dim must be a positive even number (RoPE turns "
                              f"pairs of dims), got {self.qk_pos_emb_head_dim}")

    def _validate_moe(self) -> None:
        """The MoE settings on their own (those that need the layout: MegaliteConfig.validate)."""
        if self.num_experts is None:
            return
        check_routing(self)
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ConfigError("--moe-pad-expert-input-to-capacity needs "
                              "--moe-expert-capacity-factor (the capacity it pads to)")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError("--moe-shared-expert-gate needs "
                              "--moe-shared-expert-intermediate-size (the shared expert it gates)")
        if self.moe_router_load_balancing_type not in MOE_LOAD_BALANCING_TYPES:
            raise ConfigError(f"--moe-router-load-balancing-type "
                              f"{self.moe_router_load_balancing_type} is not supported: use one "
                              f"of {', '.join(MOE_LOAD_BALANCING_TYPES)} (Megatron's sinkhorn "
                              f"and lists of types are not implemented)")
        self._moe_layer_freq()

    def attention_weights(self) -> int:
        """Matmul weights of one layer's attention, no biases or norms: h(q + 2kv) + qh, or
        MLA's down and up projections (docs/models.md, "Multi-latent attention"). The parameter
        count and the FLOP count (logging.py) both read it."""
        h, n = self.hidden_size, self.num_attention_heads
        if not self.multi_latent_attention:
            q, kv = n * self.kv_channels, self.num_query_groups * self.kv_channels
            gate = q if self.attention_output_gate else 0  # a gate per head and channel
            return h * (q + gate + 2 * kv) + q * h
        qk, rq, rkv = self.attention_widths()[0], self.q_lora_rank, self.kv_lora_rank
        q = h * qk if rq is None else h * rq + rq * qk
        kv = h * (rkv + self.qk_pos_emb_head_dim) + rkv * n * (self.qk_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h

    def attention_widths(self) -> tuple:
        """(q·k, v) widths of one token summed over the heads, which the attention core's
        FLOPs scale with: n·d each, or MLA's n·(d_qk + d_rope) and n·d_v."""
        n = self.num_attention_heads
        if not self.multi_latent_attention:
            return n * self.kv_channels, n * self.kv_channels
        return n * (self.qk_head_dim + self.qk_pos_emb_head_dim), n * self.v_head_dim

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Parameter count Ψ of the full (unsharded, unpadded) model; an MoE layer counts its
        router, all E experts and the shared expert (the expert bias is a buffer, not counted)."""
        return self._count(include_embeddings, self.num_experts)

    def num_active_parameters(self, include_embeddings: bool = True) -> int:
        """The parameters one token uses: an MoE layer counts its router, the k experts the token
        is routed to and the shared expert (the dense count for a dense model)."""
        return self._count(include_embeddings, self.moe_router_topk)

    def _count(self, include_embeddings: bool, experts: Optional[int]) -> int:
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        d = self.kv_channels
        q = self.num_attention_heads * d
        kv = 2 * self.num_query_groups * d
        bias = self.add_bias_linear
        norm = 2 * h if self.normalization == "LayerNorm" else h

        def mlp(width: int) -> int:  # fc1 (gate and up with SwiGLU) and fc2, biases if any
            fc1_out = 2 * width if self.swiglu else width
            return h * fc1_out + (fc1_out if bias else 0) + width * h + (h if bias else 0)

        attn = self.attention_weights() + (q + kv if self.add_qkv_bias else 0) + (h if bias else 0)
        if self.multi_latent_attention:  # no biases (validate); the two latents' RMSNorms
            attn += (self.q_lora_rank or 0) + self.kv_lora_rank
        qk_norm = (2 * d if self.qk_layernorm_scope == "head" else q + kv // 2)
        per_layer = attn + 2 * norm + (qk_norm if self.qk_layernorm else 0)
        per_layer += self.num_attention_heads if self.attention_sinks else 0
        moe_layers = sum(self.moe_layer_pattern())
        linear = sum(self.linear_attention_pattern())
        # a Gated DeltaNet layer: its weights, A_log and dt_bias per value head, the output norm
        linear_layer = self.linear_attention_weights() + 2 * self.linear_num_value_heads \
            + self.linear_value_head_dim + 2 * norm
        total = (L - linear) * per_layer + linear * linear_layer + (L - moe_layers) * mlp(f) + norm
        if moe_layers:
            fs = self.moe_shared_expert_intermediate_size
            shared = (mlp(fs) + (h if self.moe_shared_expert_gate else 0)) if fs else 0
            router = self.num_experts * (h + 1 if self.moe_router_linear_bias else h)
            total += moe_layers * (router + experts * mlp(self.moe_ffn_hidden_size)
                                   + shared)
        if include_embeddings:
            total += self.vocab_size * h
            if self.position_embedding_type == "learned_absolute":
                total += self.max_position_embeddings * h
            if self.untie_embeddings_and_output_weights:
                total += self.vocab_size * h
        return total


@dataclass
class ParallelConfig(_Section):
    GROUP = "parallelism"
    tensor_model_parallel_size: int = setting(1, layout=True, bound=AT_LEAST_ONE)
    pipeline_model_parallel_size: int = setting(1, layout=True, bound=AT_LEAST_ONE)
    # V, the one fact of virtual stages; --num-layers-per-virtual-pipeline-stage K gives it too
    virtual_pipeline_model_parallel_size: Optional[int] = setting(
        None, flag="--num-virtual-stages-per-pipeline-rank", layout=True, bound=AT_LEAST_ONE)
    sequence_parallel: bool = setting(False, layout=True)
    context_parallel_size: int = setting(  # docs/context_parallel.md
        1, "split each sequence over this many ranks, attention included", layout=True,
        bound=AT_LEAST_ONE)
    cp_comm_type: str = setting(
        "p2p", "context-parallel attention: p2p (ring), allgather (K/V) or a2a (Ulysses)",
        choices=CP_COMM_TYPES, layout=True)
    # The folded expert grid (docs/moe.md): each stage's TP x CP x DP ranks cut into ETP x EP x
    # EDP (the planner's Layout has both fields)
    expert_model_parallel_size: int = setting(
        1, "EP: the experts of a layer are split over this many ranks", layout=True,
        bound=AT_LEAST_ONE)
    expert_tensor_parallel_size: Optional[int] = setting(
        None, "ETP: each expert's weights split over this many ranks (default "
        "--tensor-model-parallel-size, as Megatron)", layout=True, bound=AT_LEAST_ONE)
    distributed_backend: Optional[str] = setting(None, "default nccl on CUDA, gloo on CPU",
                                                 choices=("gloo", "nccl"))
    device: Optional[str] = setting(None, "default cuda when available", choices=("cpu", "cuda"))
    distributed_timeout_minutes: float = setting(10.0)
    collective_record: bool = setting(
        True, "keep each rank's last collectives; when one fails or times out, write them and "
        "name the stuck rank (docs/clusters.md, \"When a run hangs\")")
    collective_record_dir: Optional[str] = setting(
        None, "where the ranks' records go; default: collective_record in --save, else in the "
        "working directory")

    def validate(self, world_size: Optional[int] = None,
                 seq_length: Optional[int] = None) -> "ParallelConfig":
        """``world_size`` (``seq_length``) None: the checks that do not depend on it."""
        self._check_choices()
        t, p = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        v, c = self.virtual_pipeline_model_parallel_size, self.context_parallel_size
        if v is not None and v > 1 and p == 1:
            raise ConfigError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        if world_size is not None and world_size % (t * c * p) != 0:
            raise ConfigError(
                f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({t}) "
                f"x --context-parallel-size ({c}) x --pipeline-model-parallel-size ({p}) = "
                f"{t * c * p}")
        if world_size is not None:
            check_expert_grid_divisible(world_size, self.expert_tp_size,
                                        self.expert_model_parallel_size, p)
        if self.sequence_parallel and t == 1:
            # Documented choice: SP without TP is meaningless (there is nothing to shard over), so
            # it is an error rather than a silent no-op (docs/tensor_parallel.md).
            raise ConfigError("--sequence-parallel requires --tensor-model-parallel-size > 1")
        if self.sequence_parallel and seq_length is not None and seq_length % t != 0:
            raise ConfigError(
                f"--seq-length ({seq_length}) must be divisible by "
                f"--tensor-model-parallel-size ({t}) with --sequence-parallel")
        return self

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor_model_parallel_size * self.context_parallel_size
                               * self.pipeline_model_parallel_size)

    @property
    def expert_tp_size(self) -> int:
        """ETP: --expert-tensor-parallel-size, or TP when not given (as Megatron)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def expert_data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.expert_tp_size * self.expert_model_parallel_size
                              * self.pipeline_model_parallel_size)

    def check_context_parallel(self, model: ModelConfig) -> None:
        """What the sequence split needs of the model (docs/context_parallel.md, "Using it")."""
        c, t, kind = self.context_parallel_size, self.tensor_model_parallel_size, self.cp_comm_type
        if c == 1:
            return
        s = model.seq_length
        # every comm type takes the same load-balanced 2C chunks (context_parallel/sharding.py,
        # as Megatron-LM's batch split); SP then cuts each rank's s/C tokens by T
        need = 2 * c
        if self.sequence_parallel:
            need = math.lcm(need, c * t)
        if s % need != 0:
            raise ConfigError(
                f"--seq-length ({s}) must be divisible by {need} with --context-parallel-size {c}"
                f" --cp-comm-type {kind}" + (f" and --sequence-parallel at TP {t}"
                                            if self.sequence_parallel else ""))
        heads, groups = model.num_attention_heads // t, model.num_query_groups // t
        if kind == "a2a" and (heads % c or groups % c):
            raise ConfigError(
                f"--cp-comm-type a2a splits the heads over --context-parallel-size ({c}): the "
                f"{heads} attention heads and {groups} query groups per TP rank must both be "
                f"divisible by it; use p2p or allgather")
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        if model.multi_latent_attention and kind != "a2a" and model.v_head_dim > qk:
            # the ring and all-gather move K and V as one stacked tensor: V is padded to K's width
            raise ConfigError(
                f"--cp-comm-type {kind} with --multi-latent-attention needs --v-head-dim "
                f"({model.v_head_dim}) <= --qk-head-dim + --qk-pos-emb-head-dim ({qk}); use a2a")
        if model.attention_dropout > 0:
            raise ConfigError(
                f"--attention-dropout {model.attention_dropout} with --context-parallel-size {c}:"
                f" the fused attention kernels CP merges take no dropout; set it to 0")
        if any(model.linear_attention_pattern()) and (
                kind != "a2a" or model.linear_num_key_heads // t % c):
            raise ConfigError(
                f"--linear-attention-freq with --context-parallel-size {c} --cp-comm-type {kind}: "
                f"the Gated DeltaNet recurrence runs along the whole sequence, so it needs a2a "
                f"with the {model.linear_num_key_heads // t} linear key heads per TP rank "
                f"divisible by {c}")


@dataclass
class OptimizerConfig(_Section):
    # The 16-bit mode is the model's (ModelConfig.params_dtype): the optimizer reads it from the
    # parameters it is given, so the two cannot disagree.
    GROUP = "optimizer and learning rate"
    optimizer: str = setting("adam", "adam: AdamW with decoupled weight decay; sgd: with momentum "
                             "--adam-beta1 (--zero-stage 0 only)", choices=("adam", "adamw", "sgd"))
    lr: float = setting(1e-3, bound=NON_NEGATIVE)
    min_lr: float = setting(1e-4, bound=NON_NEGATIVE)
    lr_decay_style: str = setting("cosine", choices=("constant", "linear", "cosine", "WSD",
                                                     "inverse-square-root"))
    lr_warmup_iters: int = setting(30, bound=NON_NEGATIVE)
    lr_warmup_fraction: Optional[float] = setting(None)
    lr_decay_iters: Optional[int] = setting(None, "default --train-iters")
    lr_wsd_decay_iters: Optional[int] = setting(None)  # WSD: length of the final decay phase
    lr_wsd_decay_style: str = setting("linear", choices=("linear", "cosine", "exponential",
                                                         "minus_sqrt"))
    weight_decay: float = setting(0.1, bound=NON_NEGATIVE)
    clip_grad: float = setting(1.0, bound=NON_NEGATIVE)  # 0 disables clipping
    adam_beta1: float = setting(0.9)
    adam_beta2: float = setting(0.95)
    adam_eps: float = setting(1e-8)
    # fp16 loss scaling (fp32 master weights and Adam states in both 16-bit modes)
    loss_scale: Optional[float] = setting(None, "static fp16 loss scale", group="mixed precision",
                                          bound=POSITIVE)
    initial_loss_scale: float = setting(2.0 ** 32, group="mixed precision", bound=POSITIVE)
    min_loss_scale: float = setting(1.0, group="mixed precision", bound=POSITIVE)
    loss_scale_window: int = setting(1000, group="mixed precision", bound=POSITIVE_INT)
    hysteresis: int = setting(2, group="mixed precision", bound=POSITIVE_INT)
    # Data parallelism / ZeRO (docs/data_parallel.md); --use-distributed-optimizer means stage 1
    zero_stage: int = setting(0, choices=(0, 1, 2, 3), group="data parallelism and ZeRO",
                              layout=True)  # 0 DDP, 1 optimizer states, 2 + grads, 3 + params
    num_distributed_optimizer_instances: int = setting(  # R: HSDP (docs/data_parallel.md)
        1, "shard the ZeRO state inside each of R instances of DP/R consecutive ranks (a node's "
        "worth), replicated across them", group="data parallelism and ZeRO", layout=True,
        bound=AT_LEAST_ONE)
    overlap_grad_reduce: bool = setting(False, group="data parallelism and ZeRO")
    overlap_param_gather: bool = setting(False, group="data parallelism and ZeRO")
    ddp_bucket_size: Optional[int] = setting(  # elements; None = one bucket per ~40M elements
        None, group="data parallelism and ZeRO", bound=POSITIVE_INT)
    zero3_prefetch_depth: int = setting(1, group="data parallelism and ZeRO", bound=NON_NEGATIVE)
    optimizer_cpu_offload: bool = setting(  # docs/offload.md
        False, "fp32 masters and Adam moments in host memory, stepped by torch's CPU AdamW",
        group="data parallelism and ZeRO")
    optimizer_offload_fraction: float = setting(
        1.0, "with --optimizer-cpu-offload: the share of the optimizer's elements on the host, in "
        "(0, 1]", group="data parallelism and ZeRO")

    def validate(self) -> "OptimizerConfig":
        self._check_choices()
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ConfigError(f"--adam-beta1/--adam-beta2 must be in [0, 1), got "
                              f"{self.adam_beta1}, {self.adam_beta2}")
        if self.zero_stage >= 1 and self.optimizer not in ("adam", "adamw"):
            raise ConfigError(f"--optimizer {self.optimizer}: the distributed optimizer (ZeRO) "
                              f"implements adam (AdamW); use --zero-stage 0 for sgd")
        if self.num_distributed_optimizer_instances > 1 and self.zero_stage == 0:
            raise ConfigError("--num-distributed-optimizer-instances > 1 shards the ZeRO state "
                              "inside each instance: it needs --zero-stage 1, 2 or 3")
        if self.overlap_param_gather and self.zero_stage == 0:
            raise ConfigError("--overlap-param-gather needs the distributed optimizer "
                              "(--use-distributed-optimizer or --zero-stage 1/2/3)")
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction <= 1:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got "
                              f"{self.lr_warmup_fraction}")
        if not 0 < self.optimizer_offload_fraction <= 1:
            raise ConfigError(f"--optimizer-offload-fraction must be in (0, 1], got "
                              f"{self.optimizer_offload_fraction}")
        if self.optimizer_cpu_offload and self.optimizer == "sgd":
            raise ConfigError("--optimizer-cpu-offload steps torch's AdamW on the host: it "
                              "cannot be combined with --optimizer sgd")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters N")
        return self


@dataclass
class DataConfig(_Section):
    GROUP = "data"
    data_path: Optional[list] = setting(
        None, "files, HF dataset names or Megatron .bin/.idx prefixes, optionally weighted "
        "('0.3 a 0.7 b'); default: the built-in corpus", nargs="*")
    split: str = setting("969,30,1")
    tokenizer_type: Optional[str] = setting(
        None, "HuggingFaceTokenizer, GPT2BPETokenizer, ...; default: a byte-level BPE trained on "
        "the corpus")
    tokenizer_model: Optional[str] = setting(None)
    dataset_text_field: str = setting("text")
    num_workers: int = setting(0, bound=NON_NEGATIVE)
    eod_mask_loss: bool = setting(False)
    reset_position_ids: bool = setting(
        False, "positions restart at 0 after each EOD: each packed document starts at position 0")
    reset_attention_mask: bool = setting(
        False, "each token attends only to its own document, causally (docs/data.md, "
        "\"Packed documents\")")
    mock_data: bool = setting(False, "random tokens (for smoke tests)")
    data_cache_path: Optional[str] = setting(None)

    def validate(self) -> "DataConfig":
        self._check_choices()
        if self.data_path is not None and len(self.data_path) == 0:
            raise ConfigError("--data-path was given without a value: name at least one file, "
                              "directory, HF dataset or .bin/.idx prefix (or drop the flag to use "
                              "the built-in corpus)")
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(x) for x in parts if x.strip() != ""]
        except ValueError:
            raise ConfigError(f"--split must be comma-separated numbers like 969,30,1, "
                              f"got {self.split!r}")
        if not weights or len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"--split must be up to three non-negative numbers with a positive "
                              f"sum, like 969,30,1; got {self.split!r}")
        if self.mock_data and self.data_path:
            raise ConfigError("--mock-data and --data-path are mutually exclusive")
        if self.mock_data and self.reset_attention_mask:
            raise ConfigError("--reset-attention-mask with --mock-data: random tokens have no "
                              "document ends; use --data-path or the built-in corpus")
        return self


@dataclass
class TrainingConfig(_Section):
    GROUP = "misc"
    micro_batch_size: int = setting(4, group="batch", layout=True, bound=POSITIVE)
    global_batch_size: Optional[int] = setting(
        None, "default micro-batch size x data-parallel size", group="batch", bound=POSITIVE)
    train_iters: int = setting(300, group="optimizer and learning rate", bound=NON_NEGATIVE)
    eval_interval: int = setting(100, group="logging and evaluation", bound=POSITIVE)
    eval_iters: int = setting(10, group="logging and evaluation", bound=NON_NEGATIVE)
    skip_train: bool = setting(False, group="logging and evaluation")
    seed: int = setting(1234)
    pipeline_schedule: Optional[str] = setting(  # None: default_schedule(v)
        None, choices=SCHEDULES, group="parallelism", layout=True)
    decoder_first_pipeline_num_layers: Optional[int] = setting(None, group="parallelism",
                                                               layout=True)
    decoder_last_pipeline_num_layers: Optional[int] = setting(None, group="parallelism",
                                                              layout=True)
    timing_log_level: int = setting(0, choices=(0, 1, 2), group="parallelism")
    exit_interval: Optional[int] = setting(None)
    exit_duration_in_mins: Optional[float] = setting(
        None, "save a checkpoint and exit 0 once the run has lasted this long", bound=POSITIVE)
    exit_signal_handler: bool = setting(
        False, "on SIGTERM/SIGINT finish the iteration, save a checkpoint, exit 0")
    check_for_nan_in_loss_and_grad: bool = setting(
        True, "bf16/fp32: a step with a NaN/Inf loss or grad norm is skipped, and the run stops "
        "at the next log line or save, naming it")
    # The MoE schedule switches (docs/moe.md, "Hiding the all-to-alls"); the executor receives them
    overlap_moe_expert_parallel_comm: bool = moe_setting(
        False, "MoE at EP > 1: the all-to-alls hidden behind the paired micro-batch's compute "
        "(Megatron's flag): the combined 1F1B at PP 1, every pipeline schedule's F&B pairs at "
        "PP > 1; alltoall dispatcher, no recompute")
    delay_wgrad_compute: bool = moe_setting(
        False, "with --overlap-moe-expert-parallel-comm: the experts' weight gradients of a "
        "paired backward are deferred and run while an all-to-all would otherwise be waited for "
        "(Megatron's flag; docs/moe.md)")

    def validate(self, data_parallel_size: Optional[int] = None) -> "TrainingConfig":
        """``data_parallel_size`` None: the checks that do not depend on it."""
        self._check_choices()
        dp = data_parallel_size or 1
        if self.global_batch_size is not None and self.global_batch_size % (
                self.micro_batch_size * dp) != 0:
            raise ConfigError(
                f"--global-batch-size ({self.global_batch_size}) must be a positive multiple of "
                f"--micro-batch-size ({self.micro_batch_size}) x data-parallel size "
                f"({dp}) = {self.micro_batch_size * dp}")
        if self.delay_wgrad_compute and not self.overlap_moe_expert_parallel_comm:
            # the deferred weight gradients fill the paired schedule's all-to-all waits: without
            # the pairs there is nothing for them to fill
            raise ConfigError("--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm "
                              "(it fills the paired micro-batches' all-to-all waits)")
        return self

    def num_micro_batches(self, data_parallel_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)


def check_pipeline_args(pp_size: int, num_microbatches: int, vpp_size: Optional[int] = None,
                        schedule: Optional[str] = None) -> str:
    """Validate (p, v, m, schedule); return the resolved schedule name. One-line ConfigErrors."""
    p, m, v = pp_size, num_microbatches, vpp_size or 1
    schedule = schedule or default_schedule(v)
    if schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got "
                          f"{schedule!r}")
    if schedule in V_SCHEDULES:
        if v not in (1, 2):  # 1: not given (the CLI); the V always builds 2 chunks per rank
            raise ConfigError(f"--pipeline-schedule {schedule} places exactly 2 chunks per rank "
                              f"(in a V); it does not take --num-layers-per-virtual-pipeline-stage")
        if p > 1 and m < 2 * p:
            raise ConfigError(f"--pipeline-schedule {schedule} needs at least 2 x "
                              f"--pipeline-model-parallel-size = {2 * p} micro-batches, the "
                              f"global batch gives {m}: raise --global-batch-size")
        return schedule
    if v > 1 and schedule != "interleaved":
        raise ConfigError(f"--pipeline-schedule {schedule} does not support virtual stages "
                          f"(--num-layers-per-virtual-pipeline-stage gives v={v}); use interleaved")
    if schedule == "interleaved" and v == 1:
        raise ConfigError("--pipeline-schedule interleaved needs "
                          "--num-layers-per-virtual-pipeline-stage (v > 1 chunks per rank)")
    if p > 1 and m < p:
        raise ConfigError(f"the global batch gives {m} micro-batches per pipeline, fewer than "
                          f"--pipeline-model-parallel-size ({p}): raise --global-batch-size to at "
                          f"least {p} x --micro-batch-size x data-parallel size")
    if schedule == "interleaved" and m % p != 0:
        raise ConfigError(f"interleaved pipelining needs the number of micro-batches ({m}) to be a "
                          f"multiple of --pipeline-model-parallel-size ({p}); adjust "
                          f"--global-batch-size")
    return schedule


def check_layer_split(num_layers: int, pp_size: int, per_vstage: Optional[int] = None,
                      first: Optional[int] = None, last: Optional[int] = None,
                      v_shape: bool = False) -> None:
    """Whether pipeline_parallel.partition can cut the layers so: ``per_vstage`` layers per
    virtual stage, an uneven ``first``/``last`` stage, or the V's two chunks per rank."""
    L, p = num_layers, pp_size
    if v_shape:  # two chunks of L/(2p) layers per rank, in a V (V_SCHEDULES)
        if per_vstage is not None or first is not None or last is not None or L % (2 * p) != 0:
            raise ConfigError(f"--pipeline-schedule zb-v/dualpipev cut --num-layers ({L}) into "
                              f"2 x --pipeline-model-parallel-size ({p}) equal chunks: it must be "
                              f"divisible by {2 * p}, without virtual-stage or uneven-split flags")
        return
    if per_vstage is not None:
        if first is not None or last is not None:
            raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                              "--num-layers-per-virtual-pipeline-stage")
        if p == 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs "
                              "--pipeline-model-parallel-size > 1")
        if per_vstage < 1 or L % (per_vstage * p) != 0:
            raise ConfigError(f"--num-layers ({L}) must be divisible by "
                              f"--num-layers-per-virtual-pipeline-stage ({per_vstage}) x "
                              f"--pipeline-model-parallel-size ({p}) = {per_vstage * p}")
        return
    if p > L:
        raise ConfigError(f"--pipeline-model-parallel-size ({p}) exceeds --num-layers ({L}): every "
                          f"stage needs at least one layer")
    for flag, val in (("--decoder-first-pipeline-num-layers", first),
                      ("--decoder-last-pipeline-num-layers", last)):
        if val is not None and (val < 1 or p == 1):
            raise ConfigError(f"{flag} ({val}) must be >= 1 and needs "
                              f"--pipeline-model-parallel-size > 1")
    if first is None and last is None:
        if L % p != 0:
            raise ConfigError(f"--num-layers ({L}) must be divisible by "
                              f"--pipeline-model-parallel-size ({p}); or set "
                              f"--decoder-first/last-pipeline-num-layers for an uneven split")
        return
    rest, n_rest = L - (first or 0) - (last or 0), p - (first is not None) - (last is not None)
    if n_rest == 0 and rest != 0:
        raise ConfigError(f"--decoder-first-pipeline-num-layers ({first}) + "
                          f"--decoder-last-pipeline-num-layers ({last}) must equal "
                          f"--num-layers ({L}) with --pipeline-model-parallel-size 2")
    if n_rest and (rest < n_rest or rest % n_rest != 0):
        raise ConfigError(f"after --decoder-first/last-pipeline-num-layers ({first}, {last}), the "
                          f"remaining {rest} of --num-layers ({L}) layers must split evenly (>= 1 "
                          f"each) over the other {n_rest} pipeline stages")


def check_compound_flags(a) -> None:
    """The checks of Megatron's compound flags (megalite.arguments.COMPOUND_FLAGS), which only
    the parsed command line ``a`` holds."""
    if a.num_query_groups is not None and not a.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention")
    if a.group_query_attention and a.num_query_groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups N")
    if a.bf16 and a.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive: choose one")
    if a.num_layers_per_virtual_pipeline_stage is not None and (
            a.virtual_pipeline_model_parallel_size is not None):
        raise ConfigError("give --num-layers-per-virtual-pipeline-stage or "
                          "--num-virtual-stages-per-pipeline-rank, not both")


@dataclass
class ExecutionConfig(_Section):
    """How the model runs, never what it computes: recomputation, kernels, compilation and the
    MoE dispatch (docs/performance.md). The model objects receive it as an argument."""

    GROUP = "speed (docs/performance.md)"
    recompute_granularity: Optional[str] = setting(
        None, choices=("full", "selective"), group="activation recomputation", layout=True)
    recompute_method: Optional[str] = setting(  # full only
        None, choices=("uniform", "block"), group="activation recomputation", layout=True)
    recompute_num_layers: Optional[int] = setting(None, group="activation recomputation",
                                                  layout=True)
    torch_compile: Optional[str] = setting(
        None, "compile each transformer layer with torch.compile (backend, default inductor)",
        choices=("inductor", "aot_eager", "eager"), nargs="?", const="inductor")
    use_apex: bool = setting(
        False, "NVIDIA apex's fused LayerNorm/RMSNorm (needs apex built with its CUDA extensions "
        "and a CUDA device)")
    cp_attention_kernel: str = setting(
        "auto", "context-parallel attention blocks: auto (fused: the CPU flash kernel; on CUDA "
        "flash, cuDNN or memory-efficient SDPA, self-checked) or math (exact fp32)",
        choices=("auto", "math"), group="parallelism")
    cross_entropy_chunk_tokens: int = setting(
        256, "the output layer and loss fused, this many tokens' logits at a time (the logits "
        "never whole; 0: whole, the old path; docs/tensor_parallel.md)", bound=NON_NEGATIVE)
    moe_grouped_gemm: bool = moe_setting(  # the loop needs each expert's row count on the host
        True, "all local experts in one grouped GEMM; --no-moe-grouped-gemm: a loop over them, "
        "which reads the row counts on the host every layer (Megatron's default is the loop)")
    moe_token_dispatcher_type: str = moe_setting(
        "alltoall", "how tokens reach the experts' ranks; Megatron's default is allgather, "
        "megalite's alltoall", choices=("alltoall", "allgather"))

    def validate(self) -> "ExecutionConfig":
        self._check_choices()
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ConfigError("--recompute-method only applies to --recompute-granularity full")
        k = self.recompute_num_layers  # layers per checkpoint (uniform) or recomputed (block)
        if k is not None and not (k >= 1 and self.recompute_granularity == "full"):
            raise ConfigError(f"--recompute-num-layers ({k}) must be >= 1 and needs "
                              f"--recompute-granularity full")
        return self


@dataclass
class CheckpointConfig(_Section):
    GROUP = "checkpoints"
    save: Optional[str] = setting(None)
    load: Optional[str] = setting(None)
    save_interval: Optional[int] = setting(None, "default: save only at the end of training",
                                           bound=POSITIVE)
    no_save_optim: bool = setting(False)
    async_save: bool = setting(
        False, "snapshot the checkpoint into host memory and write it in the background while "
        "training goes on (docs/checkpoints.md)")
    no_load_optim: bool = setting(False)
    no_load_rng: bool = setting(False)
    no_verify_load: bool = setting(
        False, "load without checking it against the save's probe loss and optimizer norms")
    finetune: bool = setting(False, "load model weights only and start at iteration 0")
    exit_on_missing_checkpoint: bool = setting(False)
    use_checkpoint_args: bool = setting(
        False, "take the model-shape flags from the checkpoint's args.json")

    def validate(self) -> "CheckpointConfig":
        self._check_choices()
        if self.use_checkpoint_args and not self.load:
            raise ConfigError("--use-checkpoint-args needs --load DIR")
        if self.finetune and not self.load:
            raise ConfigError("--finetune needs --load DIR")
        if self.async_save and not self.save:
            raise ConfigError("--async-save needs --save DIR")
        return self


@dataclass
class LoggingConfig(_Section):
    GROUP = "logging and evaluation"
    log_interval: int = setting(10, bound=POSITIVE)
    wandb_project: Optional[str] = setting(None)
    wandb_exp_name: Optional[str] = setting(None)
    wandb_save_dir: Optional[str] = setting(None)
    tensorboard_dir: Optional[str] = setting(None)
    log_throughput: bool = setting(True)
    log_memory_peak: bool = setting(
        True, "measure the peak tensor memory of the first logged iteration after the first (on "
        "CPU under the profiler: about a second, once; docs/planner.md)")
    log_planner_estimate: bool = setting(
        True, "print the planner's memory estimate beside the measured peak (docs/planner.md)")
    metrics_file: Optional[str] = setting(
        None, "default: metrics.jsonl in --save, else in the working directory")


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "optimizer": OptimizerConfig,
            "data": DataConfig, "training": TrainingConfig, "execution": ExecutionConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig}


@dataclass
class MegaliteConfig(_Section):
    """Everything pretrain.py needs; ``MegaliteConfig()`` is ``python pretrain.py``'s run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, world_size: Optional[int] = None) -> "MegaliteConfig":
        """Every check, in one place. ``world_size`` None (at parse time) skips those needing it."""
        par, tr = self.parallel, self.training
        # --use-checkpoint-args at parse time: the model is args.json's, not the command line's,
        # so the checks against it wait for resolve() (a converted MoE run needs no --num-experts)
        model_known = world_size is not None or not self.checkpoint.use_checkpoint_args
        if model_known:
            self.model.validate(par.tensor_model_parallel_size)
        par.validate(world_size, self.model.seq_length)
        self.optimizer.validate()
        self.data.validate()
        tr.validate(None if world_size is None else par.data_parallel_size(world_size))
        self.execution.validate()
        self.checkpoint.validate()
        self.logging.validate()
        p, v = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
        if model_known:
            par.check_context_parallel(self.model)
            if self.data.reset_attention_mask and any(self.model.linear_attention_pattern()):
                raise ConfigError("--reset-attention-mask with --linear-attention-freq: the Gated "
                                  "DeltaNet state would carry across documents; drop one of them")
            for section in (tr, self.execution):
                check_features(section, self.model)
            if self.model.mtp_num_layers and p > 1 and \
                    self.model.position_embedding_type == "learned_absolute":
                raise ConfigError("--mtp-num-layers with --pipeline-model-parallel-size > 1 needs "
                                  "--position-embedding-type rope (the stages' copies of the "
                                  "embedding are summed for the word embedding only)")
            if self.model.mtp_num_layers and self.model.tie_embeddings and \
                    self.optimizer.zero_stage == 3:
                raise ConfigError("--mtp-num-layers with --zero-stage 3 needs "
                                  "--untie-embeddings-and-output-weights (ZeRO-3 gathers a tied "
                                  "embedding for the main head only), or --zero-stage 2")
            self._check_experts()
            check_layer_split(self.model.num_layers, p, self.layers_per_virtual_stage(),
                              tr.decoder_first_pipeline_num_layers,
                              tr.decoder_last_pipeline_num_layers,
                              p > 1 and tr.pipeline_schedule in V_SCHEDULES)
        check_zero3_schedule(self.optimizer.zero_stage, tr.pipeline_schedule)
        hsdp = self.optimizer.num_distributed_optimizer_instances > 1
        if hsdp and self.model.num_experts is not None:
            raise ConfigError("--num-distributed-optimizer-instances > 1 with --num-experts: "
                              "expert weights shard over their own group, not an instance; use 1")
        if world_size is not None and p > 1 and tr.global_batch_size is not None:
            # m, p, v and the schedule must fit together, before any model is built
            check_pipeline_args(p, tr.num_micro_batches(par.data_parallel_size(world_size)), v,
                                tr.pipeline_schedule)
        vocab = self.model.vocab_size  # before resolve: the size of the BPE (or mock) to build
        if world_size is None and self.data.tokenizer_type is None and vocab < 260:
            raise ConfigError(f"--vocab-size must be at least 260 for a byte-level BPE tokenizer, "
                              f"got {vocab}")
        return self

    def _check_experts(self) -> None:
        """What the MoE settings need of the expert layout (the world size: ParallelConfig)."""
        m, par = self.model, self.parallel
        e, ep, etp = m.num_experts, par.expert_model_parallel_size, par.expert_tp_size
        if e is None:
            if ep != 1 or par.expert_tensor_parallel_size is not None:
                raise ConfigError("--expert-model-parallel-size / --expert-tensor-parallel-size "
                                  "need --num-experts N (a dense model has no experts to split)")
            return
        if e % ep:
            raise ConfigError(f"--num-experts ({e}) must be divisible by "
                              f"--expert-model-parallel-size ({ep})")
        if self.training.overlap_moe_expert_parallel_comm:
            self._check_moe_overlap()
        if m.moe_ffn_hidden_size % etp:
            raise ConfigError(f"--moe-ffn-hidden-size ({m.moe_ffn_hidden_size}) must be divisible "
                              f"by --expert-tensor-parallel-size ({etp})")
        fs, t = m.moe_shared_expert_intermediate_size, par.tensor_model_parallel_size
        if fs is not None and fs % t:  # the shared expert is a dense MLP, split over TP
            raise ConfigError(f"--moe-shared-expert-intermediate-size ({fs}) must be divisible "
                              f"by --tensor-model-parallel-size ({t})")
        if t > 1 and not par.sequence_parallel:  # as Megatron: each TP rank routes its own tokens
            raise ConfigError(f"--num-experts with --tensor-model-parallel-size {t} needs "
                              f"--sequence-parallel (every TP rank must route different tokens)")

    def _check_moe_overlap(self) -> None:
        """What the combined 1F1B (docs/moe.md, "Hiding the all-to-alls") composes with."""
        ex, par, flag = self.execution, self.parallel, "--overlap-moe-expert-parallel-comm"
        if par.expert_model_parallel_size == 1:
            raise ConfigError(f"{flag} needs --expert-model-parallel-size > 1 (at EP 1 no "
                              f"all-to-all runs, so there is nothing to hide)")
        if ex.moe_token_dispatcher_type != "alltoall":
            raise ConfigError(f"{flag} needs --moe-token-dispatcher-type alltoall (the "
                              f"allgather dispatcher's exchanges are not paired), got "
                              f"{ex.moe_token_dispatcher_type}")
        if ex.recompute_granularity is not None:
            # a recomputed forward would replay its all-to-alls inside the paired backward, out
            # of step with the other rank's pair (Megatron refuses it too)
            raise ConfigError(f"{flag} cannot be combined with --recompute-granularity "
                              f"{ex.recompute_granularity}: drop one of them")
        if self.optimizer.zero_stage == 3:
            # ZeRO-3's forward hooks gather the parameters the paired backward releases
            raise ConfigError(f"{flag} cannot be combined with --zero-stage 3: use ZeRO 0-2")

    def layers_per_virtual_stage(self) -> Optional[int]:
        par = self.parallel
        return layers_per_virtual_stage(self.model.num_layers, par.pipeline_model_parallel_size,
                                        par.virtual_pipeline_model_parallel_size)

    def resolve(self, world_size: int, tokenizer_vocab_size: int) -> "MegaliteConfig":
        """The run's configuration, validated and read-only, with the values that need the world
        and the tokenizer: the global batch, and the tokenizer's vocabulary unless the model's came
        from a checkpoint (``--use-checkpoint-args``; it may be larger, never predicted)."""
        m, par, tr = self.model, self.parallel, self.training
        vocab = m.vocab_size if self.checkpoint.use_checkpoint_args else tokenizer_vocab_size
        model = replace(m, vocab_size=vocab, tokenizer_vocab_size=(
            tokenizer_vocab_size if tokenizer_vocab_size != vocab else None))
        training = replace(tr, global_batch_size=(
            tr.global_batch_size or tr.micro_batch_size * par.data_parallel_size(world_size)))
        sections = {key: replace(getattr(self, key)) for key in SECTIONS}
        out = replace(self, **{**sections, "model": model, "training": training})
        out.validate(world_size)
        for section in [out] + [getattr(out, key) for key in SECTIONS]:
            object.__setattr__(section, "_frozen", True)
        return out


# Roles, and args.json: the MegaliteConfig of a checkpoint.
def _with_role(*roles: str) -> tuple:
    return tuple(f.name for f in fields(ModelConfig) if f.metadata.get("role") in roles)


# Flags whose value must agree between a checkpoint and the run that resumes it: they change the
# shapes of parameters (or, for rope/learned positions, which parameters exist).
MODEL_SHAPE_FIELDS = _with_role(SHAPE)
# Taken from args.json with --use-checkpoint-args (shape plus numerics that define the model).
CHECKPOINT_ARGS_FIELDS = _with_role(SHAPE, CHECKPOINT_ARG)

# What args.json files written before every default was declared once mean by a missing key: the
# dataclasses' defaults of then, where today's differ (config_from_dict fills these, never today's).
LEGACY_DEFAULTS = {
    "model": dict(num_layers=4, hidden_size=256, num_attention_heads=4, hidden_dropout=0.1,
                  attention_dropout=0.1),
    "optimizer": dict(lr=3e-4, min_lr=0.0, lr_warmup_iters=0, weight_decay=0.01,
                      adam_beta2=0.999),
    "training": dict(train_iters=500),
}


def flag_of(field_name: str) -> str:
    """How error messages name the ModelConfig field ``field_name``."""
    f = next(f for f in fields(ModelConfig) if f.name == field_name)
    return f.metadata.get("shown") or flag_name(f) or f.metadata["no_flag"]


def config_to_json(cfg: MegaliteConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


def config_from_dict(d: dict) -> MegaliteConfig:
    """Rebuild a MegaliteConfig from args.json. Unknown keys are ignored (older/newer files);
    a missing key takes LEGACY_DEFAULTS' value where there is one, else today's default."""
    kwargs, old_model = {}, d.get("model", {}) or {}
    for key, cls in SECTIONS.items():
        names = {f.name for f in fields(cls)}
        # older files kept the run switches (training, execution) in "model"
        sub = {**(old_model if key != "model" else {}), **(d.get(key, {}) or {})}
        # (files with use_distributed_optimizer always recorded its zero_stage 1 beside it)
        values = {**LEGACY_DEFAULTS.get(key, {}), **{k: v for k, v in sub.items() if k in names}}
        kwargs[key] = cls(**values)
    return MegaliteConfig(**kwargs)


def model_shape_differences(saved: ModelConfig, current: ModelConfig,
                            names: Sequence[str] = MODEL_SHAPE_FIELDS) -> List[str]:
    """'--flag: checkpoint X, now Y' for every shape-defining field that differs."""
    out = []
    for name in names:
        a, b = getattr(saved, name), getattr(current, name)
        if name == "moe_layer_freq" and saved.moe_layer_pattern() == current.moe_layer_pattern():
            continue  # two spellings of one layer pattern ("2" and "[1,0,1,0]") are one shape
        if a != b:
            out.append(f"{flag_of(name)}: checkpoint has {a}, this run has {b}")
    return out
