"""The gradient reductions due after backward and before the optimizer step: gradients partial
over TP (``grad_partial_over_tp``) over TP, a tied embedding's two pipeline copies over the
embedding group, and (without DDP's buckets) a SUM over DP (docs/design.md, contract 4).
"""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn

from megalite.distributed.ddp import add_tied_copies_here, all_reduce_coalesced
from megalite.param_meta import grad_of, param_meta
from megalite.parallel_state import ParallelState


def allreduce_sequence_parallel_grads(models: Iterable[nn.Module], ps: ParallelState) -> None:
    grads = [g for m in models for p in m.parameters()
             if param_meta(p).grad_partial_over_tp and (g := grad_of(p)) is not None]
    all_reduce_coalesced(grads, ps.tp_group, "tp_sp_grad_all_reduce")


def allreduce_embedding_grads(models: Iterable[nn.Module], ps: ParallelState) -> None:
    if ps.pp_size == 1 or not ps.in_embedding_group:
        return
    grads = [g for m in models for p in m.parameters()
             if param_meta(p).tied_embedding and (g := grad_of(p)) is not None]
    if not add_tied_copies_here(grads):
        all_reduce_coalesced(grads, ps.embedding_group, "embedding_grad_all_reduce")


def allreduce_data_parallel_grads(models: Iterable[nn.Module], ps: ParallelState) -> None:
    """Over DP x CP; expert weights over the expert-data-parallel group (their replicas)."""
    for expert, group in ((False, ps.dp_cp_group), (True, ps.edp_group)):
        grads = [g for m in models for p in m.parameters()
                 if param_meta(p).expert == expert and (g := grad_of(p)) is not None]
        all_reduce_coalesced(grads, group, "dp_grad_all_reduce")


def finalize_model_grads(models, ps: ParallelState, data_parallel: bool = True) -> None:
    models = models if isinstance(models, (list, tuple)) else [models]
    if data_parallel and all(hasattr(m, "finish_grad_sync") for m in models):
        # DDP chunks: their bucketed DP reduction first (docs/data_parallel.md, "Finalize")
        from megalite.distributed.ddp import finalize_model_grads_ddp

        finalize_model_grads_ddp(models, ps)
        return
    allreduce_sequence_parallel_grads(models, ps)
    allreduce_embedding_grads(models, ps)
    if data_parallel:
        allreduce_data_parallel_grads(models, ps)
