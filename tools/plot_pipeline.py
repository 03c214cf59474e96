"""Draw a pipeline schedule from a real run: one row per stage, F/B/W coloured, idle left blank,
MoE all-to-all waits (A) and issues (I) as thin bars over the ops they block.

    python tools/plot_pipeline.py TRACE_OR_METRICS -o schedule.png [--title TEXT]

Input is either a Chrome trace written by megalite.pipeline_parallel.timeline.write_chrome_trace
(``{"traceEvents": [...]}``), or a metrics.jsonl whose last line carrying ``pipeline_timeline``
(the list of per-stage StageTimeline dicts that the training loop logs at --timing-log-level >= 1)
is drawn.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.pipeline_parallel.timeline import StageTimeline, chrome_trace  # noqa: E402

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "A": "#C44E52", "I": "#8172B3"}


def load(path: str) -> dict:
    """Return a chrome-trace dict from either accepted input."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
        if isinstance(data, dict) and "traceEvents" in data:
            return data
        if isinstance(data, list):  # a bare list of StageTimeline dicts
            return chrome_trace([StageTimeline.from_dict(d) for d in data])
    except json.JSONDecodeError:
        pass
    found = None
    for line in text.splitlines():
        line = line.strip()
        if line:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("pipeline_timeline"):
                found = rec["pipeline_timeline"]
    if found is None:
        raise SystemExit(f"{path}: neither a Chrome trace ('traceEvents') nor a metrics.jsonl with "
                         f"a 'pipeline_timeline' entry (run with --timing-log-level 1)")
    return chrome_trace([StageTimeline.from_dict(d) for d in found])


def plot(trace: dict, out: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not xs:
        raise SystemExit("the trace has no F/B/W events to draw")
    xs = [e for e in xs if e["cat"] in "FBWAI"]
    stages = sorted({e["pid"] for e in xs})
    end_ms = max(e["ts"] + e["dur"] for e in xs) / 1e3
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, len(xs) / len(stages) * 0.45)),
                                    0.6 * len(stages) + 1.2))
    # an F&B pair (--overlap-moe-expert-parallel-comm) runs an F and a B at once: on a stage
    # whose F and B spans overlap, F takes the upper half of the row and B the lower
    ops = [e for e in xs if e["cat"] in "FBW"]
    paired = {e["pid"] for e in ops for o in ops if o is not e and o["pid"] == e["pid"]
              and o["ts"] < e["ts"] < o["ts"] + o["dur"]}
    for e in xs:
        row = stages.index(e["pid"])
        start, dur = e["ts"] / 1e3, e["dur"] / 1e3
        if e["cat"] in ("A", "I"):  # blocked on an MoE all-to-all: a thin bar over the op
            ax.barh(row + 0.3, dur, left=start, height=0.2, color=COLORS[e["cat"]], zorder=3)
            continue
        y, h = row, 0.8
        if e["pid"] in paired:  # (--delay-wgrad-compute's W's run in the waits of either side)
            y, h = row + (-0.2 if e["cat"] == "F" else 0.2), 0.4
        ax.barh(y, dur, left=start, height=h, color=COLORS.get(e["cat"], "grey"),
                edgecolor="black", linewidth=0.4, zorder=2 if e["cat"] == "W" else 1)
        if dur > end_ms / 120:
            ax.text(start + dur / 2, y, e["name"].split(".")[0][1:], ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlim(0, end_ms)
    ax.set_xlabel("time since step start (ms)")
    meta = trace.get("megalite", {})
    stats = meta.get("stats") or {}
    heading = title or f"{meta.get('schedule', 'pipeline')} schedule"
    if stats:  # (busy time is the union of the ops' spans: a pair's overlap counts once)
        heading += (f"  (m={meta.get('num_microbatches')}, measured bubble "
                    f"{100 * stats['bubble_fraction']:.1f}%)")
    ax.set_title(heading, fontsize=10)
    kinds = sorted({e["cat"] for e in xs}, key="FBWAI".index)
    names = {"F": "F forward", "B": "B backward (input grad)" if "W" in kinds else "B backward",
             "W": "W weight grad", "A": "waiting for an all-to-all",
             "I": "issuing an all-to-all"}
    ax.legend(handles=[Patch(color=COLORS[k], label=names[k]) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.55 / (len(stages) ** 0.5)), ncol=3,
              fontsize=8, frameon=False)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("input", help="Chrome trace JSON or metrics.jsonl")
    ap.add_argument("-o", "--output", default="schedule.png")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    if not os.path.exists(args.input):
        raise SystemExit(f"{args.input}: no such file")
    plot(load(args.input), args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
