"""What each parameter is to the parallel code: one typed record per ``nn.Parameter``
(docs/design.md, "Parameter metadata"). This module is the only code that looks the record up on
a tensor; a parameter nobody tagged reads as the default record (replicated, reduced over DP
only). The record lives on the Parameter object, so ZeRO-3's ``param.data`` swaps keep it and
``copy.deepcopy`` drops it."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

_ATTR = "_megalite_param_meta"


@dataclasses.dataclass(frozen=True)
class ParamMeta:
    """How one parameter is laid out over the parallel groups, how to initialize it, and the
    deferred weight gradients it is owed. Each field is described in docs/design.md, "Parameter
    metadata"."""

    tp_split: bool = False
    partition_dim: int = 0
    partition_stride: int = 1
    grad_partial_over_tp: bool = False
    tied_embedding: bool = False
    local_tied_copy: bool = False
    expert: bool = False
    init_method: Optional[tuple] = None
    init_seed_name: Optional[str] = None
    weight_grads_queued: int = 0  # W's queued for it and not yet run (overlap.WeightGradStore)
    deferred_grad_hook: Optional[Callable] = None  # called after each W (its DDP buffer's)


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
