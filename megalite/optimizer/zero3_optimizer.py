"""AdamW on ZeRO-3 shards, the optimizer half of megalite.distributed.zero3 (docs/zero3.md,
"Optimizer"). The step and the checkpoint formats are ``optimizer.ShardedAdamW``'s, shared with
stages 1-2; each unit is one shard. A shard straddles parameters, so what depends on the
parameter (weight decay, counting in the norm, SP's sum over TP) is applied through per-element runs
(``unit.segments``: a run-length mask that costs no memory).
"""

from __future__ import annotations

from typing import List

import torch

from megalite import collectives as C
from megalite.distributed.zero3 import Zero3Model
from megalite.optimizer.clip_grads import counts_for_norm
from megalite.optimizer.optimizer import ShardedAdamW

DECAY, NO_DECAY = 0, 1


class Zero3Optimizer(ShardedAdamW):
    def __init__(self, model, opt_cfg, ps):
        # One Zero3Model, or one per pipeline chunk (virtual stages): their units together are
        # this rank's model state; unit names are unique (layers carry their global number).
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not chunks or not all(isinstance(c, Zero3Model) for c in chunks):
            raise TypeError("Zero3Optimizer needs the Zero3Model(s) from shard_model_zero3")
        self._init_shared(opt_cfg, ps, chunks[0].compute_dtype)
        self.chunks = chunks
        self.model = chunks[0]  # its flat-buffer helpers work on any chunk's units
        self.units = [u for c in chunks for u in c.units]
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"ZeRO-3 unit names repeat across model chunks: {names}")
        self.masters = [u.main for u in self.units]
        # by the names the state files use (the model's, layers by their global number)
        self.param_names = {n: p for u in self.units for n, p in zip(u.names, u.params)}
        self.exp_avg = [torch.zeros_like(u.main) for u in self.units]
        self.exp_avg_sq = [torch.zeros_like(u.main) for u in self.units]
        # Per-unit runs (start, end, group) and the runs that count in the gradient norm
        self.runs = [[(s.start, s.end, DECAY if len(u.shapes[s.param_index]) > 1 else NO_DECAY)
                      for s in u.segments] for u in self.units]
        self.norm_runs = [[(s.start, s.end) for s in u.segments if not u.expert and
                           counts_for_norm(u.params[s.param_index], ps.tp_rank,
                                           ps.is_pipeline_first_stage)] for u in self.units]
        # EP > 1: the expert units' squares are summed over their own groups (clip_grads)
        self.shard_is_expert = [u.expert for u in self.units]
        self.expert_norm_runs = [[(s.start, s.end) for s in u.segments if counts_for_norm(
            u.params[s.param_index], ps.etp_rank, True)] if u.expert else []
                                 for u in self.units]
        self.segments = [[[u.names[s.param_index], s.start, s.end, s.param_start,
                           list(u.shapes[s.param_index])] for s in u.segments]
                         for u in self.units]
        self.zero_stage = 3
        self.dp_size = C.group_size(ps.zero_group)  # the file's rank (experts: per unit)
        self.dp_rank = C.group_rank(ps.zero_group)
        for i in self._offload([u.shard for u in self.units]):
            self.units[i].main = self.units[i].shard  # the fp32 master lives on the host

    # ------------------------------------------------------------------------------ interface
    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_shards()

    def reload_model_params(self) -> None:
        """The masters live in the model's units (shared): only the host's are copies."""
        self.host.reload()

    def _finish_grads(self) -> None:
        for c in self.chunks:
            c.finalize_grads()

    def _grads(self) -> List[torch.Tensor]:
        return [u.grad for u in self.units]

    def _copy_masters_to_model(self) -> None:
        for u in self.units:
            if u.shard is not u.main:
                u.shard.copy_(u.main)  # round the fp32 masters into the 16-bit gather source

    # ----------------------------------------------------------------------------- checkpoints
    def _gather_flat(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return self.model.gather_flat(self.units[i], t)

    def _flat_slots(self, i: int):
        u = self.units[i]
        return list(zip(u.names, u.offsets, u.shapes))
