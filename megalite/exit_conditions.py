"""Stopping a run cleanly, and saying why it stopped (docs/clusters.md, "Faults"). The stop flags
are agreed over all ranks: a rank that stopped alone would leave its peers waiting."""

from __future__ import annotations

import signal
import time
from typing import Optional

import torch

from megalite import collectives as C

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitConditions:
    """Context manager: installs the signal handlers (main thread only) and restores them."""

    def __init__(self, training_cfg, ps, t_start: float):
        self.handle_signals = bool(training_cfg.exit_signal_handler)
        self.minutes = training_cfg.exit_duration_in_mins
        self.deadline = None if self.minutes is None else t_start + 60.0 * self.minutes
        self.ps = ps
        self.received: Optional[int] = None
        self._previous = {}

    def __enter__(self) -> "ExitConditions":
        if self.handle_signals:
            for s in SIGNALS:
                try:
                    self._previous[s] = signal.signal(s, self._on_signal)
                except ValueError:  # not the main thread: leave the default behaviour
                    pass
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def stop_reason(self) -> Optional[str]:
        """Why every rank stops after this iteration, or None. Collective when armed."""
        if not self.handle_signals and self.deadline is None:
            return None
        late = self.deadline is not None and time.time() >= self.deadline
        flags = torch.tensor([float(self.received or 0), float(late)])  # host path
        if self.ps.world_size > 1:
            C.all_reduce(flags, group=C.world_group(), op=C.ReduceOp.MAX, tag="exit_flags",
                         host=True)
        if flags[0] > 0:
            name = signal.Signals(int(flags[0])).name
            return f"{name} received, --exit-signal-handler: saving and exiting"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {self.minutes:g} reached: saving and exiting"
        return None


def peer_failure(e: BaseException) -> Optional[str]:
    """One line for a collective that failed because another rank died or hung, else None."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    text = str(e).strip()
    markers = ("Connection reset", "Connection closed", "Broken pipe", "Timed out", "timed out",
               "Socket Timeout", "NCCL", "gloo", "Gloo")
    if not (isinstance(e, dist.DistError) or any(m in text for m in markers)):
        return None
    first = C.one_line(e).split("] ", 1)[-1].split(". This is typically")[0]  # gloo prefix, advice
    return (f"rank {dist.get_rank()}: a collective failed because another rank died or stopped "
            f"responding ({first[:200]}); resume from the last checkpoint with --load")
