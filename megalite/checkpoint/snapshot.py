"""Host copies of what a checkpoint writes, byte for byte, into buffers reused across saves
(docs/checkpoints.md, "Asynchronous saves": what the copy keeps, pinned memory on CUDA)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch


class HostBuffers:
    """Host storages for snapshots, reused across saves (one copy of the rank's share)."""

    def __init__(self, pinned: bool = False):
        self.pinned = bool(pinned)
        self.storages: List[torch.UntypedStorage] = []
        self.allocations = 0  # storages allocated over the run (reuse keeps it at one save's)
        self._next = 0
        self._event = None

    def begin(self) -> None:
        self._next = 0

    def take(self, nbytes: int) -> torch.UntypedStorage:
        """The host storage for the next source storage of this save (exactly ``nbytes``:
        ``torch.save`` writes a storage's whole extent)."""
        i, self._next = self._next, self._next + 1
        if i < len(self.storages) and self.storages[i].nbytes() == nbytes:
            return self.storages[i]
        s = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned).untyped_storage()
        self.allocations += 1
        if i < len(self.storages):
            self.storages[i] = s
        else:
            self.storages.append(s)
        return s

    def end(self, device: torch.device) -> None:
        """After the copies of one save were queued: record when they are done."""
        del self.storages[self._next:]  # storages a smaller save no longer uses
        self._event = None
        if self.pinned and device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def ready(self) -> None:
        """Block until the last save's copies are on the host (the writer's first step)."""
        if self._event is not None:
            self._event.synchronize()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)


def snapshot(obj, buffers: Optional[HostBuffers] = None, copy_host: bool = True):
    """``obj`` with every tensor copied to the host: one copied storage per source storage (views
    stay views), containers with their attributes, parameters with theirs. ``buffers`` None:
    fresh host memory; ``copy_host`` False: CPU tensors are kept as they are."""
    storages: Dict[tuple, torch.UntypedStorage] = {}
    memo: Dict[int, object] = {}
    non_blocking = buffers is not None and buffers.pinned

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not copy_host:
            return t
        src = t.untyped_storage()
        key = (t.device.type, t.device.index, src.data_ptr(), src.nbytes())
        dst = storages.get(key)
        if dst is None:
            dst = (buffers.take(src.nbytes()) if buffers is not None
                   else torch.UntypedStorage(src.nbytes()))
            dst.copy_(src, non_blocking=non_blocking)
            storages[key] = dst
        out = torch.empty(0, dtype=t.dtype).set_(dst, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            p = torch.nn.Parameter(out, requires_grad=t.requires_grad)
            p.__dict__.update(t.__dict__)
            return p
        if t.requires_grad:
            out.requires_grad_(True)
        if t.__dict__:  # torch.save records a tensor's Python attributes too
            out.__dict__.update(t.__dict__)
        return out

    def walk(x):
        if isinstance(x, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device,
                          torch.Size)):
            return x
        hit = memo.get(id(x))
        if hit is not None:
            return hit
        if isinstance(x, torch.Tensor):
            out = tensor(x)
        elif isinstance(x, dict):
            out = type(x)()
            memo[id(x)] = out
            out.update((k, walk(v)) for k, v in x.items())
            if getattr(x, "__dict__", None):
                out.__dict__.update(x.__dict__)
            return out
        elif isinstance(x, list):
            out = []
            memo[id(x)] = out
            out.extend(walk(v) for v in x)
            return out
        elif isinstance(x, tuple):
            out = type(x)(*map(walk, x)) if hasattr(x, "_fields") else tuple(map(walk, x))
        else:
            return x  # other immutable leaves
        memo[id(x)] = out
        return out

    return walk(obj)
