"""Typed configuration for megalite.

Config flows one way (docs/design.md, "Conventions"): command-line flags -> these dataclasses
(validated once, with errors that name the flag) -> the objects built from them. No module reads
flags or environment variables on its own.

Every check lives in a ``validate`` method here; ``MegaliteConfig.validate`` runs them all (and
the checks that span sections). ``MegaliteConfig.resolve`` is the one place values are derived
(global batch size, vocab size from the tokenizer, ...): it returns a new, validated
config that is read-only from then on, so no part of a run can change what another part reads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Optional


# Context-parallel attention implementations (--cp-comm-type; docs/context_parallel.md).
CP_COMM_TYPES = ("p2p", "allgather", "a2a")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending flag(s) and what would be valid."""


# The pipeline schedules (docs/pipeline_parallel.md); the V ones place two chunks per rank in a V
# (chunk 0 of rank r is virtual stage r, chunk 1 is 2p-1-r), so rank 0 holds embedding and loss.
V_SCHEDULES = ("zb-v", "dualpipev")
SCHEDULES = ("1f1b", "interleaved", "zb-h1") + V_SCHEDULES


def dtype_from_name(name: str):
    """The torch dtype of a ``params_dtype`` name (float32, bfloat16, float16; validated here)."""
    import torch  # here only: the rest of this module needs no torch

    return getattr(torch, name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_world_divisible(world_size: int, tp: int, cp: int, pp: int) -> int:
    """The data-parallel size of a world of ``world_size`` ranks at TP x CP x PP, or a
    ConfigError naming the three flags (the one home of this check)."""
    if world_size % (tp * cp * pp) != 0:
        raise ConfigError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) "
            f"x --context-parallel-size ({cp}) x --pipeline-model-parallel-size ({pp}) = "
            f"{tp * cp * pp}")
    return world_size // (tp * cp * pp)


class _Section:
    """Read-only once frozen (``MegaliteConfig.resolve`` freezes what it returns)."""

    _frozen = False

    def __setattr__(self, name, value):
        if self._frozen:
            raise AttributeError(f"{type(self).__name__}.{name}: the configuration is read-only "
                                 f"once resolved; build a new one with dataclasses.replace")
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ModelConfig(_Section):
    """Shape and numerics of a GPT model (GPT-2 and Llama families).

    Field names follow Megatron-LM's flags (``num_layers`` is ``--num-layers``).
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default 4*h (GPT-2) / set explicitly for SwiGLU
    num_query_groups: Optional[int] = None  # GQA: None means = num_attention_heads (MHA)
    kv_channels: Optional[int] = None  # head dim; default hidden_size // num_attention_heads
    seq_length: int = 256
    max_position_embeddings: Optional[int] = None  # default seq_length
    vocab_size: int = 8192  # embedding rows before padding (see padded_vocab_size)
    # Ids the tokenizer produces when it has fewer than vocab_size (None: vocab_size). Rows at or
    # beyond it are treated like the padding: never predicted, masked out of the softmax and loss.
    tokenizer_vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0
    # Llama 3.1's "llama3" RoPE scaling (docs/models.md); None: unscaled rotary embedding.
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    qk_layernorm: bool = False  # RMSNorm over each q and k head (Qwen3), before RoPE
    # Sliding-window attention (HF's convention): query q sees keys q - W < k <= q in layers
    # numbered >= max_window_layers (0-based); the first max_window_layers keep full attention.
    sliding_window: Optional[int] = None
    max_window_layers: int = 0
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    activation: str = "gelu"  # gelu | gelu_tanh | silu (silu is used with swiglu)
    swiglu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: Optional[bool] = None  # None: same as add_bias_linear
    untie_embeddings_and_output_weights: bool = False
    # The Hugging Face class this model was imported from (e.g. "Qwen2ForCausalLM"): the export
    # writes it back, where the shape alone could be read as more than one family.
    hf_architecture: Optional[str] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # Activation recomputation: None | "full" | "selective"
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None  # "uniform" | "block" (full only)
    recompute_num_layers: Optional[int] = None
    params_dtype: str = "float32"  # float32 | bfloat16 | float16
    # Speed only (docs/performance.md): compile each transformer layer with this torch.compile
    # backend (None: eager); use NVIDIA apex's fused norms (CUDA only).
    torch_compile: Optional[str] = None
    use_apex: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
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

    # ----------------------------------------------------------------------------------------
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
        return self.sliding_window

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def validate(self, tensor_model_parallel_size: int = 1) -> "ModelConfig":
        t = tensor_model_parallel_size
        positive = ["num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "seq_length", "vocab_size", "num_query_groups", "make_vocab_size_divisible_by"]
        for name in positive:
            if getattr(self, name) is None or getattr(self, name) <= 0:
                raise ConfigError(f"{_flag(name)} must be a positive integer, got {getattr(self, name)}")
        if self.tokenizer_vocab_size is not None and self.tokenizer_vocab_size > self.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.tokenizer_vocab_size} ids but the model's vocabulary "
                f"has {self.vocab_size} rows (--vocab-size / the checkpoint): every id the "
                f"tokenizer produces needs an embedding row")
        if self.kv_channels is None:  # only derived when h divides evenly (__post_init__)
            raise ConfigError(
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads}), or give the head dim with --kv-channels")
        if self.kv_channels <= 0:
            raise ConfigError(f"--kv-channels must be a positive integer, got {self.kv_channels}")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ConfigError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.num_query_groups})")
        if self.num_attention_heads % t != 0:
            raise ConfigError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({t})")
        if self.num_query_groups % t != 0:
            raise ConfigError(
                f"--num-query-groups ({self.num_query_groups}) must be divisible by "
                f"--tensor-model-parallel-size ({t})")
        if self.ffn_hidden_size % t != 0:
            raise ConfigError(
                f"--ffn-hidden-size ({self.ffn_hidden_size}) must be divisible by "
                f"--tensor-model-parallel-size ({t})")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(f"--position-embedding-type must be learned_absolute or rope, got "
                              f"{self.position_embedding_type!r}")
        if self.position_embedding_type == "rope" and self.kv_channels % 2 != 0:
            raise ConfigError(f"rope needs an even head dim, got {self.kv_channels}")
        if self.rope_scaling_factor is not None and (
                self.position_embedding_type != "rope" or self.rope_scaling_factor < 1.0
                or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
                or self.rope_original_max_position_embeddings <= 0):
            raise ConfigError(
                "--rope-scaling-factor needs --position-embedding-type rope, a factor >= 1, "
                "0 < --rope-low-freq-factor < --rope-high-freq-factor and a positive "
                "--rope-original-max-position-embeddings")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"--sliding-window must be a positive integer (keys per query), "
                              f"got {self.sliding_window}")
        if not 0 <= self.max_window_layers:
            raise ConfigError(f"--max-window-layers must be >= 0, got {self.max_window_layers}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        if self.activation not in ("gelu", "gelu_tanh", "silu", "relu"):
            raise ConfigError(f"activation must be gelu, gelu_tanh, silu or relu, got {self.activation!r}")
        if self.seq_length > self.max_position_embeddings and self.position_embedding_type == "learned_absolute":
            raise ConfigError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings})")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{_flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(f"--recompute-granularity must be full or selective, got "
                              f"{self.recompute_granularity!r}")
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ConfigError("--recompute-method only applies to --recompute-granularity full")
        if self.recompute_method not in (None, "uniform", "block"):
            raise ConfigError(f"--recompute-method must be uniform or block, got {self.recompute_method!r}")
        k = self.recompute_num_layers  # layers per checkpoint (uniform) or recomputed (block)
        if k is not None and not (k >= 1 and self.recompute_granularity == "full"):
            raise ConfigError(f"--recompute-num-layers ({k}) must be >= 1 and needs "
                              f"--recompute-granularity full")
        if self.params_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"params dtype must be float32, bfloat16 or float16, got {self.params_dtype!r}")
        if self.torch_compile not in (None, "inductor", "aot_eager", "eager"):
            raise ConfigError(f"--torch-compile must be inductor, aot_eager or eager, got "
                              f"{self.torch_compile!r}")
        return self

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Parameter count Ψ of the full (unsharded, unpadded) model."""
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        d = self.kv_channels
        q = self.num_attention_heads * d
        kv = 2 * self.num_query_groups * d
        bias = self.add_bias_linear
        qkv_bias = self.add_qkv_bias
        norm = 2 * h if self.normalization == "LayerNorm" else h
        attn = h * (q + kv) + (q + kv if qkv_bias else 0) + q * h + (h if bias else 0)
        fc1_out = 2 * f if self.swiglu else f
        mlp = h * fc1_out + (fc1_out if bias else 0) + f * h + (h if bias else 0)
        per_layer = attn + mlp + 2 * norm + (2 * d if self.qk_layernorm else 0)
        total = L * per_layer + norm
        if include_embeddings:
            total += self.vocab_size * h
            if self.position_embedding_type == "learned_absolute":
                total += self.max_position_embeddings * h
            if self.untie_embeddings_and_output_weights:
                total += self.vocab_size * h
        return total


@dataclass
class ParallelConfig(_Section):
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1  # the sequence split over C ranks (docs/context_parallel.md)
    cp_comm_type: str = "p2p"
    distributed_backend: Optional[str] = None  # None: nccl with CUDA, else gloo
    device: Optional[str] = None  # None: cuda when available, else cpu
    distributed_timeout_minutes: float = 10.0

    def validate(self, world_size: Optional[int] = None,
                 seq_length: Optional[int] = None) -> "ParallelConfig":
        """``world_size`` (``seq_length``) None: the checks that do not depend on it."""
        t, p = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        v, c = self.virtual_pipeline_model_parallel_size, self.context_parallel_size
        if t < 1 or p < 1:
            raise ConfigError(
                f"--tensor-model-parallel-size ({t}) and --pipeline-model-parallel-size ({p}) "
                f"must be >= 1")
        if c < 1:
            raise ConfigError(f"--context-parallel-size must be >= 1, got {c}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ConfigError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got "
                              f"{self.cp_comm_type!r}")
        if v is not None and v < 1:
            raise ConfigError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {v}")
        if v is not None and v > 1 and p == 1:
            raise ConfigError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        if world_size is not None:
            check_world_divisible(world_size, t, c, p)
        if self.sequence_parallel and t == 1:
            # Documented choice: SP without TP is meaningless (there is nothing to shard over), so
            # it is an error rather than a silent no-op (docs/tensor_parallel.md).
            raise ConfigError("--sequence-parallel requires --tensor-model-parallel-size > 1")
        if self.sequence_parallel and seq_length is not None and seq_length % t != 0:
            raise ConfigError(
                f"--seq-length ({seq_length}) must be divisible by "
                f"--tensor-model-parallel-size ({t}) with --sequence-parallel")
        if self.distributed_backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"--distributed-backend must be gloo or nccl, got {self.distributed_backend!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        return self

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor_model_parallel_size * self.context_parallel_size
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
        if model.attention_dropout > 0:
            raise ConfigError(
                f"--attention-dropout {model.attention_dropout} with --context-parallel-size {c}:"
                f" the fused attention kernels CP merges take no dropout; set it to 0")
        windowed = [i for i in range(model.num_layers) if model.attention_window(i) is not None]
        if windowed and kind != "a2a":
            raise ConfigError(
                f"--sliding-window {model.sliding_window} with --cp-comm-type {kind}: its CP "
                f"attention has no window (layers {windowed[0]}.. are windowed); use "
                f"--cp-comm-type a2a (each rank attends over the whole sequence for its heads) or "
                f"--context-parallel-size 1")


@dataclass
class OptimizerConfig(_Section):
    optimizer: str = "adam"  # AdamW with decoupled weight decay
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"  # constant | linear | cosine | WSD
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_decay_iters: Optional[int] = None  # default train_iters
    lr_wsd_decay_iters: Optional[int] = None  # WSD: length of the final decay phase
    lr_wsd_decay_style: str = "linear"
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # 0 disables clipping
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    # Mixed precision (fp32 master weights and Adam states in both 16-bit modes)
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # static scale; None = dynamic (fp16)
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # Data parallelism / ZeRO (issue: distributed optimizer)
    zero_stage: int = 0  # 0 DDP, 1 optimizer states, 2 + grads, 3 + params
    use_distributed_optimizer: bool = False  # Megatron's spelling of zero_stage >= 1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None  # elements per bucket; None = one bucket per ~40M elems
    zero3_prefetch_depth: int = 1

    def __post_init__(self) -> None:
        if self.use_distributed_optimizer and self.zero_stage == 0:
            self.zero_stage = 1  # Megatron's spelling of ZeRO-1

    def validate(self) -> "OptimizerConfig":
        if self.optimizer not in ("adam", "adamw", "sgd"):
            raise ConfigError(f"--optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are mutually exclusive: choose one")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "WSD", "inverse-square-root"):
            raise ConfigError(f"--lr-decay-style must be constant, linear, cosine or WSD, got "
                              f"{self.lr_decay_style!r}")
        if self.lr < 0 or self.min_lr < 0:
            raise ConfigError(f"--lr ({self.lr}) and --min-lr ({self.min_lr}) must be >= 0")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.clip_grad < 0:
            raise ConfigError(f"--clip-grad must be >= 0 (0 disables), got {self.clip_grad}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ConfigError(f"--adam-beta1/--adam-beta2 must be in [0, 1), got "
                              f"{self.adam_beta1}, {self.adam_beta2}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.zero_stage >= 1 and self.optimizer not in ("adam", "adamw"):
            raise ConfigError(f"--optimizer {self.optimizer}: the distributed optimizer (ZeRO) "
                              f"implements adam (AdamW); use --zero-stage 0 for sgd")
        if self.overlap_param_gather and self.zero_stage == 0:
            raise ConfigError("--overlap-param-gather needs the distributed optimizer "
                              "(--use-distributed-optimizer or --zero-stage 1/2/3)")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size <= 0:
            raise ConfigError(f"--ddp-bucket-size must be a positive number of elements, got "
                              f"{self.ddp_bucket_size}")
        if self.zero3_prefetch_depth < 0:
            raise ConfigError(f"--zero3-prefetch-depth must be >= 0, got {self.zero3_prefetch_depth}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"--loss-scale must be > 0, got {self.loss_scale}")
        if self.loss_scale_window <= 0 or self.hysteresis <= 0:
            raise ConfigError("--loss-scale-window and --hysteresis must be positive")
        if self.min_loss_scale <= 0 or self.initial_loss_scale <= 0:
            raise ConfigError("--min-loss-scale and --initial-loss-scale must be positive")
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction <= 1:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got "
                              f"{self.lr_warmup_fraction}")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters N")
        return self

    @property
    def params_dtype(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


@dataclass
class DataConfig(_Section):
    data_path: Optional[list] = None  # None: the built-in corpus (Python stdlib sources)
    split: str = "969,30,1"
    tokenizer_type: Optional[str] = None  # None: byte-level BPE trained on the corpus
    tokenizer_model: Optional[str] = None
    vocab_size: int = 8192  # for the trained tokenizer
    dataset_text_field: str = "text"
    num_workers: int = 0
    eod_mask_loss: bool = False
    mock_data: bool = False
    data_cache_path: Optional[str] = None

    def validate(self) -> "DataConfig":
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(x) for x in parts if x.strip() != ""]
        except ValueError:
            raise ConfigError(f"--split must be comma-separated numbers like 969,30,1, got {self.split!r}")
        if not weights or len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"--split must be up to three non-negative numbers with a positive "
                              f"sum, like 969,30,1; got {self.split!r}")
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.mock_data and self.data_path:
            raise ConfigError("--mock-data and --data-path are mutually exclusive")
        if self.vocab_size is not None and self.vocab_size < 260:
            raise ConfigError(f"--vocab-size must be at least 260 for a byte-level BPE tokenizer, "
                              f"got {self.vocab_size}")
        return self


@dataclass
class TrainingConfig(_Section):
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # default micro * dp
    train_iters: int = 500
    eval_interval: int = 100
    eval_iters: int = 10
    skip_train: bool = False
    seed: int = 1234
    # pipeline schedule
    pipeline_schedule: Optional[str] = None  # 1f1b|interleaved|zb-h1|zb-v|dualpipev (None: auto)
    num_layers_per_virtual_pipeline_stage: Optional[int] = None  # derived by resolve, from v
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    timing_log_level: int = 0
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None  # save and stop after this much wall time
    exit_signal_handler: bool = False  # SIGTERM/SIGINT: finish the iteration, save, exit 0
    check_for_nan_in_loss_and_grad: bool = True  # bf16/fp32: stop before applying a NaN step

    def validate(self, data_parallel_size: Optional[int] = None) -> "TrainingConfig":
        """``data_parallel_size`` None: the checks that do not depend on it."""
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise ConfigError(f"--exit-duration-in-mins must be positive, got "
                              f"{self.exit_duration_in_mins}")
        if self.micro_batch_size <= 0:
            raise ConfigError(f"--micro-batch-size must be positive, got {self.micro_batch_size}")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ConfigError(f"--global-batch-size must be positive, got {self.global_batch_size}")
        dp = data_parallel_size or 1
        if self.global_batch_size is not None and self.global_batch_size % (
                self.micro_batch_size * dp) != 0:
            raise ConfigError(
                f"--global-batch-size ({self.global_batch_size}) must be a positive multiple of "
                f"--micro-batch-size ({self.micro_batch_size}) x data-parallel size "
                f"({dp}) = {self.micro_batch_size * dp}")
        if self.train_iters < 0:
            raise ConfigError(f"--train-iters must be >= 0, got {self.train_iters}")
        if self.eval_interval <= 0 or self.eval_iters < 0:
            raise ConfigError(f"--eval-interval must be > 0 and --eval-iters >= 0, got "
                              f"{self.eval_interval}, {self.eval_iters}")
        if self.num_layers_per_virtual_pipeline_stage is not None and \
                self.num_layers_per_virtual_pipeline_stage <= 0:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage must be positive, got "
                              f"{self.num_layers_per_virtual_pipeline_stage}")
        if self.pipeline_schedule not in (None,) + SCHEDULES:
            raise ConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got "
                              f"{self.pipeline_schedule!r}")
        return self

    def num_micro_batches(self, data_parallel_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)


def check_pipeline_args(pp_size: int, num_microbatches: int, vpp_size: Optional[int] = None,
                        schedule: Optional[str] = None) -> str:
    """Validate (p, v, m, schedule); return the resolved schedule name. One-line ConfigErrors."""
    p, m, v = pp_size, num_microbatches, vpp_size or 1
    if schedule is None:
        schedule = "interleaved" if v > 1 else "1f1b"
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


@dataclass
class CheckpointConfig(_Section):
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    exit_on_missing_checkpoint: bool = False
    use_checkpoint_args: bool = False

    def validate(self) -> "CheckpointConfig":
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError(f"--save-interval must be positive, got {self.save_interval}")
        if self.use_checkpoint_args and not self.load:
            raise ConfigError("--use-checkpoint-args needs --load DIR")
        if self.finetune and not self.load:
            raise ConfigError("--finetune needs --load DIR")
        return self


@dataclass
class LoggingConfig(_Section):
    log_interval: int = 10
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    log_throughput: bool = True
    metrics_file: Optional[str] = None

    def validate(self) -> "LoggingConfig":
        if self.log_interval <= 0:
            raise ConfigError(f"--log-interval must be positive, got {self.log_interval}")
        return self


@dataclass
class MegaliteConfig(_Section):
    """Everything pretrain.py needs, built by megalite.arguments from the command line."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, world_size: Optional[int] = None) -> "MegaliteConfig":
        """Every check, in one place. ``world_size`` None (at parse time) skips those needing it."""
        par, tr = self.parallel, self.training
        self.model.validate(par.tensor_model_parallel_size)
        par.validate(world_size, self.model.seq_length)
        par.check_context_parallel(self.model)
        self.optimizer.validate()
        self.data.validate()
        tr.validate(None if world_size is None else par.data_parallel_size(world_size))
        self.checkpoint.validate()
        self.logging.validate()
        L, p, v = self.model.num_layers, par.pipeline_model_parallel_size, \
            par.virtual_pipeline_model_parallel_size
        if v is not None and L % (p * v) != 0:
            raise ConfigError(f"--num-layers ({L}) must be divisible by "
                              f"--pipeline-model-parallel-size ({p}) x "
                              f"--num-virtual-stages-per-pipeline-rank ({v})")
        if self.optimizer.zero_stage == 3 and tr.pipeline_schedule in ("zb-h1",) + V_SCHEDULES:
            raise ConfigError(f"--zero-stage 3 does not support --pipeline-schedule "
                              f"{tr.pipeline_schedule} (deferred weight gradients would keep every "
                              f"unit gathered until its W pass); use 1f1b or interleaved, or "
                              f"--zero-stage 1/2")
        if world_size is not None and p > 1 and tr.global_batch_size is not None:
            # m, p, v and the schedule must fit together, before any model is built
            check_pipeline_args(p, tr.num_micro_batches(par.data_parallel_size(world_size)), v,
                                tr.pipeline_schedule)
        return self

    def resolve(self, world_size: int, tokenizer_vocab_size: int) -> "MegaliteConfig":
        """The run's configuration: derived values filled in, validated, read-only.

        Derived here: the global batch (default micro-batch x data-parallel size), the layers per
        virtual stage (from ``parallel.virtual_pipeline_model_parallel_size``, never back), and
        the vocabulary: the tokenizer's, unless the model's came from a checkpoint
        (``--use-checkpoint-args``), which may be larger (the extra rows are never predicted).
        (Defaults that need no outside facts are filled in at construction, in
        ``__post_init__``.)
        """
        m, par, tr = self.model, self.parallel, self.training
        vocab = m.vocab_size if self.checkpoint.use_checkpoint_args else tokenizer_vocab_size
        model = replace(m, vocab_size=vocab, tokenizer_vocab_size=(
            tokenizer_vocab_size if tokenizer_vocab_size != vocab else None))
        v = par.virtual_pipeline_model_parallel_size  # the fact; layers per virtual stage follow
        per = m.num_layers // (par.pipeline_model_parallel_size * v) if v else None
        training = replace(tr, num_layers_per_virtual_pipeline_stage=per, global_batch_size=(
            tr.global_batch_size or tr.micro_batch_size * par.data_parallel_size(world_size)))
        out = replace(self, model=model, optimizer=replace(self.optimizer), training=training,
                      parallel=replace(par), data=replace(self.data),
                      checkpoint=replace(self.checkpoint), logging=replace(self.logging))
        out.validate(world_size)
        for section in (out, out.model, out.parallel, out.optimizer, out.data, out.training,
                        out.checkpoint, out.logging):
            object.__setattr__(section, "_frozen", True)
        return out
