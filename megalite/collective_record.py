"""The collective record (docs/clusters.md, "When a run hangs"): per rank, the last ``SIZE``
collectives megalite issued with the label of the code that issued them, kept on the host (no
device read; per collective one tuple written into a ring allocated at import). Every rank that
can ``dump``s its record when a collective fails; ``verdict`` reads all ranks' files into one line
naming the rank that stopped, or the first collective where ranks of one pipeline stage differ."""

from __future__ import annotations

import json
import os
import threading
import time

import torch

SIZE = 4096
_ring: list = [None] * SIZE  # (seq, kind, tag, group ranks, shape, dtype, label, issued at)
_done: list = [0.0] * SIZE  # when the host call returned; 0.0 not yet, None async
_state = {"seq": 0, "on": True}
_groups: dict = {}  # process group -> its global ranks, looked up once
_local = threading.local()  # the label stack: the sides of an F&B pair run on two threads


def enable(on: bool) -> None:
    _state["on"] = bool(on)


class label:
    """``with label("layer 3"):`` collectives issued inside carry it, after the outer labels."""

    def __init__(self, text: str):
        self.text = text

    def __enter__(self):
        stack = _local.__dict__.setdefault("stack", [])
        stack.append(self.text)
        _local.text = ", ".join(stack)

    def __exit__(self, *exc):
        stack = _local.stack
        stack.pop()
        _local.text = ", ".join(stack)


def _ranks(group) -> tuple:
    if group not in _groups:
        import torch.distributed as dist

        _groups[group] = tuple(dist.get_process_group_ranks(
            dist.group.WORLD if group is None else group))
    return _groups[group]


def issue(kind: str, tag: str, group, shape=None, dtype=None, async_op: bool = False) -> int:
    """Record a collective about to be issued; returns its slot for ``complete`` (-1: off, or
    traced into a compiled graph, where a record would break the graph)."""
    if not _state["on"] or torch.compiler.is_compiling():
        return -1
    seq = _state["seq"]
    slot = seq % SIZE
    ranks = group if type(group) is tuple else _ranks(group)
    _ring[slot] = (seq, kind, tag, ranks, shape, dtype, getattr(_local, "text", ""), time.time())
    _done[slot] = None if async_op else 0.0
    _state["seq"] = seq + 1
    return slot


def complete(slot: int) -> None:
    """The host call of ``slot``'s collective returned (an async one's return is no end)."""
    if slot >= 0 and _done[slot] is not None:
        _done[slot] = time.time()


def dump(directory: str, rank: int, world_size: int, program: str, reason: str,
         flight_recorder=None) -> None:
    """Write this rank's record, oldest entry first, as ``rank_<r>.json`` in ``directory``,
    atomically."""
    entries = []
    for seq in range(max(0, _state["seq"] - SIZE), _state["seq"]):
        s, kind, tag, ranks, shape, dtype, text, t = _ring[seq % SIZE]
        entries.append({"seq": s, "kind": kind, "tag": tag, "group": list(ranks),
                        "shape": None if shape is None else list(shape),
                        "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
                        "label": text, "issued_at": t, "completed_at": _done[seq % SIZE]})
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank_{rank}.json")
    with open(f"{path}.tmp-{os.getpid()}", "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "program": program, "reason": reason,
                   "written_at": time.time(), "entries": entries,
                   "flight_recorder": flight_recorder}, f, default=str)
    os.replace(f"{path}.tmp-{os.getpid()}", path)


def read(directory: str) -> list:
    """Every rank's record in ``directory`` (a partial write is never seen: see ``dump``)."""
    recs = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank_") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                recs.append(json.load(f))
    return recs


def _span(ranks) -> str:
    """[0, 1, 2, 4] -> "0-2,4"."""
    out, ranks = [], sorted(ranks)
    for r in ranks:
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def _op(e: dict) -> str:
    what = e["tag"] if e["kind"] in e["tag"] else f"{e['kind']} {e['tag']}"
    return f"{what} #{e['seq']}" + (f" ({e['label']})" if e["label"] else "")


def _key(e: dict) -> tuple:
    # an all-to-all's row counts follow the routing, so its shape may differ between ranks
    shape = None if e["kind"] == "all_to_all" else e["shape"]
    return e["kind"], e["tag"], len(e["group"]), shape, e["dtype"], e["label"]


def _mismatch(recs: list):
    """The first sequence number at which a rank issued another collective than the lowest rank
    of its pipeline stage, as a sentence; None if there is none in the records' common window."""
    first, reference = None, {}
    for r in sorted(recs, key=lambda r: r["rank"]):
        ref = reference.setdefault(r["program"], (r, {e["seq"]: e for e in r["entries"]}))
        for e in r["entries"] if ref[0] is not r else ():
            f = ref[1].get(e["seq"])
            if f is not None and _key(e) != _key(f):
                if first is None or e["seq"] < first[0]:
                    first = (e["seq"], ref[0]["rank"], f, r["rank"], e)
                break
    if first is None:
        return None
    seq, a, ea, b, eb = first
    return (f"ranks differ first at #{seq}: rank {a} issued {_op(ea)} on ranks "
            f"{_span(ea['group'])}, rank {b} issued {_op(eb)} on ranks {_span(eb['group'])}")


def verdict(recs: list) -> str:
    """One line naming the outlier from every rank's record that exists (``read``). The state
    compared is each rank's at the moment the first rank gave up: a stuck rank that wrote later
    issued its later collectives alone."""
    if not recs:
        return "no collective records"
    cutoff = min(r["written_at"] for r in recs)
    recs = [dict(r, entries=[e for e in r["entries"] if e["issued_at"] <= cutoff]) for r in recs]
    found = _mismatch(recs)
    if found:
        return found
    waiting, parts = {}, []
    for r in recs:
        last = r["entries"][-1] if r["entries"] else None
        if last is not None and not last["completed_at"]:
            key = (last["seq"], last["kind"], last["tag"], last["label"])
            waiting.setdefault(key, ([], last))[0].append(r["rank"])
        else:
            parts.append(f"rank {r['rank']} last completed {_op(last) if last else 'nothing'} "
                         "and issued nothing since")
    waits = [f"ranks {_span(rs)} wait in {_op(e)}" if len(rs) > 1 else
             f"rank {rs[0]} waits in {_op(e)}" for rs, e in waiting.values()]
    seen = {r["rank"] for r in recs}
    for rank in sorted(set(range(recs[0]["world_size"])) - seen):
        joined = [e for r in recs for e in r["entries"]
                  if rank in e["group"] and e["completed_at"]]
        last = max(joined, key=lambda e: e["issued_at"], default=None)
        parts.append(f"rank {rank} wrote no record (killed, or stuck where no signal reached it)"
                     + (f"; the last collective it joined: {_op(last)}" if last else ""))
    return "; ".join(waits + parts)
