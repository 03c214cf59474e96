"""Pipeline parallelism: stage partitioning, p2p, and the 1F1B / interleaved / ZB-H1 schedules
(docs/pipeline_parallel.md)."""

from megalite.pipeline_parallel.partition import build_model_chunks  # noqa: F401
from megalite.pipeline_parallel.schedules import (  # noqa: F401
    get_forward_backward_func,
    last_timeline,
)
from megalite.pipeline_parallel.timeline import (  # noqa: F401
    bubble_stats,
    gather_timelines,
    log_pipeline_step,
    write_chrome_trace,
)
