"""The one module through which megalite uses private torch APIs (and ctypes), each with why no
public API serves and the torch versions it was checked on. Importing warns when torch is outside
``TESTED`` (setup.py's range); an API that a torch version lacks fails naming itself, which the CP
block kernels' self-check turns into a fall-back to their math path."""

from __future__ import annotations

import ctypes
import glob
import os
import re
import warnings

import torch

TESTED = ("2.13.0", "2.15.0")  # the oldest and newest torch the suite was run on


def _release(version: str) -> tuple:
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


if not _release(TESTED[0]) <= _release(torch.__version__) <= _release(TESTED[1]):
    warnings.warn(f"megalite was tested with torch {TESTED[0]} to {TESTED[1]}, not "
                  f"{torch.__version__}: the private torch APIs in megalite/torch_private.py may "
                  "differ (one that is missing fails naming itself)", RuntimeWarning, stacklevel=2)


def _aten(name: str):
    if not hasattr(torch.ops.aten, name):
        raise RuntimeError(f"torch {torch.__version__} has no aten.{name} (megalite/"
                           f"torch_private.py; tested with torch {TESTED[0]} to {TESTED[1]})")
    return getattr(torch.ops.aten, name)


# ---- SDPA kernels with their log-sum-exp (context_parallel/blocks.py) ----
# Why private: F.scaled_dot_product_attention returns no log-sum-exp and its backward cannot be
# given one, while a ring's blocks merge by lse and each block's backward needs the merged lse
# (docs/context_parallel.md, "Kernels"); the ATen ops behind SDPA do both. Checked on torch 2.13.0
# and 2.15.0: the schemas on meta tensors, CPU_FLASH against the math path
# (tests/test_context_parallel_blocks.py); the CUDA ones also by their self-check at first use.

def cpu_flash_fwd(q, k, v, causal, scale, mask=None):
    """``mask``: additive, q's dtype (the kernel refuses a bool one)."""
    return _aten("_scaled_dot_product_flash_attention_for_cpu")(q, k, v, 0.0, causal,
                                                               attn_mask=mask, scale=scale)


def cpu_flash_bwd(dout, q, k, v, out, lse, causal, scale, mask=None):
    return _aten("_scaled_dot_product_flash_attention_for_cpu_backward")(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _no_rng(device, flash: bool):
    """The philox seed and offset a backward takes; dropout is 0, so they are never read. Shaped
    as the forward returns them (flash on CUDA: uint64 [2] and []; otherwise int64 scalars)."""
    if flash and not torch.version.hip:
        return (torch.empty(2, dtype=torch.uint64, device=device),
                torch.empty((), dtype=torch.uint64, device=device))
    return tuple(torch.empty((), dtype=torch.long, device=device) for _ in range(2))


def flash_fwd(q, k, v, causal, scale):
    return _aten("_scaled_dot_product_flash_attention")(q, k, v, 0.0, causal, scale=scale)[:2]


def flash_bwd(dout, q, k, v, out, lse, causal, scale):
    # not varlen: no cumulative sequence lengths, max lengths the block's own
    return _aten("_scaled_dot_product_flash_attention_backward")(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
        *_no_rng(q.device, True), scale=scale)


def efficient_fwd(q, k, v, causal, scale):
    return _aten("_scaled_dot_product_efficient_attention")(q, k, v, None, True, 0.0, causal,
                                                            scale=scale)[:2]


def efficient_bwd(dout, q, k, v, out, lse, causal, scale):
    return _aten("_scaled_dot_product_efficient_attention_backward")(
        dout, q, k, v, None, out, lse, *_no_rng(q.device, False), 0.0, [True, True, True, False],
        causal, scale=scale)[:3]


def cudnn_fwd(q, k, v, causal, scale):
    return _aten("_scaled_dot_product_cudnn_attention")(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False,
        scale=scale)[:2]


def cudnn_bwd(dout, q, k, v, out, lse, causal, scale):
    # dense inputs: cuDNN's backward wants out and dout laid out alike
    return _aten("_scaled_dot_product_cudnn_attention_backward")(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse,
        *_no_rng(q.device, False), None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale)


# ---- the autograd engine (pipeline executor, ZeRO-3, activation recomputation) ----
# Why private: torch has no public way to run a callback when the whole running backward ends
# (torch's FSDP uses this one), nor a backward that skips torch.autograd.backward's check of the
# gradient's shape against the output's, which a stage output whose storage was freed after its
# send fails; nor a public test for a view. Checked on torch 2.13.0 and 2.15.0.

def queue_backward_callback(fn) -> None:
    """Run ``fn`` when the running backward ends; RuntimeError when none is running."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def backward_unchecked(output: torch.Tensor, grad: torch.Tensor) -> None:
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


def is_view(t: torch.Tensor) -> bool:
    return t._base is not None


# nn.Module.load_state_dict's return type, for a module that overrides it (ZeRO-3's); torch does
# not export it. Checked on torch 2.13.0 and 2.15.0.
IncompatibleKeys = torch.nn.modules.module._IncompatibleKeys


# ---- mixed precision (optimizer/grad_scaler.py) ----
# Why private: the fused check-and-unscale of torch.amp.GradScaler, one kernel per dtype for a
# whole list; the public GradScaler wraps its own optimizer step, not megalite's sharded ones.
# Checked on torch 2.13.0 and 2.15.0.

def unscale_and_check_(grads, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (one dtype) by ``inv_scale`` in place; ``found_inf`` = 1 on an inf/NaN."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


# ---- CPU memory measurement (memory.py; docs/planner.md, "2. Memory of real runs") ----
# Why private: no public API switches c10's gflag FLAGS_caffe2_report_cpu_memory_usage, under
# which the CPU allocator counts the frees of every thread (the profiler records only its own
# threads), and torch.profiler's public events carry no allocator total (``total_allocated``);
# nor is there a public test for torch.compile's fake tensors. Checked on torch 2.13.0 and 2.15.0.

def c10_bool_flag(name: str):
    """A ctypes handle (``.value``) on c10's bool gflag ``name``; None where libc10 exports none."""
    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*c10.*")):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(path), name)
        except (OSError, ValueError):
            continue
    return None


def profiler_events(prof):
    """(name, start ns, (bytes, the allocator's total) for a CPU allocation or free, else None)
    for every event of a finished ``torch.profiler.profile``."""
    from torch._C._profiler import _EventType

    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        alloc = e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"
        yield e.name, e.start_time_ns, ((e.extra_fields.alloc_size,
                                         e.extra_fields.total_allocated) if alloc else None)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of torch.compile's tracing tensors (no storage of its own)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(t)


# ---- torch's Flight Recorder (pretrain.py, docs/clusters.md "When a run hangs") ----
# Why private: torch has no public call that returns the Flight Recorder's entries of this
# process; its dump on a timeout is NCCL's alone. Checked on torch 2.13.0 (gloo: the
# entries stay "scheduled", "retired").

def flight_recorder_dump() -> bytes:
    """The Flight Recorder's pickled dump, the form torch.distributed.flight_recorder reads (a
    torch without it: AttributeError naming ``_dump_fr_trace``)."""
    return torch._C._distributed_c10d._dump_fr_trace()
