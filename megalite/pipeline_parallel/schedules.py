"""Forward/backward schedules over micro-batches.

The contract every schedule keeps (the training loop and the tests rely on it):

    losses = forward_backward_func(
        forward_step_func=forward_step,   # (data_iterator, model) -> (output_tensor, loss_func)
        data_iterator=it,                 # yields this rank's micro-batches, in order
        model=[chunk, ...] or module,     # model chunks of this pipeline rank
        num_microbatches=m,
        seq_length=s, micro_batch_size=b, # pipeline p2p shapes are known in advance
        parallel_state=ps,
        forward_only=False,
        grad_scale_func=None,             # loss -> scaled loss (fp16 loss scaling)
        no_sync_func=None,                # context manager: suppress DP grad sync (grad accumulation)
        finalize_model_grads_func=None,   # called once after the last backward
    )

``loss_func(output_tensor) -> (loss, stats)``: ``loss`` is the scalar to back-propagate (already
divided by the global batch's loss-token count, DESIGN.md contract 4), ``stats`` a dict of floats
or tensors that the caller sums over micro-batches (e.g. ``lm_loss_sum``, ``num_tokens``).
The schedule returns the list of ``stats`` of this rank's micro-batches (empty on non-last stages).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch


def _as_list(model):
    return list(model) if isinstance(model, (list, tuple)) else [model]


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator, model,
                                   num_microbatches: int, seq_length: int = 0,
                                   micro_batch_size: int = 0, parallel_state=None,
                                   forward_only: bool = False,
                                   grad_scale_func: Optional[Callable] = None,
                                   no_sync_func: Optional[Callable] = None,
                                   finalize_model_grads_func: Optional[Callable] = None,
                                   **unused) -> List[dict]:
    """Gradient accumulation: run m micro-batches on one stage; DP sync only after the last."""
    chunks = _as_list(model)
    if len(chunks) != 1:
        raise ValueError("forward_backward_no_pipelining takes exactly one model chunk")
    module = chunks[0]
    no_sync = no_sync_func or contextlib.nullcontext
    stats_list: List[dict] = []

    def one(last: bool) -> None:
        output = None
        with torch.set_grad_enabled(not forward_only):
            output, loss_func = forward_step_func(data_iterator, module)
            loss, stats = loss_func(output)
        stats_list.append(stats)
        if not forward_only:
            if grad_scale_func is not None:
                loss = grad_scale_func(loss)
            loss.backward()

    with no_sync():
        for _ in range(num_microbatches - 1):
            one(last=False)
    one(last=True)  # outside no_sync: the DP reduction (or its hooks) may fire now
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(chunks)
    return stats_list


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              schedule: Optional[str] = None) -> Callable:
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline schedules are added by the pipeline-parallel work")
