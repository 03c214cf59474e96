"""Device-agnostic RNG tracking (a second stream seeded per TP rank) and activation recomputation
that replays the RNG states (docs/tensor_parallel.md, "Dropout and recomputation under TP")."""

from __future__ import annotations

import contextlib
import random as _random
from typing import Dict, Optional

import numpy as np
import torch

from megalite import torch_private as P

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset of the TP-rank-specific seed from the base seed (same constant idea as Megatron's 2718).
_TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that can be forked into for a region of code."""

    def __init__(self) -> None:
        self.states: Dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int, device: torch.device) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.device = device
        saved = _get_state(device)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(device)
        _set_state(device, saved)

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run a region with the named state; the default state is untouched by it."""
        if name not in self.states:
            # Not seeded (e.g. a notebook without model_parallel_seed): use the default stream.
            yield
            return
        saved = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0,
                        device: Optional[torch.device] = None) -> None:
    """Seed the default stream (same on every TP rank; per pipeline stage, whose layers differ),
    the TP-rank-specific stream, and Python's and NumPy's generators (as Megatron-LM's
    ``_set_random_seed``): a checkpoint saves all of them, so equal flags write equal bytes."""
    device = device or torch.device("cpu")
    base = seed + 100 * pp_rank
    _random.seed(base)
    np.random.seed(base % 2**32)
    torch.manual_seed(base)  # every device's default generator, CUDA's included
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, base + _TP_SEED_OFFSET + tp_rank, device)


def get_all_rng_states(device: torch.device) -> dict:
    """Every RNG state megalite uses, for checkpoints (plain tensors, weights_only-loadable)."""
    py_state = _random.getstate()
    np_state = np.random.get_state()
    return {
        "torch_cpu": torch.get_rng_state(),
        "device": _get_state(device) if device.type == "cuda" else None,
        "tracker": _TRACKER.get_states(),
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
    }


def set_all_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch_cpu"])
    if device.type == "cuda" and states.get("device") is not None:
        torch.cuda.set_rng_state(states["device"], device)
    _TRACKER.set_states(states["tracker"])
    _TRACKER.device = device
    py = states["python"]
    _random.setstate((py[0], tuple(py[1]), py[2]))
    npst = states["numpy"]
    np.random.set_state((npst[0], npst[1].numpy(), npst[2], npst[3], npst[4]))


# --------------------------------------------------------------------------- recomputation
class _CheckpointFunction(torch.autograd.Function):
    """Run ``fn`` without saving activations; recompute it (same RNG draws) in backward."""

    @staticmethod
    def forward(ctx, fn, device, *args):
        ctx.fn = fn
        ctx.device = device
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = _get_state(device) if device.type == "cuda" else None
        ctx.tracker_states = _TRACKER.get_states()
        with torch.no_grad():
            outputs = fn(*args)
        ctx.tensor_mask = [torch.is_tensor(a) for a in args]
        ctx.non_tensor_inputs = [None if t else a for a, t in zip(args, ctx.tensor_mask)]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if is_tensor else other
                  for is_tensor, other in zip(ctx.tensor_mask, ctx.non_tensor_inputs)]
        inputs = [x.detach().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x
                  for x in inputs]
        # Replay the forward under the RNG states it originally saw, then restore the present ones.
        now_cpu = torch.get_rng_state()
        now_device = _get_state(ctx.device) if ctx.device.type == "cuda" else None
        now_tracker = _TRACKER.get_states()
        torch.set_rng_state(ctx.cpu_state)
        if ctx.device_state is not None:
            _set_state(ctx.device, ctx.device_state)
        _TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.fn(*inputs)
        finally:
            torch.set_rng_state(now_cpu)
            if now_device is not None:
                _set_state(ctx.device, now_device)
            _TRACKER.set_states(now_tracker)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        global _NESTED
        _NESTED += 1
        try:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            _NESTED -= 1
        if not _NESTED:  # back in the outer backward: queue what its end must run
            while _AT_OUTER_END:
                P.queue_backward_callback(_AT_OUTER_END.pop(0))
        input_grads = tuple(x.grad if torch.is_tensor(x) else None for x in inputs)
        return (None, None) + input_grads


# Recomputation runs a nested backward (reentrant), and a callback queued inside it would run
# when that nested pass ends, right after one layer. Callbacks meant for the end of the whole
# backward wait here until the nested pass returns, and are queued on the outer one.
_NESTED = 0
_AT_OUTER_END: list = []


def queue_at_end_of_backward(fn) -> bool:
    """Run ``fn`` when the outermost running backward finishes; False when none is running."""
    if _NESTED:
        _AT_OUTER_END.append(fn)
        return True
    try:
        P.queue_backward_callback(fn)
        return True
    except RuntimeError:
        return False


def checkpoint(fn, device: torch.device, *args):
    """Recompute ``fn(*args)`` in backward instead of storing its activations."""
    return _CheckpointFunction.apply(fn, device, *args)
