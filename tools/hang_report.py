"""Name the rank that stopped a run, from the collective records its ranks wrote when it failed
or hung (docs/clusters.md, "When a run hangs").

    python tools/hang_report.py DIR [--entries N]

DIR holds one ``rank_<r>.json`` per rank that could write (``--collective-record-dir``, default
``collective_record`` in ``--save``). Prints the verdict in one line, as the run's lowest rank
did if it saw every file; ``--entries N`` also prints each rank's last N collectives.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite import collective_record  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="the directory of rank_<r>.json files")
    p.add_argument("--entries", type=int, default=0, metavar="N",
                   help="also print each rank's last N collectives")
    args = p.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"hang_report.py: error: {args.dir} is not a directory", file=sys.stderr)
        return 2
    try:
        recs = collective_record.read(args.dir)
        line = collective_record.verdict(recs) if recs else ""
    except (ValueError, KeyError, TypeError, IndexError) as e:  # a damaged or foreign file
        print(f"hang_report.py: error: a rank_<r>.json in {args.dir} is not a collective record "
              f"({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if not recs:
        print(f"hang_report.py: error: no rank_<r>.json records in {args.dir}", file=sys.stderr)
        return 2
    for r in recs if args.entries else ():
        print(f"rank {r['rank']} ({r['program']}; {r['reason']}):")
        for e in r["entries"][-args.entries:]:
            state = "async" if e["completed_at"] is None else (
                "completed" if e["completed_at"] else "waiting")
            print(f"  #{e['seq']} {e['kind']} {e['tag']} on ranks {e['group']} {e['shape']} "
                  f"{e['dtype']} {state} ({e['label']})")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
