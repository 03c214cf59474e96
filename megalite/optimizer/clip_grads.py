"""Gradient clipping by the global L2 norm of the *full* model, whatever the parallel layout: each
parameter counted once over TP x PP (``counts_for_norm``), ZeRO's disjoint shards summed over DP
first (docs/data_parallel.md, "How a step runs"), experts over ETP x EP (docs/moe.md). It equals
``torch.nn.utils.clip_grad_norm_`` on the single-device model (tests/test_optimizer.py).
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

import torch

from megalite import collectives as C
from megalite.param_meta import param_meta


def counts_for_norm(param: torch.Tensor, tp_rank: int, is_first_pp_stage: bool) -> bool:
    """Whether this rank's copy of ``param`` is the one that counts in the global norm: a
    TP-sharded one on every TP rank, a replicated one on TP rank 0, a tied embedding on the first
    stage only, and there (zb-v, dualpipev: both copies) not the output layer's local copy. An
    expert tensor with experts apart: pass the ETP rank (fc2's bias is whole on each)."""
    meta = param_meta(param)
    if meta.tied_embedding and (not is_first_pp_stage or meta.local_tied_copy):
        return False
    if meta.tp_split:
        return True
    return tp_rank == 0


def split_counted(params: Sequence[torch.Tensor], grads: Sequence, ps):
    """(dense, expert): this rank's gradients that count in the global norm; the expert ones
    apart when EP > 1, for ``grad_norm_squared``'s EP sum."""
    dense, expert = [], []
    for p, g in zip(params, grads):
        if g is None:
            continue
        if ps.experts_apart and param_meta(p).expert:
            if counts_for_norm(p, ps.etp_rank, True):
                expert.append(g)
        elif counts_for_norm(p, ps.tp_rank, ps.is_pipeline_first_stage):
            dense.append(g)
    return dense, expert


def _sum_of_squares(grads: Sequence[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum().float().reshape(1)


def grad_norm_squared(counted: Sequence[torch.Tensor], ps, dp_sharded: bool = False,
                      expert: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """The one gradient norm of every optimizer, squared: a float32 device tensor [1] the step
    uses on the device. ``counted``: this rank's gradients (or pieces) that ``counts_for_norm``,
    summed over DP x CP when those ranks hold disjoint shards (``dp_sharded``), then over the
    model-parallel group; ``expert``: the expert gradients when ``ps.experts_apart``
    (``split_counted``), with ``dp_sharded`` this rank's shards of them over the EDP group."""
    sq = _sum_of_squares(counted, ps.device)
    if dp_sharded:
        # ZeRO: DP x CP (HSDP: one instance, whose shards every instance holds alike)
        C.all_reduce(sq, group=ps.zero_group, tag="grad_norm_all_reduce")
    if ps.experts_apart:
        e = _sum_of_squares(expert, ps.device)
        if dp_sharded:
            C.all_reduce(e, group=ps.edp_group, tag="grad_norm_all_reduce")
        # each ETP rank holds a slice of its EP rank's experts: the slices, then the EP ranks
        C.all_reduce(e, group=ps.etp_group, tag="grad_norm_all_reduce")
        C.all_reduce(e, group=ps.ep_group, tag="grad_norm_all_reduce")
        if ps.tp_rank == 0:
            sq = sq + e
    C.all_reduce(sq, group=ps.mp_group, tag="grad_norm_all_reduce")
    return sq


@torch.no_grad()
def clip_grads_by_norm(grads: Iterable[torch.Tensor], total_norm: torch.Tensor,
                       max_norm: float) -> None:
    """Scale grads by min(1, max_norm / (norm + 1e-6)) in torch.nn.utils.clip_grad_norm_'s float32
    arithmetic. The coefficient is always applied on the device: choosing on the host whether to
    clip would read the norm, and a coefficient of 1 leaves every gradient as it was."""
    if max_norm <= 0:
        return
    grads: List[torch.Tensor] = [g for g in grads if g is not None]
    if not grads:
        return
    coef = torch.clamp(max_norm / (total_norm.detach().float().reshape(()) + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
