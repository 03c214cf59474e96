"""Thin wrappers over torch.distributed collectives that count bytes and check devices.

Every megalite collective goes through here (tests/test_collectives_strict.py greps for raw
``dist.`` calls) so that communication volume can be measured and held against the ring formulas
in docs/theory.md (all-reduce 2(n-1)/n*S, reduce-scatter and all-gather (n-1)/n*S, where S is the
full array size). A group of ``None`` or size 1 means "no peers": the call is a local no-op, which
is how single-process runs skip communication (docs/design.md, contract 7).

Two paths (docs/clusters.md, "Which collectives run where"): the *device path* (default) carries
compute-device tensors (NCCL on GPUs); the *host path* (``host=True``) carries CPU control
messages over the world group's gloo. Strict mode (``MEGALITE_STRICT_COLLECTIVES=1``) rejects a
tensor on another device than its path serves, and on CPU emulates a GPU (:class:`EmulatedDevice`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor-in/tensor-out collectives; use the new names where they exist.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# bytes sent by this rank, per collective kind; reset by whoever reports a step's traffic
_BYTES_SENT: Dict[str, int] = defaultdict(int)


HOST = torch.device("cpu")
_STATE = {"strict": False, "device": HOST, "emulated": None}


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor on a device its path does not serve."""


def configure(device: torch.device, strict: Optional[bool] = None) -> torch.device:
    """Declare the device the device path serves; returns the device to compute on (``cpu:0``
    with :class:`EmulatedDevice` active in strict mode on CPU)."""
    if strict is None:
        strict = os.environ.get("MEGALITE_STRICT_COLLECTIVES", "0") not in ("", "0")
    _STATE.update(strict=strict, device=device)
    if strict and device.type == "cpu":
        if _STATE["emulated"] is None:
            _STATE["emulated"] = EmulatedDevice()
            _STATE["emulated"].__enter__()  # for the rest of the process
        _STATE["device"] = device = EmulatedDevice.COMPUTE
    return device


def world_group():
    """The world as a group here (whose ``None`` means "no peers"); it carries the host path."""
    return dist.group.WORLD if dist.is_initialized() else None


def device_of(t: torch.Tensor) -> torch.device:
    """Where ``t`` lives, or under GPU emulation, where it would live on a GPU."""
    if _STATE["emulated"] is not None and t.device.type == "cpu":
        return HOST if getattr(t, _HOST_MARK, False) else EmulatedDevice.COMPUTE
    return t.device


def _check(kind: str, t: torch.Tensor, group, host: bool) -> None:
    if not _STATE["strict"]:
        return
    want = HOST if host else _STATE["device"]
    got = device_of(t)
    if got != want:
        path = "host path (CPU tensors over gloo)" if host else "device path"
        raise CollectiveDeviceError(
            f"{kind} on the {path} of a group serving {want} got a tensor on {got} "
            f"(shape {tuple(t.shape)}); create it with device= the compute device, or send a "
            f"host control message with host=True over the world group")
    if host and group is not None and group is not dist.group.WORLD:
        raise CollectiveDeviceError(f"{kind}: host-path messages go over the world group only "
                                    f"(the others are device-only NCCL groups on GPUs)")


_HOST_MARK = "_megalite_on_host"
_DEVICE = torch.Tensor.device  # its __get__ is a fresh object at each access: compare __self__


def _mark(out, host: bool) -> None:
    for t in (out,) if isinstance(out, torch.Tensor) else out:
        if isinstance(t, torch.Tensor) and (host or getattr(t, _HOST_MARK, False)):
            setattr(t, _HOST_MARK, host)


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _is_host_device(dev) -> bool:
    dev = torch.device(dev)
    return dev.type == "cpu" and dev.index is None


class EmulatedDevice(TorchFunctionMode):
    """A GPU stand-in on CPU: tracks which tensors a GPU run would hold on the host.

    A factory without ``device=`` (or with ``"cpu"``) makes a host tensor, ``device=`` the compute
    device (``cpu:0``) or a tensor's ``.device`` a device one; ``.to()``/``.cpu()`` copy across;
    other results are on the host only if all tensor inputs are; ``Tensor.device`` reports it.
    Backward runs outside the mode, untracked: unknown tensors count as device tensors, so the
    check can miss a bug but does not flag correct code (docs/clusters.md).
    """

    COMPUTE = torch.device("cpu", 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE:
            return device_of(args[0])
        out = func(*args, **kwargs)
        if not isinstance(out, (torch.Tensor, tuple, list)):
            return out
        if func is torch.Tensor.to:
            src, rest = args[0], args[1:]
            if rest and isinstance(rest[0], torch.Tensor):
                host = getattr(rest[0], _HOST_MARK, False)
            else:
                dev = torch._C._nn._parse_to(*rest, **kwargs)[0]
                host = getattr(src, _HOST_MARK, False) if dev is None else _is_host_device(dev)
            if out is src and host != getattr(src, _HOST_MARK, False):
                out = out.clone()  # a GPU copies between host and device
        elif func is torch.Tensor.cpu:
            host = True
            if out is args[0] and not getattr(out, _HOST_MARK, False):
                out = out.clone()
        elif kwargs.get("device") is not None:
            host = _is_host_device(kwargs["device"])
        else:
            ins = list(_tensors(args, kwargs))
            if any(out is t for t in ins):  # in place: the tensor stays where it is
                return out
            host = all(getattr(t, _HOST_MARK, False) for t in ins)  # no inputs: a factory
        _mark(out, host)
        return out


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def bytes_sent() -> Dict[str, int]:
    """Bytes sent per tag since the last reset, except by collectives traced into a compiled
    graph (a --torch-compile'd layer's TP collectives): counting there would be a Python side
    effect inside an autograd function, which breaks the graph at every collective."""
    return dict(_BYTES_SENT)


def reset_bytes_sent() -> None:
    _BYTES_SENT.clear()


def _count(kind: str, full_bytes: int, n: int, factor: float) -> None:
    if torch.compiler.is_compiling():  # see bytes_sent
        return
    _BYTES_SENT[kind] += int(round(factor * (n - 1) / n * full_bytes))


def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False,
               tag: str = "all_reduce", host: bool = False):
    """In-place all-reduce. Use SUM and divide rather than AVG (gloo has no AVG)."""
    n = group_size(group)
    if n == 1:
        return None
    _check(tag, tensor, group, host)
    _count(tag, tensor.numel() * tensor.element_size(), n, 2.0)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False, tag: str = "all_gather"):
    """Gather equal shards along dim 0 into ``output`` (size n * input along dim 0)."""
    n = group_size(group)
    if n == 1:
        output.copy_(input)
        return None
    _check(tag, input, group, False)
    _check(tag, output, group, False)
    _count(tag, output.numel() * output.element_size(), n, 1.0)
    return _all_gather_tensor(output, input.contiguous(), group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                          op=ReduceOp.SUM, async_op: bool = False, tag: str = "reduce_scatter"):
    """Sum ``input`` over the group and keep this rank's dim-0 shard in ``output``."""
    n = group_size(group)
    if n == 1:
        output.copy_(input)
        return None
    _check(tag, input, group, False)
    _check(tag, output, group, False)
    _count(tag, input.numel() * input.element_size(), n, 1.0)
    return _reduce_scatter_tensor(output, input.contiguous(), op=op, group=group,
                                      async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, tag: str = "broadcast",
              host: bool = False):
    n = group_size(group)
    if n == 1:
        return None
    _check(tag, tensor, group, host)
    _BYTES_SENT[tag] += tensor.numel() * tensor.element_size()
    return dist.broadcast(tensor, src=src, group=group)


def batch_isend_irecv(ops, tag: str = "p2p"):
    """Point-to-point sends/receives (pipeline activations and gradients: the device path)."""
    for op in ops:
        _check(tag, op.tensor, op.group, False)
    return dist.batch_isend_irecv(ops)


def barrier(group=None) -> None:
    """Wait for every rank of ``group`` (None: the world); a no-op without peers."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def all_gather_object(obj, group) -> list:
    """Every rank's picklable ``obj`` (torch serialises through the group's own device)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def count_p2p(num_bytes: int, tag: str = "p2p") -> None:
    _BYTES_SENT[tag] += int(num_bytes)
