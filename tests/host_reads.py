"""Counting the project's own host reads of tensor values, per training iteration.

On a GPU every read of a device tensor's value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, ``torch.equal``) and every op whose output shape depends on the data (``nonzero``,
boolean-mask indexing) stalls the host until the device has caught up. On CPU they cost nothing,
so they are invisible to timing; this module makes them countable on any device: a dispatch mode
sees every such aten op, a function mode sees ``.tolist()`` (which reads memory directly), and
each is attributed to the nearest Python frame outside torch. Only frames in megalite/ count:
torch's own reads (its optimizers read their host-side step counters) are not the project's.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import List

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROJECT = os.path.join(_ROOT, "megalite") + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_aten = torch.ops.aten
# ops that hand a value to the host, or whose output shape is the data's
_READS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.equal.default,
          _aten.masked_select.default, _aten.unique_consecutive.default,
          _aten._unique2.default}


# the frames of the modes themselves; the first frame past them made the read
_MACHINERY = {os.path.abspath(__file__)} | {os.path.join(_TORCH, *p.split("/")) for p in (
    "utils/_python_dispatch.py", "overrides.py", "_tensor.py", "_ops.py", "_compile.py",
    "_dynamo/eval_frame.py")}


def _caller() -> str:
    f = sys._getframe(2)
    while f is not None and os.path.abspath(f.f_code.co_filename) in _MACHINERY:
        f = f.f_back
    return "" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


class HostReads(TorchDispatchMode):
    """Counts host reads made from megalite/ code into ``self.per_iteration[-1]``."""

    def __init__(self):
        super().__init__()
        self.per_iteration: List[Counter] = [Counter()]
        self._fn = _ToList(self)

    def note(self, what: str) -> None:
        where = _caller()
        if where.startswith(_PROJECT):
            self.per_iteration[-1][f"{os.path.relpath(where, _ROOT)} {what}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS or (func is _aten.index.Tensor and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])):
            self.note(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        self._fn.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._fn.__exit__(*exc)

    def next_iteration(self) -> None:
        self.per_iteration.append(Counter())


class _ToList(TorchFunctionMode):
    def __init__(self, owner: HostReads):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.owner.note("tolist")
        return func(*args, **(kwargs or {}))


def count_pretrain(argv, cuda_syncs: bool = False) -> List[Counter]:
    """Run pretrain.py's main in this process under :class:`HostReads`; one Counter per
    iteration (reads after iteration k's record up to iteration k+1's: its log line, its step).
    Calls of megalite's ``synchronize`` (a no-op on CPU, a device sync on a GPU) count too.

    ``cuda_syncs`` (a CUDA run): also count every synchronizing CUDA call, from any code (torch's
    own included), as ``torch.cuda.set_sync_debug_mode("warn")`` reports it: the device's own
    cross-check of the dispatch-level count (keys ``cuda sync FILE:LINE``)."""
    import warnings

    from megalite import parallel_state
    from megalite.training import Trainer
    from pretrain_utils import run_main

    mode, record, sync = HostReads(), Trainer._record, parallel_state.synchronize
    caught: list = []

    def drain():
        for w in caught:
            if "synchroniz" in str(w.message):
                where = os.path.relpath(w.filename, _ROOT) if w.filename.startswith(_ROOT) \
                    else os.path.basename(w.filename)
                mode.per_iteration[-1][f"cuda sync {where}:{w.lineno}"] += 1
        caught.clear()

    def _record(self, *a, **k):
        record(self, *a, **k)
        drain()
        mode.next_iteration()

    def _sync(device):
        mode.note("synchronize")
        sync(device)

    users = [m for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("megalite")
             and getattr(m, "synchronize", None) is sync]
    Trainer._record = _record
    for m in users:
        m.synchronize = _sync
    try:
        with warnings.catch_warnings(record=cuda_syncs) as recorded:
            if cuda_syncs:
                caught = recorded
                warnings.simplefilter("always")  # every sync, not the first per line
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with mode:
                    assert run_main(list(argv)) == 0
            finally:
                if cuda_syncs:
                    torch.cuda.set_sync_debug_mode("default")
            drain()
    finally:
        Trainer._record = record
        for m in users:
            m.synchronize = sync
    return mode.per_iteration
