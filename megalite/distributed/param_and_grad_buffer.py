"""Contiguous parameter and gradient buffers, split into buckets for data-parallel reduction:
``param.data`` becomes a view of the param buffer and ``param.main_grad`` one of the (fp32) grad
buffer. The layout rules, stage 2's transient bucket storage, and why: docs/data_parallel.md,
"How a step runs". ZeRO-3 units are packed by the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megalite import collectives as C
from megalite.param_meta import param_meta


@dataclass
class ParamSlot:
    """Where one parameter lives in its buffer: elements [start, end)."""

    name: str
    param: torch.nn.Parameter
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class Bucket:
    """A contiguous range [offset, offset + numel) of the buffers, reduced by one collective."""

    def __init__(self, index: int, slots: List[ParamSlot], offset: int, numel: int,
                 dp_size: int, dp_rank: int):
        self.index = index
        self.slots = slots
        self.params = [s.param for s in slots]
        self.offset = offset
        self.numel = numel  # padded: a multiple of lcm(dp_size, 128)
        self.shard_numel = numel // dp_size
        # Buffer coordinates of this rank's shard.
        self.shard_start = offset + dp_rank * self.shard_numel
        self.shard_end = self.shard_start + self.shard_numel
        self.param_data: Optional[torch.Tensor] = None  # view of the param buffer
        self.grad_data: Optional[torch.Tensor] = None  # full grad storage (None: released, stage 2)
        self.grad_shard_acc: Optional[torch.Tensor] = None  # stage 2: persistent shard accumulator
        self.ready: set = set()
        self.launched = False  # grad collective issued in this iteration (stages 0/1)
        self.grad_handle = None
        self.pending_out: Optional[torch.Tensor] = None  # stage 2: reduce-scatter output
        self.replicate_handle = None  # HSDP: the shard's all-reduce across the instances
        self.param_handle = None  # async all-gather of params (overlap_param_gather)


PARAM_ALIGNMENT, BUCKET_ALIGNMENT = 64, 128  # elements


def packed(numels: List[int], dp_size: int) -> Tuple[List[int], int]:
    """Parameters of ``numels`` packed by the alignment rule: each one's start, and the padded
    total (a multiple of lcm(dp_size, 128))."""
    starts, end = [], 0
    for n in numels:
        starts.append(-(-end // PARAM_ALIGNMENT) * PARAM_ALIGNMENT)
        end = starts[-1] + n
    m = math.lcm(dp_size, BUCKET_ALIGNMENT)
    return starts, -(-end // m) * m


def bucket_layout(params: List[Tuple[str, int, bool]], bucket_size: Optional[int], dp_size: int
                  ) -> List[Tuple[List[Tuple[str, int]], int]]:
    """The layout rules, as data, for the buffer below and checkpoint/optim_state.py: ``params``
    are (name, numel, tied_embedding) in registration order; returns each bucket's (parameter
    name, start in the bucket) in buffer order and its padded numel."""
    groups: List[List[Tuple[str, int]]] = []
    current: List[Tuple[str, int]] = []  # a bucket closes once it holds >= bucket_size
    limit = bucket_size if bucket_size is not None else math.inf
    for name, numel, shared in reversed(params):
        if shared:
            groups += [current, [(name, numel)]] if current else [[(name, numel)]]
            current = []
            continue
        current.append((name, numel))
        if sum(n for _, n in current) >= limit:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    out = []
    for g in groups:
        starts, padded = packed([k for _, k in g], dp_size)
        out.append(([(n, a) for (n, _), a in zip(g, starts)], padded))
    return out


class ParamAndGradBuffer:
    """The param and grad buffers of one group of same-dtype parameters of one model chunk."""

    def __init__(self, named_params: List[Tuple[str, torch.nn.Parameter]], *, grad_dtype: torch.dtype,
                 dp_group, zero_stage: int, bucket_size: Optional[int]):
        assert named_params, "a buffer needs at least one parameter"
        self.dp_group = dp_group
        self.dp_size = C.group_size(dp_group)
        self.dp_rank = C.group_rank(dp_group)
        self.zero_stage = zero_stage
        self.param_dtype = named_params[0][1].dtype
        self.grad_dtype = grad_dtype
        self.device = named_params[0][1].device
        N = self.dp_size

        self.buckets: List[Bucket] = []
        self.slots: Dict[torch.nn.Parameter, ParamSlot] = {}
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        by_name = dict(named_params)
        offset = 0
        for i, (placed, numel) in enumerate(bucket_layout(
                [(n, p.numel(), param_meta(p).tied_embedding) for n, p in named_params],
                bucket_size, N)):
            slots = [ParamSlot(name, by_name[name], offset + a, offset + a + by_name[name].numel())
                     for name, a in placed]
            self.buckets.append(Bucket(i, slots, offset, numel, N, self.dp_rank))
            for s in slots:
                self.slots[s.param] = s
                self.param_to_bucket[s.param] = self.buckets[-1]
            offset += numel
        self.numel = offset
        self.numel_unpadded = sum(p.numel() for _, p in named_params)

        # ---- param buffer: every param becomes a view of it --------------------------------------
        self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
        for slot in self.slots.values():
            p = slot.param
            view = self.param_data[slot.start:slot.end].view_as(p)
            view.copy_(p.data)
            p.data = view
        for b in self.buckets:
            b.param_data = self.param_data[b.offset:b.offset + b.numel]

        # ---- grad buffer: stages 0/1 one persistent full-size buffer (main_grad a fixed view of
        # it); stage 2 only the shard accumulators persist (docs/theory.md: grads 4Ψ/N bytes)
        self.grad_data: Optional[torch.Tensor] = None
        if zero_stage < 2:
            self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        for b in self.buckets:
            if zero_stage == 2:
                b.grad_shard_acc = torch.zeros(b.shard_numel, dtype=grad_dtype, device=self.device)
            self._set_grad_storage(b, None if self.grad_data is None
                                   else self.grad_data[b.offset:b.offset + b.numel])

    # ----------------------------------------------------------------------------- grad storage
    def _set_grad_storage(self, bucket: Bucket, grad_data: Optional[torch.Tensor]) -> None:
        """The bucket's full-size gradient storage, and its params' main_grad views of it."""
        bucket.grad_data = grad_data
        for slot in bucket.slots:
            lo = slot.start - bucket.offset
            slot.param.main_grad = (None if grad_data is None
                                    else grad_data[lo:lo + slot.numel].view_as(slot.param))

    def ensure_grad_storage(self, bucket: Bucket) -> None:
        """Stage 2: allocate a bucket's full-size gradient storage on first use in a micro-batch."""
        if bucket.grad_data is None:
            self._set_grad_storage(bucket, torch.zeros(bucket.numel, dtype=self.grad_dtype,
                                                       device=self.device))

    def release_grad_storage(self, bucket: Bucket) -> None:
        """Stage 2: drop the full-size storage once its shard has been folded in."""
        self._set_grad_storage(bucket, None)

    def grad_shard(self, bucket: Bucket) -> torch.Tensor:
        """This rank's DP-reduced gradient shard of a bucket (stage 0: the whole bucket)."""
        if self.zero_stage == 0:
            return bucket.grad_data
        if self.zero_stage == 1:
            lo = bucket.shard_start - bucket.offset
            return bucket.grad_data[lo:lo + bucket.shard_numel]
        return bucket.grad_shard_acc

    def shard_range(self, bucket: Bucket) -> Tuple[int, int]:
        """Buffer coordinates of the range this rank's optimizer owns (stage 0: all of it)."""
        if self.zero_stage == 0:
            return bucket.offset, bucket.offset + bucket.numel
        return bucket.shard_start, bucket.shard_end

    def valid_grad_slice(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """The part of ``param``'s DP-reduced gradient this rank holds (a view), or None."""
        bucket = self.param_to_bucket[param]
        slot = self.slots[param]
        lo, hi = self.shard_range(bucket)
        a, b = max(slot.start, lo), min(slot.end, hi)
        if a >= b:
            return None
        return self.grad_shard(bucket)[a - lo:b - lo]

    def zero_grad(self) -> None:
        if self.grad_data is not None:
            self.grad_data.zero_()
        for b in self.buckets:
            b.ready.clear()
            b.launched = False
            if self.zero_stage == 2:
                b.grad_shard_acc.zero_()
                self.release_grad_storage(b)
