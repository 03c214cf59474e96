#!/usr/bin/env python
"""Pretrain a GPT model: ``python pretrain.py [flags]``, or under ``torchrun --nproc-per-node N``.

Flags follow Megatron-LM (``python pretrain.py --help``). Any bad input ends with one line on
stderr and a non-zero exit (2 for configuration, 1 for a failed run), never a traceback or a hang
(docs/design.md, contract 8).
"""

import os
import sys


def planner_estimate(cfg, world_size: int, device: str, stage: int):
    """The planner's memory estimate for this run, logged beside the measured peak. The planner
    is a tool: imported here, when the line is printed (--no-log-planner-estimate: never)."""
    from megalite.planner import estimate_for_run

    return estimate_for_run(cfg, world_size, device, stage)


def main(argv=None) -> int:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pretrain.py"
    from megalite.config import ConfigError

    try:
        from megalite.arguments import parse_args

        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2

    from megalite.parallel_state import destroy_model_parallel
    from megalite.training import TrainingError, pretrain

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
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 1
    finally:
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
