#!/usr/bin/env python
"""Pretrain a GPT model: ``python pretrain.py [flags]``, or under ``torchrun --nproc-per-node N``.

Flags follow Megatron-LM (``python pretrain.py --help``). Any bad input ends with one line on
stderr and a non-zero exit (2 for configuration, 1 for a failed run), never a traceback or a hang
(docs/design.md, contract 8).
"""

import os
import signal
import sys
import time

# How long a rank that wrote its collective record waits for the other ranks' before it gives
# the verdict without them (a killed rank never writes; docs/clusters.md, "When a run hangs")
RECORD_WAIT_S = 10.0


def planner_estimate(cfg, world_size: int, device: str, stage: int):
    """The planner's memory estimate for this run, logged beside the measured peak. The planner
    is a tool: imported here, when the line is printed (--no-log-planner-estimate: never)."""
    from megalite.planner import estimate_for_run

    return estimate_for_run(cfg, world_size, device, stage)


def record_dir(cfg) -> str:
    return cfg.parallel.collective_record_dir or os.path.join(cfg.checkpoint.save or ".",
                                                              "collective_record")


def flight_recorder(directory: str, rank: int):
    """torch's Flight Recorder: its dump, for torch.distributed.flight_recorder's analyzer, in
    ``directory``/flight_recorder/rank_<r>; its last entries, stacks left out, for the record."""
    import pickle

    from megalite import torch_private

    try:
        raw = torch_private.flight_recorder_dump()
        entries = pickle.loads(raw).get("entries", [])[-16:]
    except Exception as e:  # a record without it is still a record
        return f"unavailable: {type(e).__name__}: {e}"[:300]
    sub = os.path.join(directory, "flight_recorder")
    os.makedirs(sub, exist_ok=True)
    with open(os.path.join(sub, f"rank_{rank}.tmp"), "wb") as f:
        f.write(raw)
    os.replace(os.path.join(sub, f"rank_{rank}.tmp"), os.path.join(sub, f"rank_{rank}"))
    return [{k: v for k, v in e.items() if k != "frames"} for e in entries]


def write_collective_record(cfg, reason: str, wait_s: float = 0.0, prog: str = "pretrain.py"):
    """This rank's collective record, then, after up to ``wait_s`` for the other ranks' (all
    there: at once), the verdict, printed by the lowest rank that wrote one."""
    import torch.distributed as dist

    from megalite import collective_record
    from megalite.parallel_state import get_parallel_state

    if not (cfg.parallel.collective_record and dist.is_initialized()
            and dist.get_world_size() > 1):
        return
    rank, world, directory = dist.get_rank(), dist.get_world_size(), record_dir(cfg)
    collective_record.dump(directory, rank, world, f"pipeline stage {get_parallel_state().pp_rank}",
                           reason, flight_recorder(directory, rank))
    if not wait_s:
        return
    deadline = time.time() + wait_s
    while True:  # by names: only the printer reads the files (about a MB each)
        written = [int(n[5:-5]) for n in os.listdir(directory)
                   if n.startswith("rank_") and n.endswith(".json")]
        if len(written) == world or time.time() >= deadline:
            break
        time.sleep(0.2)
    if rank == min(written):
        recs = collective_record.read(directory)
        print(f"{prog}: collective record: {collective_record.verdict(recs)} (records: "
              f"{directory}, read by tools/hang_report.py)", flush=True)
    else:  # torchrun stops the job at the first rank's exit: let the printer print first
        time.sleep(1.0)


def main(argv=None) -> int:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pretrain.py"
    from megalite.config import ConfigError

    try:
        from megalite.arguments import parse_args

        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2

    from megalite import collective_record
    from megalite.collectives import one_line
    from megalite.parallel_state import destroy_model_parallel
    from megalite.training import TrainingError, pretrain

    collective_record.enable(cfg.parallel.collective_record)
    own = os.path.join(record_dir(cfg), f"rank_{os.environ.get('RANK', '0')}.json")
    if os.path.exists(own):  # an earlier run's: never read as this run's
        os.remove(own)

    def on_sigterm(signum, frame):  # then dies of it, as without this handler
        write_collective_record(cfg, "SIGTERM received", prog=prog)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: leave the default behaviour
        previous = None
    try:
        pretrain(cfg, memory_estimate=planner_estimate)
        # Leave together: a rank that tears down its groups while a peer is still finishing its
        # last collective resets that peer's connections, which gloo answers with an abort.
        from megalite.collectives import barrier

        barrier()
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (TrainingError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # a peer died or hung: one line, not a traceback per rank
        from megalite.exit_conditions import peer_failure

        line = peer_failure(e)
        write_collective_record(cfg, line or one_line(e), RECORD_WAIT_S if line else 0.0, prog)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 1
    except Exception as e:  # this rank's own failure: its peers will wait on it
        write_collective_record(cfg, one_line(e), prog=prog)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        destroy_model_parallel()
    return 0


if __name__ == "__main__":
    rc = main()
    # Everything is closed and the process groups destroyed by now. Leave without the interpreter's
    # final teardown: tearing down gloo's threads there aborts the process now and then
    # ("terminate called without an active exception"), turning a finished run into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
