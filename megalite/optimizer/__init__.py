"""Optimizers (AdamW with fp32 masters, plain or ZeRO), loss scaling, clipping, LR schedule.
:func:`build_optimizer` is the one seam the training loop uses."""

from __future__ import annotations

from megalite.optimizer.lr_scheduler import OptimizerParamScheduler  # noqa: F401
from megalite.optimizer.optimizer import MixedPrecisionOptimizer


def build_optimizer(model_chunks, opt_cfg, ps):
    """The optimizer for this rank's model chunks (plain DP or ZeRO, by ``opt_cfg.zero_stage``)."""
    if opt_cfg.zero_stage == 3:  # AdamW on the ZeRO-3 shards (docs/zero3.md)
        from megalite.optimizer.zero3_optimizer import Zero3Optimizer

        return Zero3Optimizer(list(model_chunks), opt_cfg, ps)
    if opt_cfg.zero_stage >= 1:
        from megalite.optimizer.distrib_optimizer import DistributedOptimizer

        return DistributedOptimizer(model_chunks, opt_cfg, ps)
    return MixedPrecisionOptimizer(model_chunks, opt_cfg, ps)
