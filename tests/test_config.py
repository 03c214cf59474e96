"""Bad configurations raise ConfigError naming the offending flags."""

import pytest

from megalite.config import (
    ConfigError, MegaliteConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig)
from megalite.parallel_state import rank_grid


def _cfg(**kw):
    # dropout pinned at the library default these checks were written against
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100,
                hidden_dropout=0.1, attention_dropout=0.1)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("kw,tp,flags", [
    (dict(num_attention_heads=6, hidden_size=60), 4, ["--num-attention-heads", "--tensor-model-parallel-size"]),
    (dict(num_attention_heads=8, num_query_groups=2), 4, ["--num-query-groups", "--tensor-model-parallel-size"]),
    (dict(ffn_hidden_size=90), 4, ["--ffn-hidden-size", "--tensor-model-parallel-size"]),
    (dict(hidden_size=66, num_attention_heads=4), 1, ["--hidden-size", "--num-attention-heads"]),
    (dict(num_attention_heads=4, num_query_groups=3), 1, ["--num-attention-heads", "--num-query-groups"]),
    (dict(normalization="BatchNorm"), 1, ["--normalization"]),
    (dict(position_embedding_type="alibi"), 1, ["--position-embedding-type"]),
    (dict(seq_length=64, max_position_embeddings=32), 1, ["--seq-length", "--max-position-embeddings"]),
])
def test_model_config_errors_name_the_flags(kw, tp, flags):
    with pytest.raises(ConfigError) as err:
        _cfg(**kw).validate(tp)
    message = str(err.value)
    assert "\n" not in message
    for flag in flags:
        assert flag in message


def test_world_size_not_divisible_by_tp_times_pp():
    with pytest.raises(ConfigError, match=r"world size \(6\).*--tensor-model-parallel-size \(2\).*"
                                          r"--pipeline-model-parallel-size \(2\)"):
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).validate(6)
    with pytest.raises(ConfigError, match="world size"):
        ParallelConfig(tensor_model_parallel_size=4).validate(6)


def test_sequence_parallel_without_tp_is_an_error():
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        ParallelConfig(sequence_parallel=True).validate(4)
    with pytest.raises(ConfigError, match=r"--seq-length \(18\).*--tensor-model-parallel-size"):
        MegaliteConfig(model=_cfg(seq_length=18), parallel=ParallelConfig(
            tensor_model_parallel_size=4, sequence_parallel=True)).validate()


def test_optimizer_and_training_errors():
    with pytest.raises(ConfigError, match="ModelConfig.params_dtype must be one of float32"):
        ModelConfig(params_dtype="float8").validate()
    with pytest.raises(ConfigError, match="--overlap-param-gather"):
        OptimizerConfig(overlap_param_gather=True).validate()
    with pytest.raises(ConfigError, match="--ddp-bucket-size"):
        OptimizerConfig(ddp_bucket_size=0).validate()
    with pytest.raises(ConfigError, match=r"--global-batch-size \(6\).*--micro-batch-size \(2\).*\(2\)"):
        TrainingConfig(micro_batch_size=2, global_batch_size=6).validate(data_parallel_size=2)


def test_valid_config_passes_and_counts_parameters():
    cfg = _cfg().validate(4)
    h, L, V, s = 64, 2, 100, 16
    per_layer = 12 * h * h + 13 * h  # GPT-2 block incl. biases and two LayerNorms
    assert cfg.num_parameters() == L * per_layer + 2 * h + V * h + s * h
    assert cfg.padded_vocab_size(1) == 128 and cfg.padded_vocab_size(4) == 512


def test_rank_grid_order_is_tp_dp_pp():
    dp, tp_groups, dp_groups, pp_groups, *_ = rank_grid(8, 2, 2)
    assert dp == 2
    assert tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
