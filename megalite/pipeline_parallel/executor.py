"""The pipeline executor: runs one rank's op list with the p2p program that suits its backend.

``schedules.schedule_order`` says what to compute (F, B, W ops), ``schedules.p2p_program`` where
the sends and receives go ("post", "wait" and "run" steps); this module only carries them out:

    for step in program:  post a batch | wait for one | run ops[i]  (F, B or W)

The program is "eager" where every send and receive completes on its own (gloo) and "batched"
elsewhere (NCCL); both run the same ops in the same order. Data between two chunks of the same
rank (where the V of zb-v / dualpipev turns, on rank p-1) is handed over in memory.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Dict, List, Optional

import torch
from torch.autograd.variable import Variable

from megalite import collectives as C
from megalite.parallel_state import synchronize
from megalite.pipeline_parallel.p2p import (
    TAG_ACTIVATION, TAG_GRADIENT, PipelineP2P, tensor_shape)
from megalite.config import V_SCHEDULES, ConfigError, check_pipeline_args
from megalite.moe.layer import enable_expert_weight_grad_deferral
from megalite.pipeline_parallel.partition import virtual_stage
from megalite.pipeline_parallel.schedules import Op, op_peers, p2p_program, schedule_order
from megalite.pipeline_parallel.timeline import StageTimeline, last_timeline, set_last_timeline
from megalite.tensor_parallel.layers import WeightGradStore, enable_weight_grad_deferral


def _free_output_data(t: torch.Tensor) -> None:
    """Drop the storage of a stage output once it has been sent, keeping its autograd node.

    The next stage has its own copy (the p2p batch holds the sent data until it completes); this
    stage only needs the graph for backward, so holding the [s, b, h] tensor too would cost one
    activation per in-flight micro-batch for nothing (Megatron's deallocate_output_tensor idea).
    Views are left alone: their storage belongs to another tensor.
    """
    if t._base is None:
        t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def _backward(output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """Backward through a stage whose output storage may have been freed: the engine is called
    directly, since torch.autograd.backward checks grad.shape against the freed output's [1]."""
    if grad is None:
        torch.autograd.backward(output)
        return
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


class PipelineExecutor:
    """One rank's part of one pipelined step. Ops are indices into ``self.ops``; ``inbox[i]`` is
    op i's input (activation for F, output gradient for B) and ``outbox[i]`` its output until sent.
    """

    def __init__(self, schedule: str, chunks: list, parallel_state, m: int, forward_only: bool,
                 forward_step_func: Callable, data_iterator, grad_scale_func, no_sync_func,
                 p2p: PipelineP2P, timing: bool, paired: bool = False,
                 delay_wgrad: bool = False):
        ps = parallel_state
        self.chunks, self.p2p, self.forward_only = chunks, p2p, forward_only
        self.forward_step_func, self.grad_scale_func = forward_step_func, grad_scale_func
        p, r, v = ps.pp_size, ps.pp_rank, len(chunks)
        self.r = r
        self.ops = schedule_order(schedule, p, r, m, v, forward_only, paired)
        self.peers = [op_peers(op, schedule, p, r, v) for op in self.ops]
        self.index = {(op.kind, op.chunk, op.microbatch): i for i, op in enumerate(self.ops)}
        vs = [virtual_stage(p, r, c, v, schedule in V_SCHEDULES) for c in range(v)]
        self.first = [s == 0 for s in vs]  # chunk c takes the input ids
        self.last = [s == p * v - 1 for s in vs]  # chunk c computes the loss
        self.deferred_w = {(op.chunk, op.microbatch) for op in self.ops if op.kind == "W"}
        enable_weight_grad_deferral(chunks if self.deferred_w else [])  # linears B can defer
        self.data = _Feeder(data_iterator, v, m)
        self.no_sync = _NoSync(None if forward_only else no_sync_func, self.ops)
        self.inbox: Dict[int, Optional[torch.Tensor]] = {}
        self.outbox: Dict[int, torch.Tensor] = {}
        self.saved: Dict[tuple, tuple] = {}  # (chunk, mb) -> (input, output) awaiting B
        self.weight_grads: Dict[tuple, list] = {}  # (chunk, mb) -> W closures awaiting W
        self.batches: Dict[int, object] = {}
        self.stats: List[dict] = []
        self.timeline = StageTimeline(schedule, r, p, m, v) if timing else None
        self.t0 = time.perf_counter()
        self.running: Optional[Op] = None  # the op an all-to-all wait is charged to
        # --delay-wgrad-compute: a pair's backward queues its experts' W's, run first in first
        # out in all-to-all waits (Pair.fill_while), the rest before the next op outside a pair
        # that computes gradients, so every gradient still accumulates in micro-batch order
        self.wgrads = WeightGradQueue(self._record_w) if paired and delay_wgrad else None
        if self.wgrads is not None:
            enable_expert_weight_grad_deferral(chunks)

    # ---------------------------------------------------------------- the program's three steps
    def post(self, b: int, sends, recvs) -> None:
        def tag(i):
            return TAG_ACTIVATION if self.ops[i].kind == "F" else TAG_GRADIENT
        outs = [(i, self.outbox.pop(i)) for i in sends]
        self.batches[b] = (recvs, self.p2p.post(
            sends=[(self.peers[i][1], tag(i), t) for i, t in outs],
            recvs=[(self.peers[i][0], tag(i)) for i in recvs]))
        for i, t in outs:
            if self.ops[i].kind == "F" and not self.forward_only:
                _free_output_data(t)  # the batch holds the sent data until it completes
        for k in [k for k, (rv, bt) in self.batches.items() if not rv and bt and bt.done()]:
            del self.batches[k]  # sends that have completed: let go of their data

    def wait(self, b: int) -> None:
        recvs, batch = self.batches.pop(b)
        self.inbox.update(zip(recvs, batch.wait() if batch is not None else []))

    def run(self, i: int) -> None:
        if self.wgrads is not None and self.ops[i].kind != "F":
            self.wgrads.flush()
        self.no_sync.before(i)
        start = self._clock()
        self._deliver(i, self._compute(i), start)

    def pair(self, i: int, k: int) -> None:
        """An F&B pair (schedules.paired_units): the forward ops[i] and the backward ops[k] as
        the two sides of a ``Pair``, interleaved at their all-to-alls (docs/pipeline_parallel.md,
        "F&B pairs"); each side's output leaves once both have ended."""
        for j in (i, k):
            self.no_sync.before(j)
        start, outs, sides = self._clock(), {}, (i, k)

        def side(j: int) -> None:
            began = time.perf_counter() - self.t0
            key = (self.ops[j].chunk, self.ops[j].microbatch)
            queued = self.wgrads is not None and self.ops[j].kind == "B" \
                and key not in self.deferred_w  # (a B with a W op of its own defers into it)
            with self.wgrads.capture(j) if queued else contextlib.nullcontext():
                outs[j] = self._compute(j)
            if self.timeline is not None:
                op = self.ops[j]
                self.timeline.record(op.kind, op.chunk, op.microbatch, began,
                                     time.perf_counter() - self.t0)

        pair = Pair(on_resume=lambda s: setattr(self, "running", self.ops[sides[s]]),
                    fill=self.wgrads)
        C.set_overlap(pair, self._a2a_observer())
        try:
            pair.run(lambda: side(i), lambda: side(k))
        finally:
            C.set_overlap(None, self._a2a_observer())
        if self.wgrads is not None:  # older backwards' W's now: at most two backwards' held
            self.wgrads.flush(before=k)
        for j in sides:
            self._deliver(j, outs[j], None)
        if self.timeline is not None:
            synchronize(self.p2p.device)
            self.timeline.end = max(self.timeline.end, time.perf_counter() - self.t0)

    def _record_interval(self, kind: str, op: Op, start: float, end: float) -> None:
        """An interval inside an op (perf_counter times): a queued W, an all-to-all's A or I."""
        if self.timeline is not None:
            self.timeline.record(kind, op.chunk, op.microbatch, start - self.t0, end - self.t0)

    def _record_w(self, i: int, start: float, end: float) -> None:
        self._record_interval("W", self.ops[i], start, end)

    def _clock(self) -> Optional[float]:
        if self.timeline is None:
            return None
        synchronize(self.p2p.device)
        return time.perf_counter() - self.t0

    def _compute(self, i: int):
        op = self.running = self.ops[i]
        compute = {"F": self.forward, "B": self.backward, "W": self.weight}[op.kind]
        return compute(op, self.inbox.pop(i, None))

    def _deliver(self, i: int, out, start: Optional[float]) -> None:
        """Hand op i's output to its consumer; record its span (``start``: not already
        recorded)."""
        op, dst = self.ops[i], self.peers[i][1]
        if dst == self.r:  # the V turns inside this rank: hand the output to its consumer
            nxt = Op(op.kind, 1 - op.chunk, op.microbatch)
            self.inbox[self.index[nxt.kind, nxt.chunk, nxt.microbatch]] = out.detach()
        elif dst is not None:
            self.outbox[i] = out
        if self.timeline is not None and start is not None:
            synchronize(self.p2p.device)
            self.timeline.record(op.kind, op.chunk, op.microbatch, start,
                                 time.perf_counter() - self.t0)

    def _a2a_observer(self) -> Optional[Callable]:
        """Records the intervals the running op was blocked in an MoE all-to-all: "A" waiting,
        "I" issuing one (collectives.all_to_all_overlapped)."""
        if self.timeline is None:
            return None
        return lambda start, end, kind: self._record_interval(kind, self.running, start, end)

    # ---------------------------------------------------------------- F, B and W
    def forward(self, op: Op, inp: Optional[torch.Tensor]) -> torch.Tensor:
        if inp is not None:
            inp.requires_grad_(not self.forward_only)
        chunk = self.chunks[op.chunk]
        chunk.set_input_tensor(inp)
        with torch.set_grad_enabled(not self.forward_only):
            out, loss_func = self.forward_step_func(self.data.get(op.chunk, op.microbatch), chunk)
            if self.last[op.chunk]:
                out, stats = loss_func(out)
                self.stats.append(stats)
                if self.grad_scale_func is not None and not self.forward_only:
                    out = self.grad_scale_func(out)
        chunk.set_input_tensor(None)
        if not self.forward_only:
            self.saved[op.chunk, op.microbatch] = (inp, out)
            if self.timeline is not None:
                self.timeline.peak_in_flight = max(self.timeline.peak_in_flight, len(self.saved))
        return out

    def backward(self, op: Op, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        key = (op.chunk, op.microbatch)
        inp, out = self.saved.pop(key)
        if key in self.deferred_w:  # B computes the input gradient; a W op the weights' later
            with WeightGradStore.capture() as queue:
                _backward(out, grad)
            self.weight_grads[key] = list(queue)
        else:
            _backward(out, grad)
        return None if self.first[op.chunk] else inp.grad

    def weight(self, op: Op, _unused) -> None:
        for fn in self.weight_grads.pop((op.chunk, op.microbatch)):
            fn()

    def execute(self, program: List[tuple]) -> List[dict]:
        C.set_overlap(None, self._a2a_observer())
        try:
            for step, *args in program:
                getattr(self, step)(*args)
            if self.wgrads is not None:
                self.wgrads.flush()
            for recvs, batch in self.batches.values():
                if batch is not None:
                    batch.wait()
        finally:
            C.set_overlap(None, None)
            self.no_sync.close()
        assert self.forward_only or not (self.saved or self.weight_grads), "work left undone"
        return self.stats


def forward_backward_pipelining(*, forward_step_func: Callable, data_iterator, model,
                                num_microbatches: int, seq_length: int, micro_batch_size: int,
                                parallel_state, forward_only: bool = False,
                                grad_scale_func: Optional[Callable] = None,
                                no_sync_func=None,
                                finalize_model_grads_func: Optional[Callable] = None,
                                schedule: Optional[str] = None, timing_log_level: int = 0,
                                p2p_mode: Optional[str] = None,
                                overlap_moe_expert_parallel_comm: bool = False,
                                delay_wgrad_compute: bool = False,
                                **unused) -> List[dict]:
    """Run this rank's part of a pipelined step (schedules' contract).

    ``p2p_mode``: "eager" or "batched" (schedules.p2p_program); None picks eager where the
    backend's p2p ops complete independently (gloo) and batched elsewhere (NCCL).
    ``overlap_moe_expert_parallel_comm``: run the schedule's F&B pairs (schedules.paired_units,
    docs/pipeline_parallel.md "F&B pairs"); the same ops on the same inputs, so the same losses
    and gradients bit for bit. ``delay_wgrad_compute`` (with it): a paired backward's expert
    weight gradients fill the pair's all-to-all waits (``Pair.fill_while``).
    """
    ps = parallel_state
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    schedule = check_pipeline_args(ps.pp_size, num_microbatches, len(chunks), schedule)
    cfg, param = chunks[0].config, next(chunks[0].parameters())
    p2p = PipelineP2P(ps, tensor_shape(seq_length, micro_batch_size, cfg.hidden_size, ps.tp_size,
                                       chunks[0].sequence_parallel), param.dtype, param.device)
    mode = p2p_mode or ("eager" if p2p.independent_ops else "batched")
    if mode == "eager" and not p2p.independent_ops:
        raise ValueError("p2p_mode='eager' needs a backend whose p2p ops complete "
                         "independently (gloo)")
    timing = timing_log_level >= 1
    if timing:
        synchronize(param.device)
        if ps.pp_group is not None:
            C.barrier(group=ps.pp_group)  # a common step start for all stages
    paired = overlap_moe_expert_parallel_comm and not forward_only
    ex = PipelineExecutor(schedule, chunks, ps, num_microbatches, forward_only, forward_step_func,
                          data_iterator, grad_scale_func, no_sync_func, p2p, timing, paired,
                          delay_wgrad_compute)
    stats = ex.execute(p2p_program(mode, schedule, ps.pp_size, ps.pp_rank, num_microbatches,
                                   len(chunks), forward_only, paired))
    if timing:
        set_last_timeline(ex.timeline)
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(chunks)
    return stats


class _Feeder:
    """Hands each (chunk, micro-batch) its data per the contract's data convention."""

    def __init__(self, data_iterator, num_chunks: int, num_microbatches: int):
        self.per_chunk = isinstance(data_iterator, (list, tuple))
        if self.per_chunk and len(data_iterator) != num_chunks:
            raise ValueError(f"data_iterator is a list of {len(data_iterator)} iterators but this "
                             f"rank has {num_chunks} model chunks: pass one per chunk, or one")
        self.it, self.cache, self.uses = data_iterator, {}, {}
        self.num_chunks = num_chunks

    def get(self, chunk: int, mb: int):
        if self.per_chunk:
            return self.it[chunk]
        if self.it is None:
            return None
        while len(self.uses) <= mb:  # fetch in micro-batch order, each exactly once
            self.cache[len(self.uses)] = next(self.it)
            self.uses[len(self.uses)] = 0
        batch = self.cache[mb]
        self.uses[mb] += 1
        if self.uses[mb] == self.num_chunks:  # every chunk of this rank has run micro-batch mb
            del self.cache[mb]
        return iter([batch])


class _NoSync:
    """Enter the DP no-sync context(s) for the whole step and leave each just before the last op
    that produces gradients for its chunk(s), so that op's gradients may be reduced (or their
    reduction launched by DDP hooks) while the pipeline drains."""

    def __init__(self, no_sync_func, ops: List[Op]):
        grad_ops = [i for i, op in enumerate(ops) if op.kind in ("B", "W")]
        self.exit_at: Dict[int, list] = {}
        self.open: List[contextlib.AbstractContextManager] = []
        if no_sync_func is None or not grad_ops:
            return
        per_chunk = isinstance(no_sync_func, (list, tuple))
        for c, fn in enumerate(no_sync_func if per_chunk else [no_sync_func]):
            idx = [i for i in grad_ops if ops[i].chunk == c or not per_chunk]
            if idx:
                cm = fn()
                cm.__enter__()
                self.open.append(cm)
                self.exit_at.setdefault(idx[-1], []).append(cm)

    def before(self, i: int) -> None:
        for cm in self.exit_at.pop(i, []):
            cm.__exit__(None, None, None)
            self.open.remove(cm)

    def close(self) -> None:
        for cm in self.open:
            cm.__exit__(None, None, None)
        self.open = []


# ----------------------------------------------------------------------------- entry points
class WeightGradQueue:
    """The deferred weight gradients (W) of successive backwards, run first in, first out: each
    parameter's W's then accumulate in the order of their backwards, as inline gradients would.
    ``capture(label)`` is the context of one backward (its W's are appended as it reaches them,
    and may be run meanwhile); ``on_run(label, start, end)`` sees each W run."""

    def __init__(self, on_run: Optional[Callable[[int, float, float], None]] = None):
        self.groups: List[tuple] = []  # (label, the backward's W's still to run)
        self.on_run = on_run

    @contextlib.contextmanager
    def capture(self, label: int):
        with WeightGradStore.capture(queue=[]) as queue:
            self.groups.append((label, queue))
            yield

    def run_one(self, before: Optional[int] = None) -> bool:
        """Run the oldest queued W (``before``: if its backward's label is lower); False when
        there is none to run."""
        while len(self.groups) > 1 and not self.groups[0][1]:
            self.groups.pop(0)  # (the last group's backward may still be appending)
        if not self.groups or not self.groups[0][1]:
            return False
        label, queue = self.groups[0]
        if before is not None and label >= before:
            return False
        start = time.perf_counter()
        queue.pop(0)()
        if self.on_run is not None:
            self.on_run(label, start, time.perf_counter())
        return True

    def flush(self, before: Optional[int] = None) -> None:
        """Run the queued W's (``before``: those of backwards labelled lower)."""
        while self.run_one(before):
            pass


class Pair:
    """Two sides (callables) run as coroutines on two threads: exactly one runs at a time, side 0
    first, and the running side hands over only inside ``switch`` (called by
    ``collectives.all_to_all_overlapped`` once its exchange is issued) or by ending. Both ranks
    of the EP group therefore issue their all-to-alls in one order, the same on every rank: the
    order the two sides reach them, alternating. The side that switches is always the one
    running, whichever thread it is on (on CUDA, autograd runs the backward's nodes on its
    device thread), so the pair needs no thread identities.

    ``fill`` (--delay-wgrad-compute): the deferred weight gradients (W) that ``fill_while`` runs
    where the running side would otherwise block on an exchange."""

    def __init__(self, on_resume: Optional[Callable[[int], None]] = None,
                 fill: Optional["WeightGradQueue"] = None):
        self.cond = threading.Condition()
        self.turn, self.done = 0, [False, False]
        self.on_resume = on_resume  # called with the side that runs again after a hand-over
        self.fill = fill

    def fill_while(self, work) -> None:
        """Run queued W's, first in first out, while ``work`` (an issued exchange of the running
        side, which has handed over and resumed) is still in flight: in the pair's tail, where
        no other side is left to compute, and wherever the other side's compute was shorter
        than the exchange. Only until it completes: a W run past that delays this rank's next
        exchange, which the peer ranks wait for (benchmarks/moe_overlap.py: running them all at
        the first wait of the tail exposes more than it hides)."""
        while self.fill is not None and not work.is_completed() and self.fill.run_one():
            pass

    def switch(self) -> None:
        with self.cond:
            me = self.turn
            if self.done[1 - me]:
                return  # the other side has ended: nothing to hand over to
            self.turn = 1 - me
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me)
        if self.on_resume is not None:
            self.on_resume(me)

    def run(self, side0: Callable, side1: Callable) -> None:
        errors: List[BaseException] = []

        def side(k: int, fn: Callable) -> None:
            with self.cond:
                self.cond.wait_for(lambda: self.turn == k)
            try:
                fn()
            except BaseException as e:  # re-raised on the caller's thread below
                errors.append(e)
            finally:
                with self.cond:
                    self.done[k], self.turn = True, 1 - k
                    self.cond.notify_all()

        other = threading.Thread(target=side, args=(1, side1), daemon=True)
        other.start()
        side(0, side0)
        other.join()
        if errors:
            raise errors[0]


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator, model,
                                   num_microbatches: int, seq_length: int = 0,
                                   micro_batch_size: int = 0, parallel_state=None,
                                   forward_only: bool = False,
                                   grad_scale_func: Optional[Callable] = None,
                                   no_sync_func: Optional[Callable] = None,
                                   finalize_model_grads_func: Optional[Callable] = None,
                                   timing_log_level: int = 0,
                                   overlap_moe_expert_parallel_comm: bool = False,
                                   delay_wgrad_compute: bool = False,
                                   **unused) -> List[dict]:
    """Gradient accumulation: run m micro-batches on one stage; DP sync only after the last.

    ``overlap_moe_expert_parallel_comm``: the combined 1F1B (docs/moe.md, "Hiding the
    all-to-alls"): F1, then the pairs (F(j+1), B(j)), then B(m); each pair's all-to-alls are in
    flight while the other micro-batch computes. The same ops on the same inputs in the same
    forward and backward orders: losses and gradients are bit for bit those without it.

    ``delay_wgrad_compute`` (with it): a pair's backward defers its experts' weight gradients
    (W) into a first-in-first-out queue; they run where a side would wait on an all-to-all
    (``Pair.fill_while``), in this pair or the next, and the rest before B(m), so every
    gradient accumulates in micro-batch order."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise ValueError("forward_backward_no_pipelining takes exactly one model chunk")
    module = chunks[0]
    no_sync = no_sync_func or contextlib.nullcontext
    m = num_microbatches
    stats_list: List[dict] = []
    timeline = StageTimeline("none", 0, 1, m) if timing_log_level >= 1 else None
    t0 = time.perf_counter()
    losses: Dict[int, torch.Tensor] = {}
    running = [0]  # the micro-batch whose side runs (what an all-to-all wait is charged to)

    def forward(j: int) -> None:
        running[0] = j
        start = time.perf_counter() - t0
        with torch.set_grad_enabled(not forward_only):
            output, loss_func = forward_step_func(data_iterator, module)
            loss, stats = loss_func(output)
            if grad_scale_func is not None and not forward_only:
                loss = grad_scale_func(loss)
        stats_list.append(stats)
        losses[j] = loss
        if timeline is not None:
            timeline.record("F", 0, j, start, time.perf_counter() - t0)

    def backward(j: int, deferred: bool = False) -> None:
        running[0] = j
        start = time.perf_counter() - t0
        with torch.set_grad_enabled(True), (
                wgrads.capture(j) if deferred else contextlib.nullcontext()):
            losses.pop(j).backward()
        if timeline is not None:
            timeline.record("B", 0, j, start, time.perf_counter() - t0)

    def a2a_wait(start: float, end: float, kind: str) -> None:
        # "A": blocked waiting for an all-to-all, "I": issuing one (collectives)
        timeline.record(kind, 0, running[0], start - t0, end - t0)

    def pair(j: int) -> None:  # F(j+1) and B(j), interleaved at their all-to-alls
        sides = (j + 1, j)  # side 0 the forward's micro-batch, side 1 the backward's
        # the running side is charged for the waits: track it at every hand-over
        p = Pair(on_resume=lambda side: running.__setitem__(0, sides[side]),
                 fill=wgrads if delay_wgrad_compute else None)
        C.set_overlap(p, a2a_wait if timeline is not None else None)
        try:
            p.run(lambda: forward(sides[0]), lambda: backward(sides[1], delay_wgrad_compute))
        finally:
            C.set_overlap(None, a2a_wait if timeline is not None else None)

    C.set_overlap(None, a2a_wait if timeline is not None else None)
    paired = overlap_moe_expert_parallel_comm and not forward_only and m > 1
    delay_wgrad_compute = delay_wgrad_compute and paired
    if delay_wgrad_compute:
        enable_expert_weight_grad_deferral(chunks)  # only the experts' (docs/moe.md)
    wgrads = WeightGradQueue(None if timeline is None else lambda j, start, end: timeline.record(
        "W", 0, j, start - t0, end - t0))
    try:
        with no_sync():
            if paired:
                forward(0)
                for j in range(m - 1):
                    pair(j)  # B(j)'s W's left over run in the next pair's waits,
                    wgrads.flush(before=j)  # older ones now: at most two backwards' W's held
                # before B(m) computes its experts' gradients inline, and the DP reduction
                # (outside no_sync) may start
                wgrads.flush()
            else:
                for j in range(m - 1):
                    forward(j)
                    if not forward_only:
                        backward(j)
        # outside no_sync: the DP reduction (or its hooks) may fire now
        if not paired:
            forward(m - 1)
        if not forward_only:
            backward(m - 1)
    finally:
        C.set_overlap(None, None)
    if timeline is not None:
        timeline.peak_in_flight = 2 if paired else 1
        set_last_timeline(timeline)
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(chunks)
    return stats_list


class ForwardBackwardFunc:
    """A schedule bound to its name; callable with the contract's kwargs."""

    def __init__(self, fn: Callable, schedule: Optional[str]):
        self.fn = fn
        self.schedule = schedule
        self.__name__ = f"forward_backward_{(schedule or 'no_pipelining').replace('-', '_')}"

    def __call__(self, **kwargs) -> List[dict]:
        if self.schedule is not None:
            kwargs.setdefault("schedule", self.schedule)
        return self.fn(**kwargs)

    @staticmethod
    def last_timeline() -> Optional[StageTimeline]:
        return last_timeline()

    def __repr__(self) -> str:
        return f"<{self.__name__}>"


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              schedule: Optional[str] = None) -> ForwardBackwardFunc:
    """``--pipeline-schedule`` (SCHEDULES); interleaved is implied when vpp > 1."""
    p, v = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    if p == 1:
        if v > 1:
            raise ConfigError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        return ForwardBackwardFunc(forward_backward_no_pipelining, None)
    schedule = check_pipeline_args(p, 2 * p, v, schedule)  # the name, default and v; m per call
    return ForwardBackwardFunc(forward_backward_pipelining, schedule)
