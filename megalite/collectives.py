"""Thin wrappers over torch.distributed collectives that count the bytes each rank sends.

Every megalite collective goes through here so that communication volume can be measured and held
against the ring formulas in docs/theory.md (all-reduce 2(n-1)/n*S, reduce-scatter and all-gather
(n-1)/n*S, where S is the full array size). A group of ``None`` or size 1 means "no peers": the
call is a local no-op, which is how single-process runs skip communication
(docs/design.md, contract 7).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor-in/tensor-out collectives; use the new names where they exist.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# bytes sent by this rank, per collective kind; reset by whoever reports a step's traffic
_BYTES_SENT: Dict[str, int] = defaultdict(int)


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def bytes_sent() -> Dict[str, int]:
    return dict(_BYTES_SENT)


def reset_bytes_sent() -> None:
    _BYTES_SENT.clear()


def _count(kind: str, full_bytes: int, n: int, factor: float) -> None:
    _BYTES_SENT[kind] += int(round(factor * (n - 1) / n * full_bytes))


def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False,
               tag: str = "all_reduce"):
    """In-place all-reduce. Use SUM and divide rather than AVG (gloo has no AVG)."""
    n = group_size(group)
    if n == 1:
        return None
    _count(tag, tensor.numel() * tensor.element_size(), n, 2.0)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False, tag: str = "all_gather"):
    """Gather equal shards along dim 0 into ``output`` (size n * input along dim 0)."""
    n = group_size(group)
    if n == 1:
        output.copy_(input)
        return None
    _count(tag, output.numel() * output.element_size(), n, 1.0)
    return _all_gather_tensor(output, input.contiguous(), group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                          op=ReduceOp.SUM, async_op: bool = False, tag: str = "reduce_scatter"):
    """Sum ``input`` over the group and keep this rank's dim-0 shard in ``output``."""
    n = group_size(group)
    if n == 1:
        output.copy_(input)
        return None
    _count(tag, input.numel() * input.element_size(), n, 1.0)
    return _reduce_scatter_tensor(output, input.contiguous(), op=op, group=group,
                                      async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, tag: str = "broadcast"):
    n = group_size(group)
    if n == 1:
        return None
    _BYTES_SENT[tag] += tensor.numel() * tensor.element_size()
    return dist.broadcast(tensor, src=src, group=group)


def count_p2p(num_bytes: int, tag: str = "p2p") -> None:
    _BYTES_SENT[tag] += int(num_bytes)
