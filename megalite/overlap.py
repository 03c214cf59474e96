"""Hiding MoE all-to-alls behind compute (docs/moe.md): the deferred weight-gradient store, the
``Pair`` that runs a forward and a backward as two sides, the exchange hook the MoE dispatcher
calls, and the clock intervals are recorded with (docs/design.md, "The overlap module").
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, List, Optional, Sequence

import torch

from megalite import collectives as C
from megalite.param_meta import grad_of, param_meta, set_param_meta


class Clock:
    """Interval marks: CUDA events on a CUDA device, host ``perf_counter`` elsewhere
    (docs/design.md, "Timing"); ``seconds(mark)`` waits for the event."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.t0 = self.mark()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        if not self.cuda:
            return mark - self.t0
        mark.synchronize()
        return self.t0.elapsed_time(mark) / 1e3


class WeightGradStore:
    """One step's deferred weight gradients (W), owned by the executor: marked layers queue a
    closure per weight while it captures; a labelled capture joins the first-in-first-out groups
    ``run_one``/``flush`` run; ``on_run(label, start, end)`` sees each run."""

    def __init__(self, on_run: Optional[Callable] = None, clock: Optional[Clock] = None):
        self.queue: Optional[List[Callable[[], None]]] = None  # the capturing backward's
        self.groups: List[tuple] = []  # (label, a backward's W's still to run)
        self.on_run, self.clock = on_run, clock

    @property
    def capturing(self) -> bool:
        return self.queue is not None

    @contextlib.contextmanager
    def capture(self, label=None):
        """One backward whose marked layers queue their W's into the yielded list."""
        previous, self.queue = self.queue, []
        if label is not None:
            self.groups.append((label, self.queue))
        try:
            yield self.queue
        finally:
            self.queue = previous

    def put(self, param: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        """Queue ``param``'s weight gradient, ``compute()``, for the W pass (capturing only)."""
        # a gradient buffer waits for this part (ddp.py); accumulate_weight_grad counts it off
        set_param_meta(param, weight_grads_queued=param_meta(param).weight_grads_queued + 1)
        self.queue.append(lambda: accumulate_weight_grad(param, compute()))

    def run_one(self, before=None) -> bool:
        """Run the oldest queued W (``before``: if its backward's label is lower); False when
        there is none to run."""
        while len(self.groups) > 1 and not self.groups[0][1]:
            self.groups.pop(0)  # (the last group's backward may still be appending)
        if not self.groups or not self.groups[0][1]:
            return False
        label, queue = self.groups[0]
        if before is not None and label >= before:
            return False
        timed = self.on_run is not None and self.clock is not None
        start = self.clock.mark() if timed else None
        queue.pop(0)()
        if timed:
            self.on_run(label, start, self.clock.mark())
        return True

    def flush(self, before=None) -> None:
        """Run the queued W's (``before``: those of backwards labelled lower)."""
        while self.run_one(before):
            pass


@torch.no_grad()  # the W closure runs outside backward; accumulation must not be recorded
def accumulate_weight_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add a deferred weight gradient to the parameter's gradient storage."""
    meta = set_param_meta(param, weight_grads_queued=param_meta(param).weight_grads_queued - 1)
    target = grad_of(param)
    if target is not None:
        target.add_(grad.to(target.dtype))
    else:
        param.grad = grad.to(param.dtype)
    if meta.deferred_grad_hook is not None:  # lets a gradient buffer learn the param is ready
        meta.deferred_grad_hook(param)


class Pair:
    """Two sides run as coroutines on two threads, side 0 first, handing over only inside
    ``switch`` or by ending; a side that raises aborts the pair (docs/design.md, "The overlap
    module"). The running side switches, whichever thread it is on: no thread identities.
    ``fill``: the store whose W's ``fill_while`` runs in all-to-all waits."""

    def __init__(self, names: Sequence[str] = ("side 0", "side 1"),
                 on_resume: Optional[Callable[[int], None]] = None,
                 fill: Optional[WeightGradStore] = None):
        self.cond = threading.Condition()
        self.turn, self.done = 0, [False, False]
        self.failed: Optional[tuple] = None  # (side, exception) of the side that raised
        self.names, self.on_resume, self.fill = names, on_resume, fill

    def fill_while(self, work) -> None:
        """Run queued W's, first in first out, while ``work`` (an issued exchange of the running
        side) is still in flight, and only until it completes: a W run past that delays this
        rank's next exchange, which the peer ranks wait for (docs/moe.md)."""
        while self.fill is not None and not work.is_completed() and self.fill.run_one():
            pass

    def switch(self) -> None:
        with self.cond:
            me = self.turn
            if not self.done[1 - me]:  # (an ended side has nothing to hand over to)
                self.turn = 1 - me
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.turn == me)
            if self.failed is not None:
                raise RuntimeError("the paired side raised")  # unwinds this side (run)
        if self.on_resume is not None:
            self.on_resume(me)

    def run(self, side0: Callable, side1: Callable) -> None:
        # CUDA's current device is per thread (a new one starts on GPU 0): side 1's thread takes
        # the caller's, so what it launches or records without a device (events) lands there
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def side(k: int, fn: Callable) -> None:
            if k == 1 and device is not None:
                torch.cuda.set_device(device)
            with self.cond:
                self.cond.wait_for(lambda: self.turn == k)
            try:
                if self.failed is None:
                    fn()
            except BaseException as e:  # re-raised on the caller's thread below
                if self.failed is None:
                    self.failed = (k, e)
            finally:
                with self.cond:
                    self.done[k], self.turn = True, 1 - k
                    self.cond.notify_all()

        other = threading.Thread(target=side, args=(1, side1), daemon=True)
        other.start()
        side(0, side0)
        other.join()
        if self.failed is not None:
            k, e = self.failed
            rank = C.group_rank(C.world_group())
            raise RuntimeError(f"rank {rank}: {self.names[k]} raised {C.one_line(e)}; its pair "
                               f"with {self.names[1 - k]} was aborted") from e


_PAIR: Optional[Pair] = None  # the running pair, whose exchanges are issued async
_RECORD: Optional[tuple] = None  # (clock, record(kind, start, end)): the executor's, when timed


@contextlib.contextmanager
def overlapping(pair: Optional[Pair], clock: Optional[Clock] = None,
                record: Optional[Callable] = None):
    """For the block, ``exchange`` runs inside ``pair`` (None: blocking) and reports the
    intervals its caller is blocked to ``record`` (``clock`` marks)."""
    global _PAIR, _RECORD
    previous = _PAIR, _RECORD
    _PAIR, _RECORD = pair, (clock, record) if record is not None else None
    try:
        yield
    finally:
        _PAIR, _RECORD = previous


def exchange(output: torch.Tensor, input: torch.Tensor, output_split_sizes, input_split_sizes,
             group, tag: str) -> None:
    """``collectives.all_to_all_single``, blocking for its caller; inside a pair issued async,
    handing over until the other side's next exchange (docs/moe.md, "Hiding the all-to-alls",
    which also has the "A" and "I" intervals recorded)."""
    pair, (clock, record) = _PAIR, _RECORD or (None, None)
    start = clock.mark() if record else None
    work = C.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, tag,
                               async_op=pair is not None)
    if work is not None and pair is not None:
        issued = clock.mark() if record else None
        pair.switch()
        pair.fill_while(work)  # deferred weight gradients, where nothing else would run
        resumed = clock.mark() if record else None
        work.wait()
        if record:
            record("I", start, issued)
            record("A", resumed, clock.mark())
    elif record:
        record("A", start, clock.mark())
