"""Host copies of what a checkpoint writes, byte for byte (docs/checkpoints.md, "Asynchronous
saves").

``snapshot(obj, buffers)`` returns ``obj`` with every tensor replaced by a CPU copy, so a writer
can ``torch.save`` it later while training changes the originals. The copy keeps everything
``torch.save`` records, so the file is the file of ``obj`` itself: one copied storage per source
storage (views of one flat buffer stay views of one copy, at the same offsets and strides, and
``torch.save`` writes the whole storage behind a view), the container types and their attributes
(a module ``state_dict``'s ``_metadata``), shared objects shared once (pickle's memo), and
``nn.Parameter`` with its ``requires_grad`` and attributes.

``HostBuffers`` is the seam between the CPU and CUDA paths: it hands out the host storage each
source storage is copied into, the i-th storage of a save reusing the i-th of the last save when
the sizes match (a model's checkpoint has the same storages at every save), so a run allocates
its snapshot memory once. ``pinned=True`` (CUDA) allocates page-locked memory and copies without
blocking the host; the copies are queued on the current stream, behind the step that produced
the tensors and before any later step that changes them, and ``ready()`` is the event the writer
waits on. On CPU the copies are plain ``copy_`` calls, done when ``snapshot`` returns.
"""

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
    """``obj`` with every tensor copied to the host (see the module docstring).

    ``buffers`` None: fresh plain host memory (a synchronous save's device tensors, one file at a
    time). ``copy_host`` False: CPU tensors are kept as they are (nothing will change them before
    the caller writes them), only device tensors are copied.
    """
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
            for k, v in x.items():
                out[k] = walk(v)
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
