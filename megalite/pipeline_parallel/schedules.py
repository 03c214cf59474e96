"""Forward/backward schedules over micro-batches: no pipelining, 1F1B, interleaved 1F1B, ZB-H1.

THE SCHEDULE CONTRACT (the training loop and the tests rely on it)::

    forward_backward_func = get_forward_backward_func(pp_size, vpp_size, schedule)
    stats = forward_backward_func(
        forward_step_func=forward_step,   # (data_iterator, model) -> (output_tensor, loss_func)
        data_iterator=it,                 # see "Data" below
        model=[chunk, ...] or module,     # this pipeline rank's model chunks (build_model_chunks)
        num_microbatches=m,
        seq_length=s, micro_batch_size=b, # pipeline p2p shapes are known in advance
        parallel_state=ps,
        forward_only=False,
        grad_scale_func=None,             # loss -> scaled loss (fp16 loss scaling), last stage
        no_sync_func=None,                # context manager (or one per chunk): suppress DP sync
        finalize_model_grads_func=None,   # called once, with the chunk list, after the last W/B
        timing_log_level=0,               # optional: >= 1 records the F/B/W timeline of this step
    )
    timeline = forward_backward_func.last_timeline()   # StageTimeline of the last call, or None

``loss_func(output_tensor) -> (loss, stats)``: ``loss`` is the scalar to back-propagate (already
divided by the global batch's loss-token count, docs/design.md, contract 4), ``stats`` a dict of
floats or tensors that the caller sums over micro-batches (e.g. ``lm_loss_sum``, ``num_tokens``).
The schedule returns the list of ``stats`` of this rank's micro-batches, in micro-batch order
(empty on ranks that do not hold the last stage).

Data. ``data_iterator`` is either
  * ONE iterator (or None) per rank - the recommended form. The schedule calls ``next()`` on it
    exactly m times per step, in micro-batch order, on EVERY pipeline rank (so all ranks' iterators
    stay in step), caches micro-batch j, and calls ``forward_step_func(iter([batch_j]), chunk)``
    for each of this rank's chunks that runs micro-batch j. The first stage's chunk 0 uses the
    input ids, the last stage's last chunk the labels; middle chunks ignore the batch (GPTModel
    reads the received hidden states set by ``set_input_tensor``). If the iterator is None,
    ``forward_step_func`` receives None (it must then not need data on this rank).
  * a list of iterators, one per chunk (Megatron's interleaved convention): chunk c's
    ``forward_step_func`` gets ``data_iterator[c]`` itself and consumes it in its own order.

Timeline. With ``timing_log_level >= 1`` each stage records the start/end of every F, B and W
(pipeline_parallel/timeline.py); ``last_timeline()`` returns it, ``gather_timelines`` collects
all stages, ``bubble_stats`` gives measured bubble fractions, ``write_chrome_trace`` a trace.

The three pipelined schedules share one executor: a schedule is just the per-rank list of ops
(``schedule_order``), and the executor runs them with p2p between consecutive ops, by one of two
programs with the same op order: ``eager_program`` where sends and receives complete
independently (gloo: receives posted ahead, outputs sent at once, only receives waited), or the
``comm_units`` batches where they run in order on one stream (NCCL). docs/pipeline_parallel.md
"Point-to-point" gives the deadlock argument for each; tests/test_pipeline.py replays both.
The orders follow docs/theory.md, "Pipeline bubbles":
  * 1F1B: p-r-1 warm-up forwards on rank r, then one-forward-one-backward, then the cool-down
    backwards; at most p micro-batches in flight on stage 0 (GPipe would hold m).
  * interleaved 1F1B (v chunks per rank): 2(p-r-1)+(v-1)p warm-up forwards; micro-batches go
    through the chunks in groups of p, so m must be a multiple of p; bubble shrinks by v.
  * ZB-H1: 1F1B order of F and B, where B computes only input gradients (sent upstream at once)
    and weight gradients are deferred into W ops: W_j right after B_{j+g} on stage g, the last g
    after the final B. Same peak activations as 1F1B, bubble (p-1)(T_F+T_B-T_W).
"""

from __future__ import annotations

import bisect
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.autograd.variable import Variable

from megalite import collectives as C
from megalite.config import ConfigError
from megalite.parallel_state import synchronize
from megalite.pipeline_parallel.p2p import PipelineP2P, tensor_shape
from megalite.pipeline_parallel.timeline import StageTimeline
from megalite.tensor_parallel.layers import WeightGradStore

SCHEDULES = ("1f1b", "interleaved", "zb-h1")

_LAST_TIMELINE: Optional[StageTimeline] = None


def last_timeline() -> Optional[StageTimeline]:
    """The timeline recorded by the most recent schedule call in this process (or None)."""
    return _LAST_TIMELINE


def _as_list(model):
    return list(model) if isinstance(model, (list, tuple)) else [model]


# ----------------------------------------------------------------------------- op orders
@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" or "W"
    chunk: int
    microbatch: int
    steady: bool = field(default=False, compare=False)  # an F of the steady 1F1B phase

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch + 1}.{self.chunk}"


def check_pipeline_args(pp_size: int, num_microbatches: int, vpp_size: Optional[int] = None,
                        schedule: Optional[str] = None) -> str:
    """Validate (p, v, m, schedule); return the resolved schedule name. One-line ConfigErrors."""
    p, m, v = pp_size, num_microbatches, vpp_size or 1
    if schedule is None:
        schedule = "interleaved" if v > 1 else "1f1b"
    if schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got "
                          f"{schedule!r}")
    if v > 1 and schedule != "interleaved":
        raise ConfigError(f"--pipeline-schedule {schedule} does not support virtual stages "
                          f"(--num-layers-per-virtual-pipeline-stage gives v={v}); use interleaved")
    if schedule == "interleaved" and v == 1:
        raise ConfigError("--pipeline-schedule interleaved needs "
                          "--num-layers-per-virtual-pipeline-stage (v > 1 chunks per rank)")
    if p > 1 and m < p:
        raise ConfigError(f"the global batch gives {m} micro-batches per pipeline, fewer than "
                          f"--pipeline-model-parallel-size ({p}): raise --global-batch-size to at "
                          f"least {p} x --micro-batch-size x data-parallel size")
    if schedule == "interleaved" and m % p != 0:
        raise ConfigError(f"interleaved pipelining needs the number of micro-batches ({m}) to be a "
                          f"multiple of --pipeline-model-parallel-size ({p}); adjust "
                          f"--global-batch-size")
    return schedule


def order_1f1b(p: int, r: int, m: int) -> List[Op]:
    """Warm-up p-r-1 forwards, steady one-forward-one-backward, cool-down backwards."""
    warmup = min(p - r - 1, m)
    ops = [Op("F", 0, j) for j in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", 0, warmup + i), Op("B", 0, i)]
    ops += [Op("B", 0, j) for j in range(m - warmup, m)]
    return ops


def _interleaved_op(k: int, p: int, v: int, forward: bool) -> Op:
    """The k-th forward (or backward) of a rank: micro-batches go through chunks in groups of p."""
    group = k // p
    chunk = group % v if forward else v - 1 - group % v
    mb = (k // (p * v)) * p + k % p
    return Op("F" if forward else "B", chunk, mb)


def order_interleaved(p: int, r: int, m: int, v: int) -> List[Op]:
    """Interleaved 1F1B: 2(p-r-1)+(v-1)p warm-up forwards (docs/theory.md), 1F1B, cool-down."""
    total = m * v
    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    ops = [_interleaved_op(k, p, v, True) for k in range(warmup)]
    for i in range(total - warmup):
        f = _interleaved_op(warmup + i, p, v, True)
        ops += [Op("F", f.chunk, f.microbatch, steady=True), _interleaved_op(i, p, v, False)]
    ops += [_interleaved_op(k, p, v, False) for k in range(total - warmup, total)]
    return ops


def order_zb_h1(p: int, r: int, m: int) -> List[Op]:
    """ZB-H1 (Qi et al. 2024; docs/theory.md): the 1F1B order of F and B on stage g = r, with W_j
    right after B_{j+g} and the last g W's after the final B."""
    ops: List[Op] = []
    next_w = 0
    for op in order_1f1b(p, r, m):
        ops.append(op)
        if op.kind == "B" and op.microbatch - r >= 0:
            ops.append(Op("W", 0, op.microbatch - r))
            next_w = op.microbatch - r + 1
    ops += [Op("W", 0, j) for j in range(next_w, m)]
    return ops


def schedule_order(schedule: str, p: int, r: int, m: int, v: int = 1,
                   forward_only: bool = False) -> List[Op]:
    if schedule == "interleaved":
        ops = order_interleaved(p, r, m, v)
    elif schedule == "zb-h1":
        ops = order_zb_h1(p, r, m)
    elif schedule == "1f1b":
        ops = order_1f1b(p, r, m)
    else:
        raise ConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got "
                          f"{schedule!r}")
    if forward_only:
        ops = [op for op in ops if op.kind == "F"]
    return ops


def comm_units(ops: Sequence[Op], pair_f_with_b: bool) -> List[List[int]]:
    """Indices of ``ops`` grouped into units of compute with no p2p inside (W ops excluded).

    Communication happens between units: one batch carries the sends of the unit that just ran
    and the receives of the next one. A unit is one F or B, except in the steady phase of
    interleaved 1F1B, where a steady-phase F and the B right after it form one unit (Megatron's
    grouping; a warm-up F followed by a cool-down B stays alone):
    there a rank's warm-up is 2 ops longer than its successor's, and a batch after the F alone
    would wait on the neighbour's later batch while the neighbour waits on ours - a deadlock
    wherever a send waits for its receive (NCCL; gloo too).
    """
    units: List[List[int]] = []
    for i, op in enumerate(ops):
        if op.kind == "W":
            continue
        if (pair_f_with_b and units and op.kind == "B" and len(units[-1]) == 1
                and ops[units[-1][0]].steady):
            units[-1].append(i)
        else:
            units.append([i])
    return units


# Receives posted ahead of the op that needs them, in ops that need one (eager_program).
RECV_LOOKAHEAD = 2


def eager_program(ops: Sequence[Op], needs_recv: Sequence[bool], sends: Sequence[bool],
                  lookahead: int = RECV_LOOKAHEAD) -> List[tuple]:
    """The p2p program of one rank where every send and receive is an independent op (gloo).

    Steps, run in order: ``("recv", i)`` posts op i's receive, ``("wait", i)`` blocks until it has
    arrived, ``("run", i)`` computes op i, ``("send", i)`` posts op i's output and does not wait
    for it (sends are waited at the end of the step). The receives of the next ``lookahead`` ops
    that need one are posted before an op runs, so a neighbour's output moves while this rank is
    still busy, and each output leaves the moment it exists (a steady-phase F's no longer waits for
    the B after it, as in comm_units' batches).

    Why this cannot deadlock: a rank only ever blocks on a receive of its own next op, whose send
    is posted right after the neighbour computes it, and the neighbour never blocks on a send. So
    a rank waits only for ops that the schedule orders before its own, and the orders are
    dataflow-consistent (tests/test_pipeline.py replays every program under gloo's rules). Receives
    are posted in op order, so on each (peer, tag) channel they meet the sends in the same order.
    """
    need = [i for i, n in enumerate(needs_recv) if n]
    prog: List[tuple] = []
    posted = 0  # receives posted so far: need[:posted]
    for i in range(len(ops)):
        k = bisect.bisect_right(need, i) + lookahead - 1  # the lookahead-th later op needing one
        limit = need[k] if k < len(need) else len(ops)
        while posted < len(need) and need[posted] <= limit:
            prog.append(("recv", need[posted]))
            posted += 1
        if needs_recv[i]:
            prog.append(("wait", i))
        prog.append(("run", i))
        if sends[i]:
            prog.append(("send", i))
    return prog


# ----------------------------------------------------------------------------- helpers
def _free_output_data(t: torch.Tensor) -> None:
    """Drop the storage of a stage output once it has been sent, keeping its autograd node.

    The next stage has its own copy; this stage only needs the graph (and the gradient that will
    come back) for backward, so holding the [s, b, h] tensor too would cost one activation per
    in-flight micro-batch for nothing (Megatron's deallocate_output_tensor idea). Views are left
    alone: their storage belongs to another tensor.
    """
    if t is None or t._base is not None:
        return
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def _backward(output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """Backward through a stage whose output storage may have been freed.

    torch.autograd.backward checks grad.shape == output.shape, which a freed output (shape [1])
    fails, so the engine is called directly; the graph still knows the real shapes.
    """
    if grad is None:
        torch.autograd.backward(output)
        return
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


class _Feeder:
    """Hands each (chunk, micro-batch) its data per the contract's data convention."""

    def __init__(self, data_iterator, num_chunks: int, num_microbatches: int):
        self.per_chunk = isinstance(data_iterator, (list, tuple))
        if self.per_chunk and len(data_iterator) != num_chunks:
            raise ValueError(f"data_iterator is a list of {len(data_iterator)} iterators but this "
                             f"rank has {num_chunks} model chunks: pass one per chunk, or one")
        self.it = data_iterator
        self.num_chunks = num_chunks
        self.cache: Dict[int, object] = {}
        self.fetched = 0

    def get(self, chunk: int, mb: int):
        if self.per_chunk:
            return self.it[chunk]
        if self.it is None:
            return None
        while self.fetched <= mb:  # fetch in micro-batch order, each exactly once
            self.cache[self.fetched] = next(self.it)
            self.fetched += 1
        batch = self.cache[mb]
        if chunk == self.num_chunks - 1:  # the last chunk to run micro-batch mb on this rank
            del self.cache[mb]
        return iter([batch])


class _NoSync:
    """Enter the DP no-sync context(s) for the whole step and leave each just before the last op
    that produces gradients for its chunk(s), so that op's gradients may be reduced (or their
    reduction launched by DDP hooks) while the pipeline drains."""

    def __init__(self, no_sync_func, ops: Sequence[Op], num_chunks: int):
        grad_ops = [i for i, op in enumerate(ops) if op.kind in ("B", "W")]
        self.exit_at: Dict[int, List[contextlib.AbstractContextManager]] = {}
        self.open: List[contextlib.AbstractContextManager] = []
        if no_sync_func is None or not grad_ops:
            return
        if isinstance(no_sync_func, (list, tuple)):
            for c, fn in enumerate(no_sync_func):
                idx = [i for i in grad_ops if ops[i].chunk == c]
                if idx:
                    self._enter(fn, idx[-1])
        else:
            self._enter(no_sync_func, grad_ops[-1])

    def _enter(self, fn, exit_index: int) -> None:
        cm = fn()
        cm.__enter__()
        self.open.append(cm)
        self.exit_at.setdefault(exit_index, []).append(cm)

    def before(self, i: int) -> None:
        for cm in self.exit_at.pop(i, []):
            cm.__exit__(None, None, None)
            self.open.remove(cm)

    def close(self) -> None:
        for cm in self.open:
            cm.__exit__(None, None, None)
        self.open = []


# ----------------------------------------------------------------------------- p2p drivers
def _received(batch) -> Optional[torch.Tensor]:
    got = batch.wait() if batch is not None else {}
    return got.get("activation", got.get("gradient"))


def _drive_batched(ops, run, p2p, recvs_for, no_sync, forward_only, units) -> None:
    """One batch between consecutive compute units (comm_units), waited before the next unit:
    safe where a send waits for its receive and batches run in order (NCCL)."""
    unit_of = {i: u for u, idx in enumerate(units) for i in idx}

    def recvs_of(u: int) -> dict:
        kw = {}
        for i in units[u] if u < len(units) else []:
            kw.update({k: v for k, v in recvs_for(ops[i]).items() if v})
        return kw

    pending = [p2p.post(**recvs_of(0))]  # batches in flight; waited before the next unit
    sent_outputs: List[torch.Tensor] = []  # freed once the batch carrying them has completed
    received: dict = {}
    unit_sends: dict = {}

    def wait_pending() -> dict:
        got = {}
        for batch in pending:
            if batch is not None:
                got.update(batch.wait())
        pending.clear()
        for t in sent_outputs:
            _free_output_data(t)
        sent_outputs.clear()
        return got

    for i, op in enumerate(ops):
        no_sync.before(i)
        if op.kind != "W" and units[unit_of[i]][0] == i:
            received = wait_pending()  # this unit's inputs (activation and/or gradient)
        got = received.pop({"F": "activation", "B": "gradient"}.get(op.kind, ""), None)
        send = run(i, got)
        if send is not None:
            # sent with the unit's batch: after the B when F opens an (F, B) unit
            unit_sends[send[0]] = send[1]
        if op.kind != "W" and units[unit_of[i]][-1] == i:
            # the unit's sends and the next unit's receives, as one batch; W ops that follow
            # run while it is in flight
            pending.append(p2p.post(**unit_sends, **recvs_of(unit_of[i] + 1)))
            if "send_next" in unit_sends and not forward_only:
                sent_outputs.append(unit_sends["send_next"])
            unit_sends = {}
    wait_pending()


def _drive_eager(ops, run, p2p, recvs_for, no_sync, forward_only) -> None:
    """Independent sends and receives (gloo): eager_program's order; outputs leave at once."""
    needs = [any(recvs_for(op).values()) for op in ops]
    posted: Dict[int, object] = {}
    in_flight: list = []
    got = send = None
    for step, i in eager_program(ops, needs, [op.kind != "W" for op in ops]):
        if step == "recv":
            posted[i] = p2p.post(**{k: v for k, v in recvs_for(ops[i]).items() if v})
        elif step == "wait":
            got = _received(posted.pop(i))
        elif step == "run":
            no_sync.before(i)
            send, got = run(i, got), None
        elif step == "send" and send is not None:  # not waited: the receiver has posted, or
            # will post, its receive (eager_program), and nothing here depends on the send
            in_flight.append(p2p.post(**{send[0]: send[1]}))
            if send[0] == "send_next" and not forward_only:
                # the batch keeps the sent data alive (P2PBatch.sent) until it completes, so the
                # stage output itself can give its storage up now (see _free_output_data)
                _free_output_data(send[1])
            in_flight = [b for b in in_flight if not b.done()]
    for b in in_flight:
        b.wait()


# ----------------------------------------------------------------------------- the executor
def forward_backward_pipelining(*, forward_step_func: Callable, data_iterator, model,
                                num_microbatches: int, seq_length: int, micro_batch_size: int,
                                parallel_state, forward_only: bool = False,
                                grad_scale_func: Optional[Callable] = None,
                                no_sync_func=None,
                                finalize_model_grads_func: Optional[Callable] = None,
                                schedule: Optional[str] = None, timing_log_level: int = 0,
                                p2p_mode: Optional[str] = None, **unused) -> List[dict]:
    """Run this rank's part of a pipelined step (1F1B, interleaved or ZB-H1; see module doc).

    ``p2p_mode``: "eager" (independent sends/receives, eager_program) or "batched" (one batch
    between compute units, comm_units); None picks eager where the backend allows it (gloo) and
    batched elsewhere (NCCL). Both run the same ops in the same order.
    """
    global _LAST_TIMELINE
    ps = parallel_state
    chunks = _as_list(model)
    p, r, v, m = ps.pp_size, ps.pp_rank, len(chunks), num_microbatches
    schedule = check_pipeline_args(p, m, v, schedule)
    ops = schedule_order(schedule, p, r, m, v, forward_only)
    zero_bubble = schedule == "zb-h1" and not forward_only

    cfg = chunks[0].config
    shape = tensor_shape(seq_length, micro_batch_size, cfg.hidden_size, ps.tp_size,
                         cfg.sequence_parallel)
    param = next(chunks[0].parameters())
    p2p = PipelineP2P(ps, shape, param.dtype, param.device)
    feeder = _Feeder(data_iterator, v, m)
    no_sync = _NoSync(None if forward_only else no_sync_func, ops, v)

    def first_vstage(c: int) -> bool:  # chunk c of rank r is virtual stage c*p + r
        return c == 0 and r == 0

    def last_vstage(c: int) -> bool:
        return c == v - 1 and r == p - 1

    def recvs_for(op: Optional[Op]) -> dict:
        if op is None or op.kind == "W":
            return {}
        if op.kind == "F":
            return {"recv_prev": not first_vstage(op.chunk)}
        return {"recv_next": not last_vstage(op.chunk)}

    timing = timing_log_level >= 1
    timeline = StageTimeline(schedule, r, p, m, v) if timing else None
    if timing:
        synchronize(param.device)
        if ps.pp_group is not None:
            C.barrier(group=ps.pp_group)  # a common step start for all stages
    t0 = time.perf_counter()

    inputs: Dict[tuple, Optional[torch.Tensor]] = {}   # received activations (leaves)
    outputs: Dict[tuple, torch.Tensor] = {}            # stage outputs / losses, for backward
    weight_grads: Dict[tuple, list] = {}               # ZB-H1: deferred W closures per micro-batch
    stats_list: List[dict] = []
    peak = 0

    def run(i: int, received: Optional[torch.Tensor]) -> Optional[tuple]:
        """Compute ops[i] on its received activation / gradient; return (direction, tensor) to
        send, or None. Records the op in the timeline."""
        nonlocal peak
        op = ops[i]
        key = (op.chunk, op.microbatch)
        send = None
        if timing:
            synchronize(param.device)
            start = time.perf_counter() - t0
        if op.kind == "F":
            inp = received
            if inp is not None:
                inp.requires_grad_(not forward_only)
            chunk = chunks[op.chunk]
            chunk.set_input_tensor(inp)
            with torch.set_grad_enabled(not forward_only):
                out, loss_func = forward_step_func(feeder.get(op.chunk, op.microbatch), chunk)
                if last_vstage(op.chunk):
                    loss, stats = loss_func(out)
                    stats_list.append(stats)
                    if grad_scale_func is not None and not forward_only:
                        loss = grad_scale_func(loss)
                    out = loss
            chunk.set_input_tensor(None)
            if not last_vstage(op.chunk):
                send = ("send_next", out)
            if not forward_only:
                inputs[key], outputs[key] = inp, out
                peak = max(peak, len(outputs))
        elif op.kind == "B":
            inp, out = inputs.pop(key), outputs.pop(key)
            if zero_bubble:
                with WeightGradStore.capture() as queue:
                    _backward(out, received)
                weight_grads[key] = list(queue)
            else:
                _backward(out, received)
            if not first_vstage(op.chunk):
                send = ("send_prev", inp.grad)
        else:  # W: the deferred weight-gradient GEMMs of one micro-batch
            for fn in weight_grads.pop(key):
                fn()
        if timing:
            synchronize(param.device)
            timeline.record(op.kind, op.chunk, op.microbatch, start, time.perf_counter() - t0)
        return send

    try:
        if p2p_mode not in (None, "eager", "batched"):
            raise ValueError(f"p2p_mode must be 'eager' or 'batched', got {p2p_mode!r}")
        if p2p_mode == "eager" and not p2p.independent_ops:
            raise ValueError("p2p_mode='eager' needs a backend whose p2p ops complete "
                             "independently (gloo)")
        if (p2p_mode or ("eager" if p2p.independent_ops else "batched")) == "eager":
            _drive_eager(ops, run, p2p, recvs_for, no_sync, forward_only)
        else:
            _drive_batched(ops, run, p2p, recvs_for, no_sync, forward_only,
                           comm_units(ops, schedule == "interleaved" and not forward_only))
    finally:
        no_sync.close()
    assert not outputs and not weight_grads or forward_only, "schedule left work undone"

    if timing:
        timeline.peak_in_flight = peak
        _LAST_TIMELINE = timeline
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(chunks)
    return stats_list


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator, model,
                                   num_microbatches: int, seq_length: int = 0,
                                   micro_batch_size: int = 0, parallel_state=None,
                                   forward_only: bool = False,
                                   grad_scale_func: Optional[Callable] = None,
                                   no_sync_func: Optional[Callable] = None,
                                   finalize_model_grads_func: Optional[Callable] = None,
                                   timing_log_level: int = 0,
                                   **unused) -> List[dict]:
    """Gradient accumulation: run m micro-batches on one stage; DP sync only after the last."""
    global _LAST_TIMELINE
    chunks = _as_list(model)
    if len(chunks) != 1:
        raise ValueError("forward_backward_no_pipelining takes exactly one model chunk")
    module = chunks[0]
    no_sync = no_sync_func or contextlib.nullcontext
    stats_list: List[dict] = []
    timeline = StageTimeline("none", 0, 1, num_microbatches) if timing_log_level >= 1 else None
    t0 = time.perf_counter()

    def one(j: int) -> None:
        start = time.perf_counter() - t0
        with torch.set_grad_enabled(not forward_only):
            output, loss_func = forward_step_func(data_iterator, module)
            loss, stats = loss_func(output)
        stats_list.append(stats)
        if timeline is not None:
            mid = time.perf_counter() - t0
            timeline.record("F", 0, j, start, mid)
        if not forward_only:
            if grad_scale_func is not None:
                loss = grad_scale_func(loss)
            loss.backward()
            if timeline is not None:
                timeline.record("B", 0, j, mid, time.perf_counter() - t0)

    with no_sync():
        for j in range(num_microbatches - 1):
            one(j)
    one(num_microbatches - 1)  # outside no_sync: the DP reduction (or its hooks) may fire now
    if timeline is not None:
        timeline.peak_in_flight = 1
        _LAST_TIMELINE = timeline
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
    """``--pipeline-schedule {1f1b,interleaved,zb-h1}``; interleaved is implied when vpp > 1."""
    p, v = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    if p == 1:
        if v > 1:
            raise ConfigError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        return ForwardBackwardFunc(forward_backward_no_pipelining, None)
    if schedule is None:
        schedule = "interleaved" if v > 1 else "1f1b"
    check_pipeline_args(p, p, v, schedule)  # validates the schedule name; m is checked per call
    return ForwardBackwardFunc(forward_backward_pipelining, schedule)
