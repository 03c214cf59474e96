"""Flags -> MegaliteConfig: Megatron spellings, defaults, validation with one clear message."""

import pytest

from megalite.arguments import (
    config_from_dict,
    model_shape_differences,
    parse_args,
)
from megalite.config import ConfigError


def test_defaults_are_a_small_gpt2_for_cpu():
    cfg = parse_args([])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (6, 384, 6, 256)
    assert cfg.data.vocab_size == 8192 and cfg.data.data_path is None
    assert 8e6 <= m.num_parameters() <= 16e6  # "~10M parameters"
    assert m.params_dtype == "float32" and cfg.optimizer.lr_decay_style == "cosine"
    assert cfg.optimizer.lr_warmup_iters > 0 and cfg.training.train_iters == 300
    assert cfg.training.eval_interval == 100


def test_flags_reach_the_dataclasses():
    cfg = parse_args([
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--bf16", "--lr", "3e-4", "--min-lr", "3e-5",
        "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10", "--zero-stage", "2",
        "--overlap-grad-reduce", "--recompute-granularity", "full", "--recompute-method",
        "uniform", "--recompute-num-layers", "1", "--save", "/tmp/x", "--no-save-optim",
        "--data-path", "0.3", "a", "0.7", "b", "--eod-mask-loss", "--seed", "7",
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"])
    m = cfg.model
    assert m.num_query_groups == 2 and m.position_embedding_type == "rope" and m.swiglu
    assert not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert cfg.parallel.sequence_parallel and not hasattr(m, "sequence_parallel")
    assert m.params_dtype == "bfloat16" and cfg.optimizer.bf16
    assert m.recompute_granularity == "full" and m.recompute_num_layers == 1
    assert cfg.optimizer.zero_stage == 2 and cfg.optimizer.overlap_grad_reduce
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    assert cfg.checkpoint.no_save_optim and cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    assert cfg.training.seed == 7 and cfg.data.eod_mask_loss


@pytest.mark.parametrize("argv,needle", [
    (["--fp16", "--bf16"], "--bf16 and --fp16"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--num-layers", "x"], "--num-layers"),
    (["--position-embedding-type", "alibi"], "--position-embedding-type"),
    (["--tensor-model-parallel-size", "4", "--num-attention-heads", "6"], "--num-attention-heads"),
    (["--sequence-parallel"], "--sequence-parallel"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr"),
    (["--num-query-groups", "2"], "--group-query-attention"),
    (["--use-checkpoint-args"], "--load"),
    (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
    (["--data-path"], "--data-path"),
])
def test_bad_flags_raise_one_line(argv, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_world_size_checks_and_the_resolved_config():
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                      "--global-batch-size", "6"])
    with pytest.raises(ConfigError, match="--global-batch-size"):
        cfg.resolve(4, 300)  # dp = 2: 6 is not a multiple of 2 x 2
    with pytest.raises(ConfigError, match="world size"):
        parse_args(["--tensor-model-parallel-size", "2"]).resolve(3, 300)
    raw = parse_args(["--micro-batch-size", "2"])
    cfg = raw.resolve(2, 300)
    assert cfg.training.global_batch_size == 4  # default: micro x dp
    assert cfg.model.vocab_size == 300 and cfg.model.output_vocab_size == 300  # the tokenizer's
    assert raw.training.global_batch_size is None and raw.model.vocab_size != 300  # untouched
    with pytest.raises(AttributeError, match="read-only"):
        cfg.model.vocab_size = 512
    # A model vocabulary from the checkpoint may exceed the tokenizer's: the extra rows are never
    # predicted. Smaller is an error (the tokenizer would produce ids with no embedding row).
    ck = parse_args(["--load", "x", "--use-checkpoint-args", "--vocab-size", "320"])
    ck = ck.resolve(1, 300)
    assert (ck.model.vocab_size, ck.model.output_vocab_size) == (320, 300)
    with pytest.raises(ConfigError, match="the tokenizer has 400 ids"):
        parse_args(["--load", "x", "--use-checkpoint-args", "--vocab-size", "320"]).resolve(1, 400)


def test_args_json_roundtrip_and_shape_diff():
    cfg = parse_args(["--hidden-size", "64", "--num-attention-heads", "4"])
    back = config_from_dict(cfg.to_dict())
    assert back.to_dict() == cfg.to_dict()
    other = parse_args(["--hidden-size", "128", "--num-attention-heads", "4"])
    diffs = model_shape_differences(cfg.model, other.model)
    assert any(d.startswith("--hidden-size: checkpoint has 64, this run has 128") for d in diffs)
    assert model_shape_differences(cfg.model, back.model) == []
