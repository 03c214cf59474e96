"""Per-rank model-state memory (parameters, gradients, fp32 masters, optimizer states), measured
from tensor storages (views counted once, never RSS) beside docs/theory.md's formula for
megalite's layout ("ZeRO"): with bucket padding (ZeRO-3: unit padding) counted in Ψ the two agree
exactly; under EP the expert buffers take their own group's N. Also the peak-memory probes."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from typing import Dict, Iterable, List, Optional

import torch
import torch.nn as nn

from megalite import torch_private as P
from megalite.param_meta import grad_of

_CATEGORIES = ("params", "grads", "master_params", "optimizer_states")


def _storages(tensors: Iterable[torch.Tensor]) -> Dict[tuple, int]:
    """(device, storage address) -> bytes of the distinct, non-empty storages behind ``tensors``
    (Nones skipped)."""
    return {(t.device.type, t.device.index, t.untyped_storage().data_ptr()):
            t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0}


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct, non-empty storages behind ``tensors`` (views counted once; a freed
    ZeRO-3 buffer, resized to 0 bytes, counts nothing). Benchmarks and tests measure with this."""
    return sum(_storages(tensors).values())


def model_state_bytes(chunks: List[nn.Module], optimizer=None) -> Dict[str, int]:
    """Bytes this rank holds for params, grads, masters and optimizer states (deduplicated)."""
    params = [p for c in chunks for p in c.parameters()]
    # .grad and a DDP buffer's main_grad (both, where both exist; storages are counted once)
    grads: List[torch.Tensor] = [g for p in params for g in (p.grad, grad_of(p))]
    for c in chunks:
        # ZeRO-3: param.data is a size-0 placeholder; the model state is in the units: the
        # gather source (the fp32 master itself in fp32 — counted once, as params), the fp32
        # gradient shard, and whatever full buffers are gathered right now (none between steps).
        for u in getattr(c, "units", []):
            params.extend((u.shard, u.full))
            grads.extend((u.grad, u.full_grad))
        for buf in getattr(c, "grad_buffers", []):
            grads.append(buf.grad_data)
            for b in buf.buckets:
                grads.extend((b.grad_data, b.grad_shard_acc, b.pending_out))
    masters: List[torch.Tensor] = []
    states: List[torch.Tensor] = []
    if optimizer is not None:
        if hasattr(optimizer, "model_state_tensors"):
            tensors = optimizer.model_state_tensors()
            masters, states = tensors["master_params"], tensors["optimizer_states"]
        else:  # a plain optimizer: masters and a torch optimizer's per-param state
            masters = [m for m in getattr(optimizer, "masters", [])]
            inner = getattr(optimizer, "inner", optimizer)
            for st in getattr(inner, "state", {}).values():
                states.extend(v for k, v in st.items()
                              if isinstance(v, torch.Tensor) and k != "step")
    seen: Dict[tuple, int] = {}
    out = {}
    for name, tensors in zip(_CATEGORIES, (params, grads, masters, states)):
        found = _storages(tensors)
        out[name + "_bytes"] = sum(n for k, n in found.items() if k not in seen)
        seen.update(found)
    out["total_bytes"] = sum(out[c + "_bytes"] for c in _CATEGORIES)
    return out


def theoretical_model_state_bytes(num_params: int, dp_size: int, zero_stage: int,
                                  params_dtype: str = "float32") -> Dict[str, float]:
    """docs/theory.md's per-rank bytes for megalite's layout, plus the ZeRO paper's total."""
    psi, n = float(num_params), float(dp_size)
    p16 = params_dtype in ("bfloat16", "float16")
    param_b = 2 if p16 else 4

    def sharded(stage):  # the factor of a state that ZeRO stage ``stage`` on shards
        return 1.0 / n if zero_stage >= stage else 1.0

    theory = {
        "params_bytes": param_b * psi * sharded(3),
        "grads_bytes": 4 * psi * sharded(2),
        "master_params_bytes": (4 * psi * sharded(1)) if p16 else 0.0,
        "optimizer_states_bytes": 8 * psi * sharded(1),
    }
    theory["total_bytes"] = sum(theory[c + "_bytes"] for c in _CATEGORIES)
    # The ZeRO paper's accounting (16-bit grads) for reference: K = 12 (16-bit) or 8 (fp32);
    # stage s shards the first s of (optimizer states, gradients, parameters).
    per_param = (12 if p16 else 8, param_b, param_b)
    kept = sum(per_param[zero_stage:])
    theory["zero_paper_total_bytes"] = kept * psi + (sum(per_param) - kept) * psi / n
    return theory


def _num_params(chunks, padded: bool) -> int:
    """Ψ of this rank; ``padded``: as its buffers (ZeRO-3: units) hold it, padding included."""
    total = 0
    for c in chunks:
        units, bufs = getattr(c, "units", None), getattr(c, "grad_buffers", None)
        if units:  # ZeRO-3: the params are placeholders; each unit is padded to a multiple of N
            total += sum(u.padded if padded else u.numel for u in units)
        elif bufs and padded:
            total += sum(b.numel for b in bufs)
        else:
            total += sum(p.numel() for p in c.parameters())
    return total


def _theory_by_group(chunks, psi: int, dp_size: int, zero_stage: int, params_dtype: str,
                     padded: bool) -> Dict[str, float]:
    """The theory of ``psi`` parameters, those of buffers (ZeRO-3: units) sharded over a group of
    another size than ``dp_size`` (EP > 1's experts) counted with their own N."""
    other: Dict[int, int] = {}
    for c in chunks:
        for b in getattr(c, "grad_buffers", None) or ():
            if b.dp_size != dp_size:
                other[b.dp_size] = other.get(b.dp_size, 0) + (b.numel if padded
                                                              else b.numel_unpadded)
        for u in getattr(c, "units", None) or ():  # ZeRO-3
            if u.dp_size != dp_size:
                other[u.dp_size] = other.get(u.dp_size, 0) + (u.padded if padded else u.numel)
    parts = [theoretical_model_state_bytes(n, size, zero_stage, params_dtype) for size, n in
             [(dp_size, psi - sum(other.values()))] + sorted(other.items())]
    return {k: sum(p[k] for p in parts) for k in parts[0]}


def memory_report(model_chunks, optimizer=None) -> Dict:
    """Measured and theoretical model-state bytes, flat, for the run's logger at iteration 1."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    first = chunks[0]
    zero_stage, dp_size = getattr(first, "zero_stage", 0), getattr(first, "dp_size", 1)
    dtype = getattr(first, "compute_dtype", None) or next(first.parameters()).dtype
    params_dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
    measured = model_state_bytes(chunks, optimizer)
    psi_padded, psi = _num_params(chunks, True), _num_params(chunks, False)
    theory = _theory_by_group(chunks, psi_padded, dp_size, zero_stage, params_dtype, True)
    unpadded = _theory_by_group(chunks, psi, dp_size, zero_stage, params_dtype, False)
    if zero_stage == 0:  # the plain optimizer's Adam moments are per parameter (its 16-bit
        # masters are a copy of the padded buffer: optimizer.MixedPrecisionOptimizer)
        theory["optimizer_states_bytes"] = unpadded["optimizer_states_bytes"]
        theory["total_bytes"] = sum(theory[c + "_bytes"] for c in _CATEGORIES)
    report = {"zero_stage": zero_stage, "dp_size": dp_size, "num_params_local": psi,
              "num_params_local_padded": psi_padded}
    report.update({"mem_" + k: v for k, v in measured.items()})
    report.update({"mem_theory_" + k: v for k, v in theory.items()})
    report["mem_theory_unpadded_total_bytes"] = unpadded["total_bytes"]
    return report


class CountingCPUFrees:
    """While active, c10's ``caffe2_report_cpu_memory_usage`` is on, so the profiler's memory
    events carry the count of every thread's frees (``cpu_live_bytes``); a no-op without it."""

    def __enter__(self):
        self.flag = P.c10_bool_flag("FLAGS_caffe2_report_cpu_memory_usage")
        if self.flag is not None:
            self.was, self.flag.value = self.flag.value, True
        return self

    def __exit__(self, *exc):
        if self.flag is not None:
            self.flag.value = self.was
        return False


def cpu_live_bytes(prof, since: Optional[str] = None) -> List[tuple]:
    """``[(time_ns, bytes)]``: the CPU allocator's live bytes at each memory event of ``prof``
    (profiled under CountingCPUFrees), counted from just before the first event; with ``since``,
    only from the start of the first op or ``record_function`` of that name on."""
    stamps, begin = [], None
    for name, start, alloc in P.profiler_events(prof):
        if alloc is not None:
            stamps.append((start, *alloc))
        elif since is not None and name == since:
            begin = min(start, begin or start)
    stamps.sort()
    before = stamps[0][2] - stamps[0][1] if stamps else 0  # the first event's count less its own
    return [(t, total - before) for t, _, total in stamps if begin is None or t >= begin]


# CUDA's allocator keeps one high-water mark, which PeakTensorMemory resets to measure its block;
# the run's peak from before each reset is kept here, so peak_memory_bytes (every logged record)
# stays the peak since start-up.
_CUDA_PEAK_BEFORE_RESET: Dict[Optional[int], int] = {}


def cuda_peak_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a CUDA device since start-up, across PeakTensorMemory's resets."""
    return max(int(torch.cuda.max_memory_allocated(device)),
               _CUDA_PEAK_BEFORE_RESET.get(device.index, 0))


class PeakTensorMemory:
    """Peak bytes of live tensor storage on ``device`` while the ``with`` block runs, on GPU and
    CPU as docs/planner.md, "2. Memory of real runs", says; measure one iteration (the profiler
    slows it down). Its C++ log lines on stderr are held back; both process-level effects (fd 2
    redirected, the c10 flag) last only for the block (tests/test_layering.py)."""

    _NOISE = ("USDT:", "STAGE:", "CPUAllocator.cpp")

    def __init__(self, device):
        self.device, self.peak_bytes = torch.device(device), None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            _CUDA_PEAK_BEFORE_RESET[self.device.index] = cuda_peak_bytes(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        gc.collect()
        self.baseline = distinct_storage_bytes(o for o in gc.get_objects() if issubclass(
            type(o), torch.Tensor) and o.device.type == "cpu" and not o.is_meta
            and not P.is_fake(o))
        sys.stderr.flush()
        self._err, self._saved = tempfile.TemporaryFile(), os.dup(2)
        os.dup2(self._err.fileno(), 2)
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            profile_memory=True)
        self._count = CountingCPUFrees().__enter__()
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return False
        try:
            self._prof.__exit__(*exc)
        finally:
            self._count.__exit__()
            sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._saved)
            self._err.seek(0)
            sys.stderr.write("".join(ln for ln in self._err.read().decode(errors="replace")
                                     .splitlines(True) if not any(n in ln for n in self._NOISE)))
            self._err.close()
        high = max([0] + [n for _, n in cpu_live_bytes(self._prof)])
        self.peak_bytes = int(self.baseline + high)
        self._prof = None
        return False


# ------------------------------------------------------------------------------ host peak RSS
# What the converter, load-time resharding and the CPU profiles are held to: Linux's ``VmHWM``,
# which writing "5" to /proc/self/clear_refs resets to the current ``VmRSS``.
HOST_PEAK_RSS_SUPPORTED = os.path.exists("/proc/self/clear_refs")


def host_rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (``VmRSS``) or its peak since the last reset
    (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_host_peak_rss() -> int:
    """Reset the peak to the current resident memory and return that: the peak growth of a region
    is ``host_rss_bytes("VmHWM") - reset_host_peak_rss()`` taken around it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return host_rss_bytes("VmRSS")
