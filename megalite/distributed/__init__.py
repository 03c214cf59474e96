"""Data parallelism: gradient finalization, grad buffers and buckets, ZeRO sharding.

``DistributedDataParallel`` (ddp.py) wraps a model chunk with contiguous, bucketed grad buffers
(stages 0-2, docs/data_parallel.md); the ZeRO-1/2 optimizer over them is
``megalite.optimizer.distrib_optimizer.DistributedOptimizer``; stage 3 is zero3.py.
"""

from megalite.distributed.ddp import (  # noqa: F401
    DistributedDataParallel,
    finalize_model_grads_ddp,
    wrap_chunks,
)
