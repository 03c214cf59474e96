"""Each pipeline rank's op order (``schedule_order``) and p2p program (``p2p_program``):
docs/pipeline_parallel.md, "The schedules" and "Point-to-point"."""

from __future__ import annotations

import bisect
import functools
from collections import Counter, deque
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megalite.config import SCHEDULES, V_SCHEDULES
from megalite.pipeline_parallel.partition import stage_rank, virtual_stage


# ----------------------------------------------------------------------------- op orders
@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" or "W"
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch + 1}.{self.chunk}"


def order_1f1b(p: int, r: int, m: int, extra_warmup: int = 0) -> List[Op]:
    """Warm-up p-r-1 (+ ``extra_warmup``) forwards, steady 1F1B, cool-down backwards."""
    warmup = min(p - r - 1 + extra_warmup, m)
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


def order_interleaved(p: int, r: int, m: int, v: int, extra_warmup: int = 0) -> List[Op]:
    """Interleaved 1F1B: 2(p-r-1)+(v-1)p warm-up forwards, then 1F1B, then cool-down."""
    total = m * v
    warmup = min(2 * (p - r - 1) + (v - 1) * p + extra_warmup, total)
    ops = [_interleaved_op(k, p, v, True) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [_interleaved_op(warmup + i, p, v, True), _interleaved_op(i, p, v, False)]
    ops += [_interleaved_op(k, p, v, False) for k in range(total - warmup, total)]
    return ops


def order_zb_h1(p: int, r: int, m: int, extra_warmup: int = 0) -> List[Op]:
    """ZB-H1 (Qi et al. 2024): 1F1B's F and B on stage r, W_j right after B_{j+r}."""
    ops: List[Op] = []
    next_w = 0
    for op in order_1f1b(p, r, m, extra_warmup):
        ops.append(op)
        if op.kind == "B" and op.microbatch - r >= 0:
            ops.append(Op("W", 0, op.microbatch - r))
            next_w = op.microbatch - r + 1
    ops += [Op("W", 0, j) for j in range(next_w, m)]
    return ops


def _phases(*phases: Tuple[int, str]) -> List[Op]:
    """Ops from ``(repeat, pattern)`` phases of the V schedules. Tokens: ``F0``/``F1`` forward of
    chunk 0/1, ``B0``/``B1`` full backward, ``I0``/``I1`` backward of the input gradient only (its
    W deferred), ``W`` the oldest deferred W (none pending: nothing). Each chunk takes its
    micro-batches in order, so a token needs no number."""
    ops: List[Op] = []
    taken, deferred = Counter(), deque()
    for repeat, pattern in phases:
        for _ in range(max(repeat, 0)):
            for tok in pattern.split():
                if tok == "W":
                    if deferred:
                        ops.append(Op("W", *deferred.popleft()))
                    continue
                kind, c = ("F" if tok[0] == "F" else "B"), int(tok[1])
                ops.append(Op(kind, c, taken[kind, c]))
                if tok[0] == "I":
                    deferred.append((c, taken[kind, c]))
                taken[kind, c] += 1
    assert not deferred, "a V schedule left a W undone"
    return ops


def order_zb_v(p: int, r: int, m: int) -> List[Op]:
    """ZB-V (Qi et al. 2024, section 6): docs/pipeline_parallel.md, "ZB-V and DualPipeV"."""
    return _phases((2 * (p - r) - 1, "F0"), (r, "F1 F0"), (p - r, "F1 I1 W"),
                   (m - 2 * p + r + 1, "F0 I0 W F1 I1 W"), (p - r - 1, "I0 W F1 I1 W"),
                   (r, "I0 I1"), (p - r, "I0 W"), (2 * r, "W"))


def order_dualpipev(p: int, r: int, m: int) -> List[Op]:
    """DualPipeV (DeepSeek-V3's DualPipe on a V): docs/pipeline_parallel.md, "ZB-V and
    DualPipeV"."""
    h = (r + 1) // 2
    return _phases((2 * (p - r - 1), "F0"), (r + 1, "F0 F1"), (p - r - 1, "I1 W F1"),
                   (m - 2 * p + r + 1, "F0 B1 F1 B0"), (p - r - 1, "B1 F1 B0"),
                   (h, "B1 B0"), (1, "I1 I0" if r % 2 else "B1 I0"), (r - h, "I1 I0"),
                   (p - r - 1, "W I0"), (r + 1, "W"))


def schedule_order(schedule: str, p: int, r: int, m: int, v: int = 1,
                   forward_only: bool = False, paired: bool = False) -> List[Op]:
    """Rank r's ops. ``paired``: the F&B pairs' order, one more warm-up forward in the 1F1B
    family (docs/pipeline_parallel.md, "MoE: F&B pairs")."""
    extra = 1 if paired and not forward_only else 0
    orders = {"1f1b": lambda: order_1f1b(p, r, m, extra),
              "zb-h1": lambda: order_zb_h1(p, r, m, extra),
              "interleaved": lambda: order_interleaved(p, r, m, v, extra),
              "zb-v": lambda: order_zb_v(p, r, m), "dualpipev": lambda: order_dualpipev(p, r, m)}
    if schedule not in orders:
        raise ValueError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got "
                          f"{schedule!r}")
    ops = orders[schedule]()
    return [op for op in ops if op.kind == "F"] if forward_only else ops


def op_peers(op: Op, schedule: str, p: int, r: int, v: int) -> Tuple[Optional[int], Optional[int]]:
    """(pipeline rank op's input comes from, rank its output goes to); None at the pipeline's
    ends and for W. Equal to ``r`` where the V turns on rank p-1 (a hand-over inside the rank)."""
    if op.kind == "W":
        return None, None
    v_shape = schedule in V_SCHEDULES
    vs, last = virtual_stage(p, r, op.chunk, v, v_shape), p * v - 1
    up, down = (vs - 1, vs + 1) if op.kind == "F" else (vs + 1, vs - 1)
    return tuple(stage_rank(p, x, v, v_shape) if 0 <= x <= last else None for x in (up, down))


# ----------------------------------------------------------------------------- p2p programs
# A p2p program: one rank's steps ("run", i), ("pair", i, k), ("post", b, sends, recvs) and
# ("wait", b) (docs/pipeline_parallel.md, "Point-to-point"); unwaited sends wait at step end.
RECV_LOOKAHEAD = 2  # eager: receives posted this many input-needing ops ahead


def eager_program(needs_recv: Sequence[bool], sends: Sequence[bool],
                  lookahead: int = RECV_LOOKAHEAD,
                  units: Optional[Sequence[tuple]] = None) -> List[tuple]:
    """Every send and receive its own batch (gloo; docs/pipeline_parallel.md, "Point-to-point"):
    receives posted ``lookahead`` input-needing ops ahead, outputs sent at once, never waited.
    ``units`` (``paired_units``): a pair waits for both inputs, then sends both outputs."""
    need = [i for i, n in enumerate(needs_recv) if n]
    prog: List[tuple] = []
    batch_of = {}
    for unit in units or [(i,) for i in range(len(needs_recv))]:
        k = bisect.bisect_right(need, unit[-1]) + lookahead - 1  # lookahead-th later needing one
        limit = need[k] if k < len(need) else len(needs_recv)
        for j in need[len(batch_of):bisect.bisect_right(need, limit)]:
            batch_of[j] = len(prog)
            prog.append(("post", len(prog), (), (j,)))
        prog += [("wait", batch_of[i]) for i in unit if needs_recv[i]]
        prog.append(_run_step(unit))
        prog += [("post", len(prog) + n, (i,), ()) for n, i in enumerate(
            [i for i in unit if sends[i]])]
    return prog


def _source(schedule: str, p: int, q: int, v: int, op: Op):
    """(kind, virtual stage, micro-batch) of the op whose output feeds ``op`` on rank q."""
    vs = virtual_stage(p, q, op.chunk, v, schedule in V_SCHEDULES)
    up = vs - 1 if op.kind == "F" else vs + 1
    return (op.kind, up, op.microbatch) if op.kind != "W" and 0 <= up < p * v else None


def _lockstep(schedule: str, p: int, v: int, orders, units):
    """Every rank's units (tuples of op indices run as one step) run together in lockstep, a
    unit once every input of it was produced at an earlier step -> (ran_at: (kind, virtual
    stage, micro-batch) -> step, steps: per rank the step each unit ran at), or (None, the
    (rank, unit) pairs still waiting) when none can run."""
    v_shape = schedule in V_SCHEDULES
    ran_at: Dict[tuple, int] = {}
    steps: List[List[int]] = [[] for _ in range(p)]
    t = 0
    while any(len(steps[q]) < len(units[q]) for q in range(p)):
        ran = [q for q in range(p) if len(steps[q]) < len(units[q]) and all(
            src is None or ran_at.get(src, t) < t
            for src in (_source(schedule, p, q, v, orders[q][i]) for i in units[q][len(steps[q])]))]
        if not ran:
            return None, [(q, len(steps[q])) for q in range(p) if len(steps[q]) < len(units[q])]
        for q in ran:
            for i in units[q][len(steps[q])]:
                op = orders[q][i]
                ran_at[op.kind, virtual_stage(p, q, op.chunk, v, v_shape), op.microbatch] = t
            steps[q].append(t)
        t += 1
    return ran_at, steps


# ----------------------------------------------------------------------------- F&B pairs
@functools.lru_cache(maxsize=64)
def paired_units(schedule: str, p: int, m: int, v: int = 1) -> Tuple[Tuple[tuple, ...], ...]:
    """Per rank, the steps of ``schedule_order(..., paired=True)``: ``(i,)`` an op alone,
    ``(i, i+1)`` an F&B pair; pairs tied in a knot are split (docs/pipeline_parallel.md,
    "MoE: F&B pairs")."""
    orders = [schedule_order(schedule, p, q, m, v, paired=True) for q in range(p)]
    units = []
    for ops in orders:
        mine, i = [], 0
        while i < len(ops):
            pair = (i + 1 < len(ops) and ops[i].kind == "F" and ops[i + 1].kind == "B"
                    and ops[i].microbatch != ops[i + 1].microbatch)
            mine.append((i, i + 1) if pair else (i,))
            i += 2 if pair else 1
        units.append(mine)
    while True:
        ran_at, waiting = _lockstep(schedule, p, v, orders, units)
        if ran_at is not None:
            return tuple(tuple(u) for u in units)
        knotted = [(q, u) for q, u in waiting if len(units[q][u]) == 2]
        assert knotted, f"{schedule}: the orders of p={p} m={m} wait on each other"
        for q, u in knotted:
            i, k = units[q][u]
            units[q][u:u + 1] = [(i,), (k,)]


def lockstep_program(schedule: str, p: int, r: int, m: int, v: int = 1,
                     forward_only: bool = False, paired: bool = False) -> List[tuple]:
    """The batched program (NCCL): batch t carries exactly the messages of the lockstep run's
    step t (docs/pipeline_parallel.md, "Point-to-point"), waited before the first op needing it."""
    orders = [schedule_order(schedule, p, q, m, v, forward_only, paired) for q in range(p)]
    units = (paired_units(schedule, p, m, v) if paired
             else [[(i,) for i in range(len(o))] for o in orders])
    ran_at, steps = _lockstep(schedule, p, v, orders, units)
    assert ran_at is not None, f"{schedule}: the orders of p={p} m={m} wait on each other"

    ops = orders[r]
    peers = [op_peers(op, schedule, p, r, v) for op in ops]
    batch_of = {i: ran_at[_source(schedule, p, r, v, op)] for i, op in enumerate(ops)
                if peers[i][0] not in (None, r)}  # the step its input was sent at
    recvs_at: Dict[int, List[int]] = {}
    for i, b in batch_of.items():
        recvs_at.setdefault(b, []).append(i)
    mine = dict(zip(steps[r], units[r]))  # step -> the unit rank r ran
    prog: List[tuple] = []
    waited = set()
    for step in range(max(s[-1] for s in steps if s) + 1):
        unit = mine.get(step, ())
        for i in unit:
            if i in batch_of and batch_of[i] not in waited:
                waited.add(batch_of[i])
                prog.append(("wait", batch_of[i]))
        if unit:
            prog.append(_run_step(unit))
        sends = tuple(i for i in unit if peers[i][1] not in (None, r))
        if sends or step in recvs_at:
            prog.append(("post", step, sends, tuple(recvs_at.get(step, ()))))
    return prog


def _run_step(unit: tuple) -> tuple:
    return ("run", unit[0]) if len(unit) == 1 else ("pair", *unit)


@functools.lru_cache(maxsize=64)  # a step asks for the same (schedule, p, r, m, v) each time
def p2p_program(mode: str, schedule: str, p: int, r: int, m: int, v: int = 1,
                forward_only: bool = False, paired: bool = False) -> Tuple[tuple, ...]:
    """Rank ``r``'s "batched" program (any backend, NCCL's only) or "eager" one (gloo)."""
    paired = paired and not forward_only
    if mode == "eager":
        ops = schedule_order(schedule, p, r, m, v, forward_only, paired)
        peers = [op_peers(op, schedule, p, r, v) for op in ops]
        return tuple(eager_program([src not in (None, r) for src, _ in peers],
                                   [dst not in (None, r) for _, dst in peers],
                                   units=paired_units(schedule, p, m, v)[r] if paired else None))
    if mode == "batched":
        return tuple(lockstep_program(schedule, p, r, m, v, forward_only, paired))
    raise ValueError(f"p2p_mode must be 'eager' or 'batched', got {mode!r}")
