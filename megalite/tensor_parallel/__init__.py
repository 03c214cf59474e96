"""Tensor and sequence parallelism: collectives as autograd functions, parallel layers, loss,
RNG."""

from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
from megalite.tensor_parallel.layers import (  # noqa: F401
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightGradStore,
)
