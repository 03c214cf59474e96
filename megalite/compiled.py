"""``torch.compile`` for the per-op fast paths (SwiGLU, the cross entropy's blocks) with the eager
function behind it.

Compiling needs a working inductor toolchain on the machine (on CUDA, triton and a C compiler for
its launchers), and a torch release whose compiler accepts the function; neither can be checked
on the CPU that runs the tests. The compiled and the eager function compute the same thing (tests
compare them), so failing to compile must cost speed, not the run: the first call that raises is
repeated eagerly; if that succeeds, one line on stderr says what failed and the eager function is
used from then on. An error the eager function raises as well is a real one and propagates.
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
