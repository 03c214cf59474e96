"""What each pipeline stage did during one step, from which the bubble is measured: ops and MoE
all-to-all waits in seconds from the barrier-aligned step start (docs/design.md, contract 10)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from megalite import collectives as C
from megalite.config import V_SCHEDULES


@dataclass
class OpEvent:
    kind: str  # "F", "B" (input grad; full backward outside ZB) or "W" (deferred weight grads);
    # "A" and "I": blocked waiting for / issuing an MoE all-to-all (inside an F or B)
    chunk: int
    microbatch: int
    start: float
    end: float


@dataclass
class StageTimeline:
    """One rank's record of one step."""

    schedule: str
    pp_rank: int
    pp_size: int
    num_microbatches: int
    num_chunks: int = 1
    events: List[OpEvent] = field(default_factory=list)
    end: float = 0.0  # this stage's last op end
    peak_in_flight: int = 0  # max micro-batches with forward done and backward pending

    def __post_init__(self):
        self.clock = None  # an overlap.Clock: record() then takes its marks until resolve()
        self.pending: List[tuple] = []

    def record(self, kind: str, chunk: int, mb: int, start, end) -> None:
        if self.clock is not None:
            self.pending.append((kind, chunk, mb, start, end))
            return
        self.events.append(OpEvent(kind, chunk, mb, start, end))
        self.end = max(self.end, end)

    def resolve(self) -> "StageTimeline":
        """The recorded marks as seconds (on CUDA this waits for the step's events)."""
        clock, pending, self.clock, self.pending = self.clock, self.pending, None, []
        for kind, chunk, mb, start, end in pending:
            self.record(kind, chunk, mb, clock.seconds(start), clock.seconds(end))
        return self

    @property
    def busy(self) -> float:
        """The time inside F, B and W ops: the length of their union, since an F&B pair's two
        spans overlap (an all-to-all's A/I intervals lie inside the ops)."""
        total, reach = 0.0, float("-inf")
        for start, end in sorted((e.start, e.end) for e in self.events if e.kind in "FBW"):
            total += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return total

    def mean_duration(self, kind: str) -> float:
        d = [e.end - e.start for e in self.events if e.kind == kind]
        return sum(d) / len(d) if d else 0.0

    def order(self) -> List[str]:
        """Executed ops as strings like 'F1' (1-based micro-batch; '.chunk' when interleaved)."""
        return [f"{e.kind}{e.microbatch + 1}" + (f".{e.chunk}" if self.num_chunks > 1 else "")
                for e in self.events]

    def to_dict(self) -> dict:
        return asdict(self)  # (the events too: asdict recurses)

    @classmethod
    def from_dict(cls, d: dict) -> "StageTimeline":
        return cls(**{**d, "events": [OpEvent(**e) for e in d["events"]]})


def gather_timelines(timeline: StageTimeline, parallel_state) -> List[StageTimeline]:
    """Every stage's timeline of this pipeline, on every rank of the pipeline group."""
    group = parallel_state.pp_group
    if group is None or parallel_state.pp_size == 1:
        return [timeline]
    out = C.all_gather_object(timeline.to_dict(), group)
    return [StageTimeline.from_dict(d) for d in out]


def bubble_stats(timelines: Sequence[StageTimeline]) -> Dict[str, object]:
    """Measured idle fractions: per stage and overall (idle time / (p * step time))."""
    step = max(t.end for t in timelines) if timelines else 0.0
    per_stage = [(1.0 - t.busy / step) if step > 0 else 0.0 for t in timelines]
    return {
        "step_time": step,
        "bubble_per_stage": per_stage,
        "bubble_fraction": sum(per_stage) / len(per_stage) if per_stage else 0.0,
        **{f"t_{k.lower()}": _mean([t.mean_duration(k) for t in timelines]) for k in "FBW"},
        "peak_in_flight": [t.peak_in_flight for t in timelines],
    }


def _mean(xs):
    xs = [x for x in xs if x > 0]
    return sum(xs) / len(xs) if xs else 0.0


def theory_bubble(schedule: str, p: int, m: int, v: int = 1, t_f: float = 0.0, t_b: float = 0.0,
                  t_w: float = 0.0, step_time: float = 0.0) -> float:
    """docs/theory.md's bubble as a fraction of the step."""
    if p == 1:
        return 0.0
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if step_time <= 0:
        return 0.0
    if schedule == "zb-h1":
        # idle time (p-1)(T_F + T_B - T_W) on each stage (Qi et al. 2024), over the step
        return max(0.0, (p - 1) * (t_f + t_b - t_w)) / step_time
    if schedule in V_SCHEDULES:  # the idle time their op orders imply (see below)
        idle = schedule_idle_times(schedule, p, m, v, t_f, t_b, t_w)
        return sum(idle) / len(idle) / step_time
    raise ValueError(f"unknown schedule {schedule!r}")


def schedule_idle_times(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0,
                        t_b: float = 1.0, t_w: float = 1.0) -> List[float]:
    """Each rank's idle time when the op orders run with fixed per-chunk op times and instant p2p
    (a B whose W is not deferred takes t_b + t_w); raises if the orders cannot finish."""
    from megalite.pipeline_parallel.partition import virtual_stage
    from megalite.pipeline_parallel.schedules import schedule_order

    orders = [schedule_order(schedule, p, r, m, v) for r in range(p)]
    last = p * v - 1
    end: Dict[tuple, float] = {}  # (kind, virtual stage, micro-batch) -> finish time
    clock, busy, pos = [0.0] * p, [0.0] * p, [0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                vs = virtual_stage(p, r, op.chunk, v, schedule in V_SCHEDULES)
                dep = {"F": ("F", vs - 1), "W": ("B", vs),
                       "B": ("B", vs + 1) if vs < last else ("F", vs)}[op.kind]
                if dep[1] >= 0 and (*dep, op.microbatch) not in end:
                    break
                deferred = any(o.kind == "W" and (o.chunk, o.microbatch) == (
                    op.chunk, op.microbatch) for o in orders[r])
                dur = {"F": t_f, "W": t_w, "B": t_b if deferred else t_b + t_w}[op.kind]
                clock[r] = max(clock[r], end.get((*dep, op.microbatch), 0.0)) + dur
                end[op.kind, vs, op.microbatch] = clock[r]
                busy[r] += dur
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule} p={p} m={m}: the op orders deadlock")
    step = max(clock)
    return [step - b for b in busy]


def chrome_trace(timelines: Sequence[StageTimeline]) -> dict:
    """chrome://tracing / Perfetto JSON: one process row per stage, complete ('X') events in us."""
    events = []
    for t in timelines:
        events.append({"name": "process_name", "ph": "M", "pid": t.pp_rank,
                       "args": {"name": f"stage {t.pp_rank}"}})
        for e, label in zip(t.events, t.order()):
            events.append({"name": label, "cat": e.kind, "ph": "X", "pid": t.pp_rank, "tid": 0,
                           "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                           "args": {"chunk": e.chunk, "microbatch": e.microbatch}})
    meta = {"schedule": timelines[0].schedule if timelines else None,
            "num_microbatches": timelines[0].num_microbatches if timelines else None,
            "num_chunks": timelines[0].num_chunks if timelines else None,
            "stats": bubble_stats(timelines)}
    return {"traceEvents": events, "displayTimeUnit": "ms", "megalite": meta}


def exposed_a2a_seconds(timeline: StageTimeline) -> float:
    """The time the compute thread spent blocked in MoE all-to-alls during the step: its "A"
    (waiting) and "I" (issuing) intervals. docs/moe.md "Hiding the all-to-alls"."""
    return sum(e.end - e.start for e in timeline.events if e.kind in ("A", "I"))


def write_chrome_trace(timelines: Sequence[StageTimeline], path: str) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines), f)


def log_pipeline_step(timeline: Optional[StageTimeline], parallel_state, iteration: int,
                      trace_dir: Optional[str], logger=None) -> Optional[dict]:
    """Measured bubble of the last step -> ``logger``, plus a Chrome trace from global rank 0
    (docs/logging.md). A collective over the pipeline group; returns the record on every rank,
    or None without a timeline (``--timing-log-level 0``)."""
    if timeline is None:
        return None
    timelines = gather_timelines(timeline, parallel_state)
    st = bubble_stats(timelines)
    t0 = timelines[0]
    p, m, v = t0.pp_size, t0.num_microbatches, t0.num_chunks
    rec = {
        "schedule": t0.schedule, "pp_size": p, "num_chunks": v, "num_microbatches": m,
        "bubble_fraction": st["bubble_fraction"],
        "bubble_fraction_stage": st["bubble_per_stage"],
        "bubble_theory": theory_bubble(t0.schedule, p, m, v, st["t_f"], st["t_b"], st["t_w"],
                                       st["step_time"]),
        "t_f": st["t_f"], "t_b": st["t_b"], "t_w": st["t_w"], "step_time": st["step_time"],
        "peak_in_flight": max(st["peak_in_flight"]),
        "peak_in_flight_stage": st["peak_in_flight"],
    }
    # flat per-stage scalars as well: W&B / TensorBoard take scalars only, not the lists
    rec.update({f"bubble_fraction_stage{g}": b for g, b in enumerate(st["bubble_per_stage"])})
    exposed = [exposed_a2a_seconds(t) for t in timelines]
    if any(e.kind in ("A", "I") for t in timelines for e in t.events):  # an MoE run at EP > 1
        rec["moe_a2a_exposed_s"] = max(exposed)  # the slowest stage's: the step waits for it
        rec.update({f"moe_a2a_exposed_s_stage{g}": x for g, x in enumerate(exposed)})
    if trace_dir is not None and parallel_state.rank == 0:
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"pipeline_trace_iter{iteration}.json")
        write_chrome_trace(timelines, path)
        rec["trace_file"] = path
    rec["pipeline_timeline"] = [t.to_dict() for t in timelines]  # tools/plot_pipeline.py
    if logger is not None:
        logger.log(rec, iteration, split="pipeline")
    return rec
