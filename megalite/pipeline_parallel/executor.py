"""The pipeline executor: runs one rank's op list with the p2p program that suits its backend
(schedules.py), at every PP (PP 1 is the 1F1B program of one stage).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import torch

from megalite import collective_record as R
from megalite import collectives as C
from megalite import torch_private as P
from megalite.config import V_SCHEDULES, check_pipeline_args
from megalite.moe.layer import enable_expert_weight_grad_deferral
from megalite.overlap import Clock, Pair, WeightGradStore, overlapping
from megalite.parallel_state import synchronize
from megalite.pipeline_parallel.p2p import (
    TAG_ACTIVATION, TAG_GRADIENT, PipelineP2P, tensor_shape)
from megalite.pipeline_parallel.partition import virtual_stage
from megalite.pipeline_parallel.schedules import Op, op_peers, p2p_program, schedule_order
from megalite.pipeline_parallel.timeline import StageTimeline
from megalite.tensor_parallel.layers import enable_weight_grad_deferral


def _free_output_data(t: torch.Tensor) -> None:
    """Drop a sent stage output's storage, keeping its autograd node (Megatron's
    deallocate_output_tensor; docs/pipeline_parallel.md). Views own no storage: left alone."""
    if not P.is_view(t):
        t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def _backward(output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """Backward through a stage whose output storage may have been freed: the engine is called
    directly, since torch.autograd.backward checks grad.shape against the freed output's [1]."""
    if grad is None:
        torch.autograd.backward(output)
        return
    P.backward_unchecked(output, grad)


class PipelineExecutor:
    """One rank's part of one step, at every PP (PP 1 runs the 1F1B program of one stage). Ops are
    indices into ``self.ops``; ``inbox[i]`` is op i's input (activation for F, output gradient for
    B) and ``outbox[i]`` its output until sent. ``clock``: record a timeline with it."""

    def __init__(self, schedule: str, chunks: list, p: int, r: int, m: int, forward_only: bool,
                 forward_step_func: Callable, data_iterator, grad_scale_func, no_sync_func,
                 p2p: Optional[PipelineP2P], clock: Optional[Clock], paired: bool = False,
                 delay_wgrad: bool = False):
        self.chunks, self.p2p, self.forward_only = chunks, p2p, forward_only
        self.forward_step_func, self.grad_scale_func = forward_step_func, grad_scale_func
        v = len(chunks)
        self.r = r
        self.ops = schedule_order(schedule, p, r, m, v, forward_only, paired)
        self.peers = [op_peers(op, schedule, p, r, v) for op in self.ops]
        self.index = {(op.kind, op.chunk, op.microbatch): i for i, op in enumerate(self.ops)}
        vs = [virtual_stage(p, r, c, v, schedule in V_SCHEDULES) for c in range(v)]
        self.first = [s == 0 for s in vs]  # chunk c takes the input ids
        self.last = [s == p * v - 1 for s in vs]  # chunk c computes the loss
        self.data = _Feeder(data_iterator, v, m)
        self.no_sync = _NoSync(None if forward_only else no_sync_func, self.ops)
        self.inbox: Dict[int, Optional[torch.Tensor]] = {}
        self.outbox: Dict[int, torch.Tensor] = {}
        self.saved: Dict[tuple, tuple] = {}  # (chunk, mb) -> (input, output) awaiting B
        self.weight_grads: Dict[tuple, list] = {}  # (chunk, mb) -> W closures awaiting W
        self.batches: Dict[int, object] = {}
        self.stats: List[dict] = []
        self.clock, self.timeline, self.a2a_recorder = clock, None, None
        self.running: Optional[Op] = None  # the op an all-to-all wait is charged to
        if clock is not None:
            self.timeline = StageTimeline(schedule if p > 1 else "none", r, p, m, v)
            self.timeline.clock = clock
            self.a2a_recorder = self._record_running
        # the step's deferred weight gradients: zero-bubble W ops' and (--delay-wgrad-compute)
        # the pairs' expert W's, run so that gradients accumulate in micro-batch order (moe.md)
        self.store = WeightGradStore(self._record_w, clock)
        self.deferred_w = {(op.chunk, op.microbatch) for op in self.ops if op.kind == "W"}
        if self.deferred_w:
            enable_weight_grad_deferral(chunks, self.store)  # linears B can defer
        self.delay = paired and delay_wgrad
        if self.delay:
            enable_expert_weight_grad_deferral(chunks, self.store)  # only the experts' (moe.md)

    # ---------------------------------------------------------------- the program's three steps
    def post(self, b: int, sends, recvs) -> None:
        def tag(i):
            return TAG_ACTIVATION if self.ops[i].kind == "F" else TAG_GRADIENT
        outs = [(i, self.outbox.pop(i)) for i in sends]
        with R.label("p2p of " + " ".join(str(self.ops[i]) for i in sends + recvs)):
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
        if self.delay and self.ops[i].kind != "F":
            self.store.flush()
        self.no_sync.before(i)
        start = self._mark()
        out = self._compute(i)
        self._record(self.ops[i].kind, self.ops[i], start)
        self._deliver(i, out)

    def pair(self, i: int, k: int) -> None:
        """The forward ops[i] and the backward ops[k] as the sides of a ``Pair``
        (docs/pipeline_parallel.md, "MoE: F&B pairs")."""
        for j in (i, k):
            self.no_sync.before(j)
        outs, sides = {}, (i, k)

        def side(j: int) -> None:
            start = self._mark()
            key = (self.ops[j].chunk, self.ops[j].microbatch)
            queued = self.delay and self.ops[j].kind == "B" \
                and key not in self.deferred_w  # (a B with a W op of its own defers into it)
            with self.store.capture(j) if queued else contextlib.nullcontext():
                outs[j] = self._compute(j)
            self._record(self.ops[j].kind, self.ops[j], start)

        pair = Pair([str(self.ops[j]) for j in sides],
                    on_resume=lambda s: setattr(self, "running", self.ops[sides[s]]),
                    fill=self.store if self.delay else None)
        with overlapping(pair, self.clock, self.a2a_recorder):
            pair.run(lambda: side(i), lambda: side(k))
        if self.delay:  # older backwards' W's now: at most two backwards' held
            self.store.flush(before=k)
        for j in sides:
            self._deliver(j, outs[j])

    def _mark(self):
        return None if self.clock is None else self.clock.mark()

    def _record(self, kind: str, op: Op, start, end=None) -> None:
        """An interval of ``op`` between clock marks (``end`` None: now): its span, or one inside
        it (a queued W; an all-to-all's "A" waiting or "I" issuing, overlap.exchange)."""
        if self.timeline is not None:
            self.timeline.record(kind, op.chunk, op.microbatch, start,
                                 self.clock.mark() if end is None else end)

    def _record_running(self, kind: str, start, end) -> None:  # overlap.exchange's recorder
        self._record(kind, self.running, start, end)

    def _record_w(self, i: int, start, end) -> None:  # the store's: a W queued by op i
        self._record("W", self.ops[i], start, end)

    def _compute(self, i: int):
        op = self.running = self.ops[i]
        compute = {"F": self.forward, "B": self.backward, "W": self.weight}[op.kind]
        with R.label(f"{compute.__name__} micro-batch {op.microbatch + 1} (op {op})"):
            return compute(op, self.inbox.pop(i, None))

    def _deliver(self, i: int, out) -> None:
        op, dst = self.ops[i], self.peers[i][1]
        if dst == self.r:  # the V turns inside this rank: hand the output to its consumer
            nxt = Op(op.kind, 1 - op.chunk, op.microbatch)
            self.inbox[self.index[nxt.kind, nxt.chunk, nxt.microbatch]] = out.detach()
        elif dst is not None:
            self.outbox[i] = out

    # ---------------------------------------------------------------- F, B and W
    def forward(self, op: Op, inp: Optional[torch.Tensor]) -> torch.Tensor:
        if inp is not None:
            inp.requires_grad_(not self.forward_only)
        if self.timeline is not None and not self.forward_only:
            # in flight from its start: a pair's backward may end before its forward does
            self.timeline.peak_in_flight = max(self.timeline.peak_in_flight, len(self.saved) + 1)
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
        return out

    def backward(self, op: Op, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        key = (op.chunk, op.microbatch)
        inp, out = self.saved.pop(key)
        if key in self.deferred_w:  # B computes the input gradient; a W op the weights' later
            with self.store.capture() as queue:
                _backward(out, grad)
            self.weight_grads[key] = list(queue)
        else:
            _backward(out, grad)
        return None if self.first[op.chunk] else inp.grad

    def weight(self, op: Op, _unused) -> None:
        for fn in self.weight_grads.pop((op.chunk, op.microbatch)):
            fn()

    def execute(self, program) -> List[dict]:
        try:
            with overlapping(None, self.clock, self.a2a_recorder):
                for step, *args in program:
                    getattr(self, step)(*args)
                self.store.flush()
            for recvs, batch in self.batches.values():
                if batch is not None:
                    batch.wait()
        finally:
            self.no_sync.close()
        assert self.forward_only or not (self.saved or self.weight_grads), "work left undone"
        return self.stats


def _chunks_of(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _run(schedule: str, chunks: list, p: int, r: int, mode: str, p2p, device, *,
         forward_step_func: Callable, data_iterator, num_microbatches: int,
         forward_only: bool = False, grad_scale_func: Optional[Callable] = None,
         no_sync_func=None, finalize_model_grads_func: Optional[Callable] = None,
         timing_log_level: int = 0, overlap_moe_expert_parallel_comm: bool = False,
         delay_wgrad_compute: bool = False, on_timeline: Optional[Callable] = None,
         **unused) -> List[dict]:
    """The one runner of a step's program, at every PP; the F&B pairs and the delayed W's:
    docs/pipeline_parallel.md, "MoE: F&B pairs". ``on_timeline`` receives the step's timeline."""
    m = num_microbatches
    paired = overlap_moe_expert_parallel_comm and not forward_only
    clock = Clock(device) if timing_log_level >= 1 else None
    ex = PipelineExecutor(schedule, chunks, p, r, m, forward_only, forward_step_func,
                          data_iterator, grad_scale_func, no_sync_func, p2p, clock, paired,
                          delay_wgrad_compute)
    stats = ex.execute(p2p_program(mode, schedule, p, r, m, len(chunks), forward_only, paired))
    if ex.timeline is not None and on_timeline is not None:
        on_timeline(ex.timeline)
    if not forward_only and finalize_model_grads_func is not None:
        with R.label("gradient sync"):
            finalize_model_grads_func(chunks)
    return stats


def forward_backward_pipelining(*, model, parallel_state, num_microbatches: int,
                                seq_length: int, micro_batch_size: int,
                                schedule: Optional[str] = None, timing_log_level: int = 0,
                                p2p_mode: Optional[str] = None, **kwargs) -> List[dict]:
    """This rank's part of a pipelined step (docs/pipeline_parallel.md, "API for the training
    loop"). ``p2p_mode``: "eager" or "batched"; None: eager on gloo, batched elsewhere."""
    ps = parallel_state
    chunks = _chunks_of(model)
    schedule = check_pipeline_args(ps.pp_size, num_microbatches, len(chunks), schedule)
    cfg, param = chunks[0].config, next(chunks[0].parameters())
    p2p = PipelineP2P(ps, tensor_shape(seq_length, micro_batch_size, cfg.hidden_size, ps.tp_size,
                                       chunks[0].sequence_parallel), param.dtype, param.device)
    mode = p2p_mode or ("eager" if p2p.independent_ops else "batched")
    if mode == "eager" and not p2p.independent_ops:
        raise ValueError("p2p_mode='eager' needs a backend whose p2p ops complete "
                         "independently (gloo)")
    if timing_log_level >= 1:
        synchronize(param.device)
        if ps.pp_group is not None:
            C.barrier(group=ps.pp_group)  # a common step start for all stages
    return _run(schedule, chunks, ps.pp_size, ps.pp_rank, mode, p2p, param.device,
                num_microbatches=num_microbatches, timing_log_level=timing_log_level, **kwargs)


def forward_backward_no_pipelining(*, model, **kwargs) -> List[dict]:
    """Gradient accumulation: the 1F1B program of one stage, DP sync only after the last
    micro-batch (docs/moe.md, "Hiding the all-to-alls", for its F&B pairs)."""
    chunks = _chunks_of(model)
    if len(chunks) != 1:
        raise ValueError("forward_backward_no_pipelining takes exactly one model chunk")
    device = next(chunks[0].parameters()).device
    return _run("1f1b", chunks, 1, 0, "eager", None, device, **kwargs)


class ForwardBackwardFunc:
    """A schedule bound to its name; callable with the contract's kwargs. It keeps the timeline
    of its last call that recorded one (``timing_log_level`` >= 1)."""

    def __init__(self, fn: Callable, schedule: Optional[str]):
        self.fn = fn
        self.schedule = schedule
        self.__name__ = f"forward_backward_{(schedule or 'no_pipelining').replace('-', '_')}"
        self._timeline: Optional[StageTimeline] = None

    def __call__(self, **kwargs) -> List[dict]:
        if self.schedule is not None:
            kwargs.setdefault("schedule", self.schedule)
        self._timeline = None
        return self.fn(on_timeline=lambda t: setattr(self, "_timeline", t), **kwargs)

    def last_timeline(self) -> Optional[StageTimeline]:
        """The last recorded timeline, its clock marks resolved now (once)."""
        return None if self._timeline is None else self._timeline.resolve()

    def __repr__(self) -> str:
        return f"<{self.__name__}>"


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              schedule: Optional[str] = None) -> ForwardBackwardFunc:
    """``--pipeline-schedule`` (SCHEDULES); interleaved is implied when vpp > 1."""
    p, v = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    if p == 1:
        if v > 1:
            raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        return ForwardBackwardFunc(forward_backward_no_pipelining, None)
    schedule = check_pipeline_args(p, 2 * p, v, schedule)  # the name, default and v; m per call
    return ForwardBackwardFunc(forward_backward_pipelining, schedule)


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
