"""megalite: Megatron-style model-parallel GPT pretraining that runs anywhere PyTorch does."""

__version__ = "0.1.0"

from megalite.config import ConfigError, ModelConfig, ParallelConfig  # noqa: E402,F401
