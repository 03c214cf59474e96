"""``torch.compile`` for the per-op fast paths with the eager function behind it: failing to
compile costs speed, not the run (docs/performance.md, after the fast-path table). An error the
eager function raises as well is a real one and propagates.
"""

from __future__ import annotations

import sys
import warnings

import torch

from megalite.collectives import one_line


def self_checked(what: str, then: str, error, tolerance: float) -> bool:
    """Whether a fast kernel may be used: ``error()`` runs it against the exact path on a small
    problem and returns the max relative error; an exception or an error over ``tolerance``
    means no, with one warning line naming ``what`` and what runs instead (``then``)."""
    try:
        err = error()
        why = None if err <= tolerance else f"max relative error {err:.1e}"
    except Exception as e:  # noqa: BLE001 - any failure of the kernel means: do not use it
        why = one_line(e, 200)
    if why is not None:
        warnings.warn(f"{what} failed its self-check ({why}); using {then}", RuntimeWarning,
                      stacklevel=3)
    return why is None


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
