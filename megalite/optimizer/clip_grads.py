"""Gradient clipping by the global L2 norm of the *full* model, whatever the parallel layout.

Each parameter's gradient must be counted exactly once over the model-parallel group (tp x pp):
  * a TP-sharded parameter (record ``tp_split``, megalite/param_meta.py) contributes its shard on
    every TP rank;
  * a replicated parameter (norms, row-parallel biases, position embeddings) is identical on every
    TP rank after finalize_model_grads, so only TP rank 0 counts it;
  * the tied-embedding copy on the last pipeline stage (``tied_embedding``) duplicates the
    first stage's, so only the first stage counts it; under zb-v / dualpipev both copies are on the
    first stage, and the output layer's (``local_tied_copy``) is the one left out.
The squares are summed locally, then all-reduced (SUM) over ``ps.mp_group``. Data-parallel replicas
hold identical gradients after the DP all-reduce, so the model-parallel group suffices and every DP
rank computes the same norm; ZeRO's disjoint shards are summed over DP first. Under expert
parallelism (EP > 1, or an expert-tensor-parallel size other than TP's: ``ps.experts_apart``) each
EP rank holds other experts and each ETP rank another slice of them: their squares are summed over
ETP x EP instead (ZeRO's expert shards over the expert-data-parallel group first, which they are
split over), and added once per TP group (on TP rank 0) before the model-parallel sum adds the
pipeline stages (megalite/moe/layer.py). ``grad_norm_squared``
is the one norm of every optimizer (plain, ZeRO 0-2, ZeRO-3). The result equals
``torch.nn.utils.clip_grad_norm_`` on the single-device model (tests/test_optimizer.py).
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

import torch

from megalite import collectives as C
from megalite.param_meta import param_meta


def counts_for_norm(param: torch.Tensor, tp_rank: int, is_first_pp_stage: bool) -> bool:
    """Whether this rank's copy of ``param`` is the one that counts in the global norm."""
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
    """The one gradient norm of every optimizer, squared, as a float32 device tensor of shape [1]
    (never read by the step: its skip mask and clipping use it on the device, optimizer.py):
    the sum of squares of
    ``counted`` (this rank's gradients, or pieces of them, that ``counts_for_norm``), summed over
    DP x CP when those ranks hold disjoint shards (``dp_sharded``), then over the model-parallel
    group. ``expert``: the expert gradients when ``ps.experts_apart`` (``split_counted``), or
    with ``dp_sharded`` this rank's shards of them over the expert-data-parallel group."""
    sq = _sum_of_squares(counted, ps.device)
    if dp_sharded:
        C.all_reduce(sq, group=ps.dp_cp_group, tag="grad_norm_all_reduce")  # ZeRO: DP x CP
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
    """Scale grads by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ does
    (the same float32 arithmetic, so a run matches torch's), with ``total_norm`` a device
    scalar: the coefficient is computed on the device and always applied. A coefficient of 1
    leaves every gradient exactly as it was, and choosing on the host whether to clip would read
    the norm."""
    if max_norm <= 0:
        return
    grads: List[torch.Tensor] = [g for g in grads if g is not None]
    if not grads:
        return
    coef = torch.clamp(max_norm / (total_norm.detach().float().reshape(()) + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
