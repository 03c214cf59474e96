"""Data parallelism: DDP's bucketed grad buffers (stages 0-2, docs/data_parallel.md), gradient
finalization, and ZeRO-3 (zero3.py, docs/zero3.md)."""

from megalite.distributed.ddp import (  # noqa: F401
    DistributedDataParallel,
    finalize_model_grads_ddp,
    wrap_chunks,
)
