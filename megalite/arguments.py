"""Command-line flags -> :class:`MegaliteConfig` (flag spellings follow Megatron-LM).

Config flows one way (docs/design.md, "Conventions"): ``parse_args`` turns flags into the
dataclasses of ``megalite.config`` and runs ``MegaliteConfig.validate`` (every check that does not
depend on the world size); ``training.pretrain`` then builds the run's read-only configuration
with ``MegaliteConfig.resolve`` once the process group and the tokenizer exist, which checks the
rest (global batch divisibility by micro-batch x data-parallel size, TP x PP dividing the world).

Any problem is a :class:`ConfigError` whose message names the flag; ``pretrain.py`` prints it as one
line and exits with code 2 (docs/design.md, contract 8). Unknown flags go through the same path.

The defaults train a ~10M-parameter GPT-2-style model on the built-in corpus on one CPU in a few
minutes (README); they are chosen here rather than in the dataclasses, which keep library defaults.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import List, Optional, Sequence

from megalite.config import (
    SCHEDULES,
    CP_COMM_TYPES,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    MegaliteConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)

# Flags whose value must agree between a checkpoint and the run that resumes it: they change the
# shapes of parameters (or, for rope/learned positions, which parameters exist).
MODEL_SHAPE_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by",
    "position_embedding_type", "normalization", "swiglu", "add_bias_linear", "add_qkv_bias",
    "untie_embeddings_and_output_weights", "qk_layernorm",
)
# Taken from args.json with --use-checkpoint-args (shape plus numerics that define the model).
CHECKPOINT_ARGS_FIELDS = MODEL_SHAPE_FIELDS + (
    "seq_length", "rotary_base", "norm_epsilon", "activation", "init_method_std",
    "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_position_embeddings", "sliding_window", "max_window_layers",
    "hf_architecture")

_FLAG_OF_FIELD = {
    "add_bias_linear": "--disable-bias-linear",
    "add_qkv_bias": "--disable-bias-linear / --add-qkv-bias",
    "num_query_groups": "--num-query-groups",
    "vocab_size": "--vocab-size (or the tokenizer: --tokenizer-type/--tokenizer-model)",
}


def flag_of(field_name: str) -> str:
    """The command-line flag that sets a ModelConfig field (for error messages)."""
    return _FLAG_OF_FIELD.get(field_name, "--" + field_name.replace("_", "-"))


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error on several lines; we want one line (docs/design.md,
    contract 8)."""

    def error(self, message: str):  # noqa: D102 - argparse API
        raise ConfigError(message)


class _HelpFormatter(argparse.HelpFormatter):
    """Short metavars (INT, FLOAT, STR) and every default shown, so --help fits on a screen."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=44, width=100)

    def _get_default_metavar_for_optional(self, action):
        return {int: "INT", float: "FLOAT"}.get(action.type, "STR")

    def _format_action(self, action):
        shown = action.default not in (None, False, argparse.SUPPRESS)
        if action.option_strings and shown and "%(default)" not in (action.help or ""):
            action.help = ((action.help + " ") if action.help else "") + "(default: %(default)s)"
        return super()._format_action(action)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="pretrain.py",
        usage="[torchrun ...] %(prog)s [flags]   (flags by group below; spellings as Megatron-LM)",
        description="Pretrain a GPT model with tensor, sequence, pipeline and data parallelism. "
                    "Launch several processes with torchrun; flags follow Megatron-LM.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=6)
    g.add_argument("--hidden-size", type=int, default=384)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=6)
    g.add_argument("--group-query-attention", action="store_true",
                   help="use grouped-query attention with --num-query-groups KV heads")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="head dim; default h / heads")
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default seq length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rope-scaling-factor", type=float, default=None,
                   help="llama3 RoPE scaling (Llama 3.1+); default none")
    g.add_argument("--rope-low-freq-factor", type=float, default=1.0)
    g.add_argument("--rope-high-freq-factor", type=float, default=4.0)
    g.add_argument("--rope-original-max-position-embeddings", type=int, default=8192)
    g.add_argument("--qk-layernorm", action="store_true", help="RMSNorm over each q and k head")
    g.add_argument("--sliding-window", type=int, default=None,
                   help="W: query q attends keys q-W < k <= q (Megatron --window-size W-1 0)")
    g.add_argument("--max-window-layers", type=int, default=0,
                   help="with --sliding-window: the first N layers keep full attention")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="q/k/v bias even with --disable-bias-linear (Qwen2)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks, attention included")
    g.add_argument("--cp-comm-type", choices=list(CP_COMM_TYPES), default="p2p",
                   help="context-parallel attention: p2p (ring), allgather (K/V) or a2a (Ulysses)")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default nccl on CUDA, gloo on CPU")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default cuda when available")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--pipeline-schedule", default=None,
                   choices=SCHEDULES)
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0)

    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro-batch size x data-parallel size")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam", "adamw"], default="adam",
                   help="AdamW with decoupled weight decay")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "WSD",
                                                "inverse-square-root"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=30)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", choices=["linear", "cosine", "exponential",
                                                    "minus_sqrt"], default="linear")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--train-iters", type=int, default=300)

    g = p.add_argument_group("data parallelism and ZeRO")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=0)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--zero3-prefetch-depth", type=int, default=1)

    g = p.add_argument_group("activation recomputation")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = p.add_argument_group("speed (docs/performance.md)")
    g.add_argument("--torch-compile", nargs="?", const="inductor", default=None,
                   choices=["inductor", "aot_eager", "eager"],
                   help="compile each transformer layer with torch.compile (backend, default "
                        "inductor)")
    g.add_argument("--use-apex", action="store_true",
                   help="NVIDIA apex's fused LayerNorm/RMSNorm (needs apex built with its CUDA "
                        "extensions and a CUDA device)")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None,
                   help="default: save only at the end of training")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only and start at iteration 0")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model-shape flags from the checkpoint's args.json")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="files, HF dataset names or Megatron .bin/.idx prefixes, optionally "
                        "weighted ('0.3 a 0.7 b'); default: the built-in corpus")
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--tokenizer-type", type=str, default=None,
                   help="HuggingFaceTokenizer, GPT2BPETokenizer, ...; default: a byte-level BPE "
                        "trained on the corpus")
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=8192)
    g.add_argument("--dataset-text-field", type=str, default="text")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--mock-data", action="store_true", help="random tokens (for smoke tests)")
    g.add_argument("--data-cache-path", type=str, default=None)

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--skip-train", action="store_true")
    g.add_argument("--wandb-project", type=str, default=None)
    g.add_argument("--wandb-exp-name", type=str, default=None)
    g.add_argument("--wandb-save-dir", type=str, default=None)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--log-throughput", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--metrics-file", type=str, default=None,
                   help="default: metrics.jsonl in --save, else in the working directory")

    g = p.add_argument_group("misc")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save a checkpoint and exit 0 once the run has lasted this long")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM/SIGINT finish the iteration, save a checkpoint, exit 0")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction,
                   default=True, help="bf16/fp32: a NaN/Inf loss or grad norm stops the run "
                   "before the optimizer step")
    return p


def _config_from_namespace(a: argparse.Namespace) -> MegaliteConfig:
    if a.num_query_groups is not None and not a.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention")
    if a.group_query_attention and a.num_query_groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups N")
    if a.num_layers_per_virtual_pipeline_stage and a.num_virtual_stages_per_pipeline_rank:
        raise ConfigError("give --num-layers-per-virtual-pipeline-stage or "
                          "--num-virtual-stages-per-pipeline-rank, not both")
    params_dtype = "bfloat16" if a.bf16 else "float16" if a.fp16 else "float32"
    model = ModelConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads, num_query_groups=a.num_query_groups,
        kv_channels=a.kv_channels, seq_length=a.seq_length,
        max_position_embeddings=a.max_position_embeddings,
        vocab_size=a.vocab_size, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
        position_embedding_type=a.position_embedding_type, rotary_base=a.rotary_base,
        normalization=a.normalization, norm_epsilon=a.norm_epsilon, swiglu=a.swiglu,
        add_bias_linear=not a.disable_bias_linear,
        add_qkv_bias=True if a.add_qkv_bias else None,
        rope_scaling_factor=a.rope_scaling_factor, rope_low_freq_factor=a.rope_low_freq_factor,
        rope_high_freq_factor=a.rope_high_freq_factor,
        rope_original_max_position_embeddings=a.rope_original_max_position_embeddings,
        qk_layernorm=a.qk_layernorm, sliding_window=a.sliding_window,
        max_window_layers=a.max_window_layers,
        untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights,
        hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
        init_method_std=a.init_method_std,
        recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
        recompute_num_layers=a.recompute_num_layers, params_dtype=params_dtype,
        torch_compile=a.torch_compile, use_apex=a.use_apex,
    )
    # Virtual stages are one fact, ParallelConfig's v; MegaliteConfig.resolve derives the layers
    # per virtual stage from it. Either flag gives v.
    vpp = a.num_virtual_stages_per_pipeline_rank
    per, pp = a.num_layers_per_virtual_pipeline_stage, a.pipeline_model_parallel_size
    if per is not None:
        if per <= 0 or pp <= 0 or a.num_layers % (per * pp) != 0:
            raise ConfigError(f"--num-layers ({a.num_layers}) must be divisible by "
                              f"--num-layers-per-virtual-pipeline-stage ({per}) x "
                              f"--pipeline-model-parallel-size ({pp}), both positive")
        vpp = a.num_layers // (per * pp)
    parallel = ParallelConfig(
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=None if vpp == 1 else vpp,
        sequence_parallel=a.sequence_parallel, distributed_backend=a.distributed_backend,
        context_parallel_size=a.context_parallel_size, cp_comm_type=a.cp_comm_type,
        device=a.device, distributed_timeout_minutes=a.distributed_timeout_minutes,
    )
    optimizer = OptimizerConfig(
        optimizer=a.optimizer, lr=a.lr, min_lr=a.min_lr, lr_decay_style=a.lr_decay_style,
        lr_warmup_iters=a.lr_warmup_iters, lr_warmup_fraction=a.lr_warmup_fraction,
        lr_decay_iters=a.lr_decay_iters, lr_wsd_decay_iters=a.lr_wsd_decay_iters,
        lr_wsd_decay_style=a.lr_wsd_decay_style, weight_decay=a.weight_decay,
        clip_grad=a.clip_grad, adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2,
        adam_eps=a.adam_eps, bf16=a.bf16, fp16=a.fp16, loss_scale=a.loss_scale,
        initial_loss_scale=a.initial_loss_scale, min_loss_scale=a.min_loss_scale,
        loss_scale_window=a.loss_scale_window, hysteresis=a.hysteresis,
        zero_stage=a.zero_stage, use_distributed_optimizer=a.use_distributed_optimizer,
        overlap_grad_reduce=a.overlap_grad_reduce, overlap_param_gather=a.overlap_param_gather,
        ddp_bucket_size=a.ddp_bucket_size, zero3_prefetch_depth=a.zero3_prefetch_depth,
    )
    data = DataConfig(
        data_path=a.data_path if a.data_path else None, split=a.split,
        tokenizer_type=a.tokenizer_type, tokenizer_model=a.tokenizer_model,
        vocab_size=a.vocab_size, dataset_text_field=a.dataset_text_field,
        num_workers=a.num_workers, eod_mask_loss=a.eod_mask_loss, mock_data=a.mock_data,
        data_cache_path=a.data_cache_path,
    )
    if a.data_path is not None and len(a.data_path) == 0:
        raise ConfigError("--data-path was given without a value: name at least one file, "
                          "directory, HF dataset or .bin/.idx prefix (or drop the flag to use "
                          "the built-in corpus)")
    training = TrainingConfig(
        micro_batch_size=a.micro_batch_size, global_batch_size=a.global_batch_size,
        train_iters=a.train_iters, eval_interval=a.eval_interval, eval_iters=a.eval_iters,
        skip_train=a.skip_train, seed=a.seed, pipeline_schedule=a.pipeline_schedule,
        decoder_first_pipeline_num_layers=a.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=a.decoder_last_pipeline_num_layers,
        timing_log_level=a.timing_log_level, exit_interval=a.exit_interval,
        exit_duration_in_mins=a.exit_duration_in_mins, exit_signal_handler=a.exit_signal_handler,
        check_for_nan_in_loss_and_grad=a.check_for_nan_in_loss_and_grad,
    )
    checkpoint = CheckpointConfig(
        save=a.save, load=a.load, save_interval=a.save_interval, no_save_optim=a.no_save_optim,
        no_load_optim=a.no_load_optim, no_load_rng=a.no_load_rng, finetune=a.finetune,
        exit_on_missing_checkpoint=a.exit_on_missing_checkpoint,
        use_checkpoint_args=a.use_checkpoint_args,
    )
    logging = LoggingConfig(
        log_interval=a.log_interval, wandb_project=a.wandb_project,
        wandb_exp_name=a.wandb_exp_name, wandb_save_dir=a.wandb_save_dir,
        tensorboard_dir=a.tensorboard_dir, log_throughput=a.log_throughput,
        metrics_file=a.metrics_file,
    )
    return MegaliteConfig(model=model, parallel=parallel, optimizer=optimizer, data=data,
                          training=training, checkpoint=checkpoint, logging=logging)


def parse_args(argv: Optional[Sequence[str]] = None) -> MegaliteConfig:
    """Flags -> validated MegaliteConfig. Raises ConfigError (one line) on any bad input."""
    parser = build_parser()
    ns = parser.parse_args(list(argv) if argv is not None else None)
    if ns.min_lr > ns.lr and parser.get_default("min_lr") == ns.min_lr:
        # the default floor is for the default --lr; a smaller --lr brings the floor down with it
        ns.min_lr = ns.lr
    return _config_from_namespace(ns).validate()


# ------------------------------------------------------------------------------------------------
# args.json: the MegaliteConfig of a checkpoint
# ------------------------------------------------------------------------------------------------
def config_to_json(cfg: MegaliteConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


def config_from_dict(d: dict) -> MegaliteConfig:
    """Rebuild a MegaliteConfig from args.json (unknown keys are ignored: older/newer files)."""
    parts = {"model": ModelConfig, "parallel": ParallelConfig, "optimizer": OptimizerConfig,
             "data": DataConfig, "training": TrainingConfig, "checkpoint": CheckpointConfig,
             "logging": LoggingConfig}
    kwargs = {}
    for key, cls in parts.items():
        sub = d.get(key, {}) or {}
        names = {f.name for f in fields(cls)}
        kwargs[key] = cls(**{k: v for k, v in sub.items() if k in names})
    return MegaliteConfig(**kwargs)


def model_shape_differences(saved: ModelConfig, current: ModelConfig,
                            names: Sequence[str] = MODEL_SHAPE_FIELDS) -> List[str]:
    """'--flag: checkpoint X, now Y' for every shape-defining field that differs."""
    out = []
    for name in names:
        a, b = getattr(saved, name), getattr(current, name)
        if a != b:
            out.append(f"{flag_of(name)}: checkpoint has {a}, this run has {b}")
    return out
