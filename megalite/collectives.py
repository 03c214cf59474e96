"""Thin wrappers over torch.distributed collectives that count bytes and check devices
(docs/design.md, "collectives.py"). A group of ``None`` or size 1 means "no peers": a local
no-op (a copy where there is an output; contract 7)."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megalite import collective_record as R

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor-in/tensor-out collectives; use the new names where they exist.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# bytes sent by this rank, per collective kind; reset by whoever reports a step's traffic
_BYTES_SENT: Dict[str, int] = defaultdict(int)


HOST = torch.device("cpu")
# The checker every collective's tensors go through, installed only by the test harness's strict
# mode (tests/strict_collectives.py, docs/clusters.md "Strict mode"); None in a run.
_STRICT = None


def install_strict_checks(checker) -> None:
    """From now on ``checker.configure(device) -> device`` declares the compute device and
    ``checker.check(kind, tensor, group, host)`` sees every collective's tensors."""
    global _STRICT
    _STRICT = checker


def configure(device: torch.device) -> torch.device:
    """Declare the device the device path serves; returns the device to compute on (the strict
    checker's emulated GPU on CPU, where one is installed)."""
    return device if _STRICT is None else _STRICT.configure(device)


def world_group():
    """The world as a group here (whose ``None`` means "no peers"); it carries the host path."""
    return dist.group.WORLD if dist.is_initialized() else None


def _check(kind: str, t: torch.Tensor, group, host: bool) -> None:
    if _STRICT is not None:
        _STRICT.check(kind, t, group, host)


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def bytes_sent() -> Dict[str, int]:
    """Bytes sent per tag since the last reset, but not by collectives traced into a compiled
    graph, where counting would be a side effect that breaks the graph at every collective."""
    return dict(_BYTES_SENT)


def reset_bytes_sent() -> None:
    _BYTES_SENT.clear()


def _count(kind: str, full_bytes: int, n: int, factor: float) -> None:
    if torch.compiler.is_compiling():  # see bytes_sent
        return
    _BYTES_SENT[kind] += int(round(factor * (n - 1) / n * full_bytes))


def _recorded(kind: str, tag: str, group, t: Optional[torch.Tensor], async_op: bool, fn, /,
              *args, **kwargs):
    """``fn(*args, **kwargs)``, entered in the collective record (megalite/collective_record.py)
    with ``t``'s shape and dtype, marked completed when the call returns synchronously."""
    slot = R.issue(kind, tag, group, None if t is None else t.shape, None if t is None else t.dtype,
                   async_op)
    out = fn(*args, **kwargs)
    R.complete(slot)
    return out


def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False,
               tag: str = "all_reduce", host: bool = False):
    """In-place all-reduce. Use SUM and divide rather than AVG (gloo has no AVG)."""
    n = group_size(group)
    if n == 1:
        return None
    _check(tag, tensor, group, host)
    _count(tag, tensor.numel() * tensor.element_size(), n, 2.0)
    return _recorded("all_reduce", tag, group, tensor, async_op, dist.all_reduce, tensor, op=op,
                     group=group, async_op=async_op)


def _alone(tag: str, output: torch.Tensor, input: torch.Tensor, group) -> bool:
    """True for a group of this rank alone (``output`` then is ``input``, nothing is sent);
    else both device-path tensors are checked (contract 1)."""
    if group_size(group) == 1:
        output.copy_(input)
        return True
    _check(tag, input, group, False)
    _check(tag, output, group, False)
    return False


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False, tag: str = "all_gather"):
    """Gather equal shards along dim 0 into ``output`` (size n * input along dim 0)."""
    if _alone(tag, output, input, group):
        return None
    n = group_size(group)
    _count(tag, output.numel() * output.element_size(), n, 1.0)
    return _recorded("all_gather", tag, group, input, async_op, _all_gather_tensor, output,
                     input.contiguous(), group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                          op=ReduceOp.SUM, async_op: bool = False, tag: str = "reduce_scatter"):
    """Sum ``input`` over the group and keep this rank's dim-0 shard in ``output``."""
    if _alone(tag, output, input, group):
        return None
    n = group_size(group)
    _count(tag, input.numel() * input.element_size(), n, 1.0)
    return _recorded("reduce_scatter", tag, group, input, async_op, _reduce_scatter_tensor,
                     output, input.contiguous(), op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes,
                      input_split_sizes, group, tag: str, async_op: bool = False):
    """Rows ``input_split_sizes[j]`` of ``input`` go to rank j, ``output``'s j-th block of
    ``output_split_sizes`` rows comes from rank j (host ints; None: equal splits)."""
    if _alone(tag, output, input, group):
        return None
    n = group_size(group)
    if not torch.compiler.is_compiling():  # see bytes_sent
        rows = input_split_sizes or [input.shape[0] // n] * n
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        _BYTES_SENT[tag] += (sum(rows) - rows[group_rank(group)]) * row_bytes
    return _recorded("all_to_all", tag, group, input, async_op, dist.all_to_all_single, output,
                     input.contiguous(), output_split_sizes, input_split_sizes, group=group,
                     async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, tag: str = "broadcast",
              host: bool = False):
    n = group_size(group)
    if n == 1:
        return None
    _check(tag, tensor, group, host)
    _BYTES_SENT[tag] += tensor.numel() * tensor.element_size()
    return _recorded("broadcast", tag, group, tensor, False, dist.broadcast, tensor, src=src,
                     group=group)


def batch_isend_irecv(ops, tag: str = "p2p"):
    """Point-to-point sends/receives (pipeline activations and gradients: the device path)."""
    for op in ops:
        _check(tag, op.tensor, op.group, False)
    ranks = tuple(sorted({dist.get_rank(), *(op.peer for op in ops)}))  # this rank and its peers
    return _recorded("p2p", tag, ranks, ops[0].tensor, True, dist.batch_isend_irecv, ops)


def barrier(group=None) -> None:
    """Wait for every rank of ``group`` (None: the world); a no-op without peers."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        _recorded("barrier", "barrier", group, None, False, dist.barrier, group=group)


def all_gather_object(obj, group) -> list:
    """Every rank's picklable ``obj`` (torch serialises through the group's own device)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    _recorded("all_gather_object", "all_gather_object", group, None, False,
              dist.all_gather_object, out, obj, group=group)
    return out


def one_line(e: BaseException, limit: int = 300) -> str:
    """``e`` for a one-line error message: its type and the first line of its text, at most
    ``limit`` characters: the form ranks gather errors in and error messages quote."""
    first = (str(e).strip().splitlines() or [""])[0]
    return (f"{type(e).__name__}: {first}" if first else type(e).__name__)[:limit]


def count_p2p(num_bytes: int, tag: str = "p2p") -> None:
    _BYTES_SENT[tag] += int(num_bytes)
