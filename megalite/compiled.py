"""``torch.compile`` for the per-op fast paths with the eager function behind it: failing to
compile costs speed, not the run (docs/performance.md, after the fast-path table). An error the
eager function raises as well is a real one and propagates.
"""

from __future__ import annotations

import sys

import torch

from megalite.collectives import one_line


class compile_or_eager:  # noqa: N801 - used like torch.compile
    def __init__(self, fn, **compile_kwargs):
        self.fn, self.kwargs, self.compiled, self.failed = fn, compile_kwargs, None, False

    def __call__(self, *args):
        if self.failed:
            return self.fn(*args)
        if self.compiled is None:  # on first use: importing the compiler costs seconds
            self.compiled = torch.compile(self.fn, **self.kwargs)
        try:
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - retried eagerly just below
            out = self.fn(*args)
            self.failed = True
            print(f"megalite: torch.compile of {self.fn.__name__} failed ({one_line(e)}); it "
                  f"runs eagerly from now on", file=sys.stderr, flush=True)
            return out
