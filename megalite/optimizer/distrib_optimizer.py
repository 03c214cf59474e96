"""The ZeRO distributed optimizer (stages 1, 2) over DistributedDataParallel's buffers: rank r
owns shard r of every bucket and keeps the fp32 masters and Adam moments of that shard only
(docs/data_parallel.md: the step, the 16Ψ accounting, checkpoints and resharding). The step and
the checkpoint formats are ``optimizer.ShardedAdamW``'s, shared with ZeRO-3. Expert weights have
buffers of their own, sharded over the expert-data-parallel group (each buffer's ``dp_group``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn as nn

from megalite import collectives as C
from megalite.config import OptimizerConfig
from megalite.distributed.ddp import DistributedDataParallel
from megalite.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer
from megalite.optimizer.clip_grads import counts_for_norm
from megalite.optimizer.optimizer import ShardedAdamW
from megalite.param_meta import param_meta
from megalite.parallel_state import ParallelState


@dataclass
class Segment:
    """The part [lo, hi) of a flat shard that belongs to one parameter (from its element plo)."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    plo: int


@dataclass
class Shard:
    """What this rank's optimizer owns of one bucket."""

    ddp: DistributedDataParallel
    buffer: ParamAndGradBuffer
    bucket: Bucket
    start: int  # buffer coordinates
    end: int
    master: torch.Tensor  # fp32; for fp32 models a view of the param buffer (no copy)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    segments: List[Segment] = field(default_factory=list)

    @property
    def model_param_shard(self) -> torch.Tensor:
        return self.buffer.param_data[self.start:self.end]

    @property
    def grad(self) -> torch.Tensor:
        return self.buffer.grad_shard(self.bucket)


class DistributedOptimizer(ShardedAdamW):
    """AdamW over this rank's ZeRO shards; the interface of megalite/optimizer/optimizer.py."""

    def __init__(self, model_chunks, config: OptimizerConfig, ps: ParallelState, **unused):
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if config.zero_stage not in (1, 2) or not all(
                isinstance(c, DistributedDataParallel) for c in chunks):
            raise ValueError(
                "the distributed optimizer needs --zero-stage 1 or 2 (stage 0: build_optimizer's "
                "plain optimizer) and the model chunks wrapped in megalite.distributed."
                "DistributedDataParallel (training.py's wrap_model_for_data_parallel does it)")
        self._init_shared(config, ps, next(chunks[0].parameters()).dtype)
        self.chunks = chunks
        self.zero_stage = config.zero_stage
        # the file is named by this rank of DP x CP, of one instance under HSDP (the expert
        # buffers: their own dp_group)
        self.dp_group = ps.zero_group
        self.dp_size = C.group_size(self.dp_group)
        self.dp_rank = C.group_rank(self.dp_group)
        names: Dict[str, nn.Parameter] = {}
        self.shards: List[Shard] = []
        for ci, ddp in enumerate(chunks):
            for buf in ddp.grad_buffers:
                for b in buf.buckets:
                    self.shards.append(self._make_shard(ci, ddp, buf, b, names))
        self.param_names = names
        self.masters = [s.master for s in self.shards]
        self.exp_avg = [s.exp_avg for s in self.shards]
        self.exp_avg_sq = [s.exp_avg_sq for s in self.shards]
        self.runs = [[(g.lo, g.hi, 0 if g.param.dim() > 1 else 1) for g in s.segments]
                     for s in self.shards]
        self.segments = [[[g.name, g.lo, g.hi, g.plo, list(g.param.shape)] for g in s.segments]
                         for s in self.shards]
        # experts apart (any of EP, ETP, TP above 1): the expert shards' squares are summed over
        # their own groups (clip_grads.grad_norm_squared)
        self.shard_is_expert = [ps.experts_apart and param_meta(s.bucket.params[0]).expert
                                for s in self.shards]
        self.norm_runs = [[(g.lo, g.hi) for g in s.segments if not e and
                           counts_for_norm(g.param, ps.tp_rank, ps.is_pipeline_first_stage)]
                          for s, e in zip(self.shards, self.shard_is_expert)]
        self.expert_norm_runs = [[(g.lo, g.hi) for g in s.segments
                                  if counts_for_norm(g.param, ps.etp_rank, True)] if e else []
                                 for s, e in zip(self.shards, self.shard_is_expert)]
        for i in self._offload([s.model_param_shard for s in self.shards]):
            s = self.shards[i]  # the host holds the master: the model shard stands in (no copy)
            s.master, s.exp_avg, s.exp_avg_sq = s.model_param_shard, None, None

    # ------------------------------------------------------------------------------ layout
    def _key(self, ci: int, name: str) -> str:
        return name if len(self.chunks) == 1 else f"chunk{ci}.{name}"

    def _make_shard(self, ci, ddp, buf, bucket, names) -> Shard:
        start, end = buf.shard_range(bucket)
        model_shard = buf.param_data[start:end]
        if buf.param_dtype == torch.float32:
            master = model_shard  # fp32 params are their own masters (docs/theory.md: K = 8)
        else:
            master = model_shard.detach().clone().float()
        shard = Shard(ddp, buf, bucket, start, end, master,
                      torch.zeros_like(master, dtype=torch.float32),
                      torch.zeros_like(master, dtype=torch.float32))
        for slot in bucket.slots:
            a, b = max(slot.start, start), min(slot.end, end)
            key = self._key(ci, slot.name)
            if key in names and names[key] is not slot.param:
                raise ValueError(f"parameter name {key} appears twice among the model chunks")
            names[key] = slot.param
            if a < b:
                shard.segments.append(Segment(key, slot.param, a - start, b - start,
                                              a - slot.start))
        return shard

    # ---------------------------------------------------------------------------- interface
    def zero_grad(self, set_to_none: bool = True) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def _finish_grads(self) -> None:
        for c in self.chunks:  # normally done by the schedule's finalize hook; harmless twice
            c.finish_grad_sync()
        self._wait_param_sync()  # never write params while last step's gather is in flight

    def _wait_param_sync(self) -> None:
        for c in self.chunks:
            c.finish_param_sync()

    def _grads(self) -> List[torch.Tensor]:
        return [s.grad for s in self.shards]

    def _publish(self) -> None:
        self._copy_masters_to_model()
        for c in self.chunks:
            c.start_param_sync()

    def _copy_masters_to_model(self) -> None:
        for s in self.shards:
            if s.master.data_ptr() != s.model_param_shard.data_ptr():
                s.model_param_shard.copy_(s.master)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Masters <- model params (after loading model weights without optimizer state)."""
        self._wait_param_sync()
        for s in self.shards:
            if s.master.data_ptr() != s.model_param_shard.data_ptr():
                s.master.copy_(s.model_param_shard.float())
        self.host.reload()

    # -------------------------------------------------------------------------- checkpoints
    def sync_model_params(self) -> None:
        """All-gather the model params from every rank's loaded shard (collective over DP).
        Kept out of :meth:`load_state_dict`, which is local, so a checkpoint load agrees that every
        rank read its files before any rank enters a collective
        (checkpoint.load.load_checkpoint)."""
        for c in self.chunks:
            c.start_param_sync(overlap=False)

    def _gather_flat(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Shard ``i``'s bucket, all of it."""
        full = torch.empty(self.shards[i].bucket.numel, dtype=torch.float32, device=t.device)
        C.all_gather_into_tensor(full, t.float(), group=self.shards[i].buffer.dp_group,
                                 tag="checkpoint_all_gather")
        return full

    def _flat_slots(self, i: int):
        s = self.shards[i]
        ci = self.chunks.index(s.ddp)
        return [(self._key(ci, slot.name), slot.start - s.bucket.offset, tuple(slot.param.shape))
                for slot in s.bucket.slots]

    def _load_full_model(self, params) -> None:
        """Every rank holds the full tensors, so it writes every param itself (rounded for
        16-bit models): no gather needed."""
        missing = sorted(set(self.param_names) - set(params))
        if missing:
            raise ValueError(f"optimizer state lacks parameters {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        for name, p in self.param_names.items():
            p.data.copy_(params[name]["master"].to(p.dtype))
