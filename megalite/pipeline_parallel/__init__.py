"""Pipeline parallelism (docs/pipeline_parallel.md). Imports point one way: partition <-
schedules (op orders, p2p programs: plain data) <- timeline <- executor (runs them)."""

from megalite.pipeline_parallel.partition import build_model_chunks  # noqa: F401
from megalite.pipeline_parallel.executor import get_forward_backward_func  # noqa: F401
from megalite.pipeline_parallel.timeline import (  # noqa: F401
    bubble_stats,
    gather_timelines,
    log_pipeline_step,
    write_chrome_trace,
)
