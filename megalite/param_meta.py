"""What each parameter is to the parallel code: one typed record per ``nn.Parameter``.

The layers and the model builders attach a :class:`ParamMeta` when they create a parameter
(:func:`set_param_meta`); initialization, gradient reductions, clipping, ZeRO and checkpoint
conversion read it back (:func:`param_meta`). This module is the only code that looks the record
up on a tensor, so the fields below are the whole vocabulary, and a parameter nobody tagged reads
as the default record: replicated, nothing to reduce beyond data parallelism.

The record lives on the Parameter object, so it follows the object wherever it goes: ZeRO-3 swaps
``param.data``, never the Parameter; ``torch.compile`` reads no record (the readers run outside
the compiled layers). ``copy.deepcopy`` of a Parameter keeps only its data and ``requires_grad``
(torch's ``Parameter.__deepcopy__``), so a deep-copied model has default records, as it had no
attributes before: build a model again rather than copy one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

_ATTR = "_megalite_param_meta"


@dataclasses.dataclass(frozen=True)
class ParamMeta:
    """How one parameter is laid out over the parallel groups and how to initialize it.

    ``tp_split``: this rank holds a slice of a tensor split over TP, along ``partition_dim``;
    ``partition_stride`` k > 1 means k blocks stacked along that dim, each split separately
    (tensor_parallel/utils.py). Initialization and conversion shard the full tensor by these; the
    gradient norm counts a split parameter on every TP rank, a replicated one on TP rank 0 only.

    ``grad_partial_over_tp``: replicated over TP, but each rank's gradient is a partial sum (norms,
    row-parallel biases and position embeddings under SP, which see a sequence shard; qk-norm
    weights, which each rank applies to its own heads): summed over TP after backward
    (finalize_model_grads.py, ddp.py, zero3.py).

    ``tied_embedding``: one of two copies of the tied input/output embedding held by different
    pipeline stages (or both by rank 0 under zb-v / dualpipev): their gradients are summed over
    the embedding group, ZeRO gives each its own bucket or unit, and the norm counts the first
    stage's copy only. ``local_tied_copy``: the output-layer copy that shares a rank with the
    input embedding (V schedules), left out of the norm.

    ``expert``: mixture-of-experts weights (megalite/moe/layer.py), which differ across the
    expert-parallel ranks: DDP reduces their gradients over the expert-data-parallel group
    instead of DP x CP (a buffer of their own), and under EP > 1 the norm sums them over EP.

    ``init_method``: ``("normal", std)``, ``("normal_vocab", std)`` (real vocab rows drawn, padding
    zero), ``("normal_experts", std, first)`` (stacked experts, each drawn from its global index,
    the first local one being ``first``), ``("ones",)`` or ``("zeros",)``; ``init_seed_name``: the name whose seed draws the full
    tensor when not the parameter's own (the tied output copy draws the embedding's).
    models/init.py reads both.
    """

    tp_split: bool = False
    partition_dim: int = 0
    partition_stride: int = 1
    grad_partial_over_tp: bool = False
    tied_embedding: bool = False
    local_tied_copy: bool = False
    expert: bool = False
    init_method: Optional[tuple] = None
    init_seed_name: Optional[str] = None


_DEFAULT = ParamMeta()


def param_meta(p: torch.Tensor) -> ParamMeta:
    """``p``'s record, or the default one if none was attached."""
    return getattr(p, _ATTR, _DEFAULT)


def set_param_meta(p: torch.Tensor, **changes) -> ParamMeta:
    """Attach ``p``'s record with ``changes`` applied to its current one; returns the new record."""
    meta = dataclasses.replace(param_meta(p), **changes)
    setattr(p, _ATTR, meta)
    return meta


def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient ``p`` accumulates into: ``main_grad`` when a DDP buffer gave it one, else
    ``.grad``."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad
