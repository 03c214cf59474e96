"""Strict collectives: a collective handed a tensor its path cannot carry on NCCL fails, on CPU too.

Test-harness code (docs/clusters.md, "Strict mode"): megalite never imports it. A process opts in
with :func:`enable` before its process group is set up, or runs a script under it:

    python tests/strict_collectives.py pretrain.py --tensor-model-parallel-size 2 ...
    torchrun --nproc-per-node 4 tests/strict_collectives.py pretrain.py ...

On a GPU the check is a device comparison. On CPU every tensor is a CPU tensor, so the check would
be empty: :class:`EmulatedDevice` (a process-wide ``TorchFunctionMode``) then stands in for a GPU.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megalite import collectives as C

HOST = C.HOST
COMPUTE = torch.device("cpu", 0)  # the emulated GPU
_HOST_MARK = "_megalite_on_host"
_DEVICE = torch.Tensor.device  # its __get__ is a fresh object at each access: compare __self__
_STATE = {"device": HOST, "emulated": None}


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor on a device its path does not serve."""


def configure(device: torch.device) -> torch.device:
    """The device path serves ``device``; on CPU the emulated GPU, from now on in this process."""
    if device.type == "cpu":
        if _STATE["emulated"] is None:
            _STATE["emulated"] = EmulatedDevice()
            _STATE["emulated"].__enter__()  # for the rest of the process
        device = COMPUTE
    _STATE["device"] = device
    return device


def device_of(t: torch.Tensor) -> torch.device:
    """Where ``t`` lives, or under GPU emulation, where it would live on a GPU."""
    if _STATE["emulated"] is not None and t.device.type == "cpu":
        return HOST if getattr(t, _HOST_MARK, False) else COMPUTE
    return t.device


def check(kind: str, t: torch.Tensor, group, host: bool) -> None:
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


def enable() -> None:
    """Strict mode for this process (before ``initialize_model_parallel``)."""
    C.install_strict_checks(sys.modules[__name__])


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


if __name__ == "__main__":  # python tests/strict_collectives.py SCRIPT [ARGS...]
    if len(sys.argv) < 2:
        sys.exit(f"usage: {os.path.basename(sys.argv[0])} SCRIPT [ARGS...]")
    # enabled under the module's own name: the mode's code must not live in the __main__ that
    # runpy replaces (torch.compile's guards look its globals up by module name)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import strict_collectives

    strict_collectives.enable()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
