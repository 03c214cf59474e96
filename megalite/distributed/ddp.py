"""DistributedDataParallel: contiguous grad buffers, bucketed and overlapped DP reduction
(docs/data_parallel.md, "How a step runs"). The DP reduction comes first, the TP and
embedding-group sums after it (sums commute)."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.nn as nn

from megalite import collectives as C
from megalite.config import OptimizerConfig
from megalite.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer
from megalite.param_meta import param_meta, set_param_meta
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.random import queue_at_end_of_backward

# Megatron's default: one bucket per ~40M elements.
DEFAULT_BUCKET_SIZE = 40_000_000


def params_by_dtype(named_params):
    """Buffers of (name, anything with a ``.dtype``): one per dtype in order of first appearance,
    expert parameters apart (reduced over the expert-data-parallel group); the checkpoint
    converter lays out its parameter descriptions by the same rule."""
    by_dtype: Dict[tuple, list] = {}
    for name, p in named_params:
        by_dtype.setdefault((p.dtype, param_meta(p).expert), []).append((name, p))
    return list(by_dtype.values())


class DistributedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, config: OptimizerConfig, parallel_state: ParallelState,
                 *, bucket_size: Optional[int] = None):
        super().__init__()
        self.module = module
        self.ps = parallel_state
        self.zero_stage = config.zero_stage  # 0-2 (stage 3 is megalite/distributed/zero3.py)
        size = bucket_size if bucket_size is not None else config.ddp_bucket_size
        self.bucket_size = size if size is not None else DEFAULT_BUCKET_SIZE
        # CP ranks hold the same parameters; under HSDP the buckets are sharded inside an
        # instance, and each shard summed across the instances (finish_grad_sync)
        self.dp_group = parallel_state.zero_group
        self.replicate_group = parallel_state.replicate_group
        self.dp_size = C.group_size(self.dp_group)
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.overlap_param_gather = config.overlap_param_gather
        self._sync_enabled = True
        self._synced = False
        self._drain_queued = False
        # (kind, index or name, time): filled only when record_events is True (overlap tests).
        self.record_events = False
        self.events: List[tuple] = []

        self.grad_buffers: List[ParamAndGradBuffer] = []
        named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for named in params_by_dtype(named_params):
            dtype = named[0][1].dtype
            grad_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
            expert = param_meta(named[0][1]).expert
            self.grad_buffers.append(ParamAndGradBuffer(
                named, grad_dtype=grad_dtype, zero_stage=self.zero_stage,
                dp_group=parallel_state.edp_group if expert else self.dp_group,
                bucket_size=self.bucket_size))
        self.param_to_buffer: Dict[nn.Parameter, ParamAndGradBuffer] = {
            p: buf for buf in self.grad_buffers for p in buf.slots}
        self.param_names: Dict[nn.Parameter, str] = {
            p: slot.name for buf in self.grad_buffers for p, slot in buf.slots.items()}

        self._hook_handles = []
        for p in self.param_to_buffer:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
            set_param_meta(p, deferred_grad_hook=functools.partial(self._grad_hook, deferred=True))
        # overlap_param_gather: the first module using a bucket's params in the next forward
        # waits for its all-gather. Never inside compiled code, where the hook's parameter
        # lookups would guard on each parameter's identity and recompile every layer: a
        # ``compiled_forward`` module gets one hook, outside its graph, for all its parameters.
        for m in _gather_hook_sites(module) if self.overlap_param_gather else ():
            self._hook_handles.append(m.register_forward_pre_hook(self._param_gather_pre_hook))

    # ------------------------------------------------------------------------------ nn.Module
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        # Pass unknown attributes (config, set_input_tensor, ...) through to the wrapped chunk.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)

    @property
    def buckets(self) -> List[Bucket]:
        return [b for buf in self.grad_buffers for b in buf.buckets]

    # ----------------------------------------------------------------------------- grad hooks
    def _record(self, kind: str, what) -> None:
        if self.record_events:
            self.events.append((kind, what, time.perf_counter()))

    def _grad_hook(self, p: nn.Parameter, deferred: bool = False) -> None:
        """After backward accumulated ``p``'s gradient, or (``deferred``) after a W added it: a
        W adds into ``main_grad`` itself, except under stage 2 with the storage released."""
        if p.grad is None and not deferred:
            return  # deferred weight gradient: it arrives through _grad_hook(deferred=True)
        buf = self.param_to_buffer[p]
        bucket = buf.param_to_bucket[p]
        if p.grad is not None:
            if buf.zero_stage == 2:
                self._complete_stage2(bucket)  # fold an in-flight reduction before reusing storage
                buf.ensure_grad_storage(bucket)
            if p.grad.data_ptr() != p.main_grad.data_ptr():  # (.grad may alias main_grad already)
                p.main_grad.add_(p.grad.view_as(p.main_grad))
            p.grad = None
        self._synced = False
        self._record("hook", self.param_names[p])
        if not deferred and param_meta(p).weight_grads_queued:
            return  # more of this gradient comes with a queued W pass (a tied output layer's)
        self._mark_ready(buf, bucket, p)

    def _mark_ready(self, buf: ParamAndGradBuffer, bucket: Bucket, p: nn.Parameter) -> None:
        bucket.ready.add(p)
        if len(bucket.ready) < len(bucket.params):
            return
        bucket.ready.clear()
        if buf.zero_stage == 2:
            # ZeRO-2: reduce every micro-batch so only the shard outlives it.
            self._launch(buf, bucket)
            if not self.overlap_grad_reduce:
                self._complete_stage2(bucket)
            elif not self._drain_queued:
                # at the end of the whole backward, not of a recomputed layer's nested one:
                # the reduce-scatters overlap the rest of the backward
                self._drain_queued = queue_at_end_of_backward(self._drain_stage2)
                if not self._drain_queued:  # outside backward (a deferred W): finish now
                    self._complete_stage2(bucket)
        elif self._sync_enabled and self.overlap_grad_reduce and not bucket.launched:
            self._launch(buf, bucket)

    # ---------------------------------------------------------------------------- collectives
    def _launch(self, buf: ParamAndGradBuffer, bucket: Bucket) -> None:
        self._record("launch", bucket.index)
        async_op = self.overlap_grad_reduce
        if buf.zero_stage == 0:
            bucket.grad_handle = C.all_reduce(bucket.grad_data, group=buf.dp_group,
                                              async_op=async_op, tag="dp_grad_all_reduce")
        elif buf.zero_stage == 1:
            # In place: rank r's shard of the bucket receives the sum.
            bucket.grad_handle = C.reduce_scatter_tensor(
                buf.grad_shard(bucket), bucket.grad_data, group=buf.dp_group, async_op=async_op,
                tag="dp_grad_reduce_scatter")
        else:
            bucket.pending_out = torch.empty(bucket.shard_numel, dtype=buf.grad_dtype,
                                             device=buf.device)
            bucket.grad_handle = C.reduce_scatter_tensor(
                bucket.pending_out, bucket.grad_data, group=buf.dp_group, async_op=async_op,
                tag="dp_grad_reduce_scatter")
        bucket.launched = True
        if buf.zero_stage == 1 and async_op and self.replicate_group is not None:
            # HSDP: the buckets launched before this one had a bucket's backward to finish their
            # reduce-scatters, so their shards cross the instances now, behind the backward
            for b in buf.buckets:
                if b.launched and b is not bucket and b.replicate_handle is None:
                    self._cross(buf, b)

    def _cross(self, buf: ParamAndGradBuffer, bucket: Bucket) -> None:
        """Wait for the bucket's reduction, then (HSDP) all-reduce its shard across the
        instances, in flight until finish_grad_sync."""
        if bucket.grad_handle is not None:
            bucket.grad_handle.wait()
            bucket.grad_handle = None
        bucket.replicate_handle = C.all_reduce(buf.grad_shard(bucket), async_op=True,
                                               group=self.replicate_group, tag="dp_replicate")
        if self.replicate_group is not None:
            self._record("cross", bucket.index)

    def _complete_stage2(self, bucket: Bucket) -> None:
        if bucket.pending_out is None:
            return
        if bucket.grad_handle is not None:
            self._record("wait", bucket.index)
            bucket.grad_handle.wait()
            bucket.grad_handle = None
        buf = self.param_to_buffer[bucket.params[0]]
        bucket.grad_shard_acc.add_(bucket.pending_out)
        bucket.pending_out = None
        buf.release_grad_storage(bucket)

    def _drain_stage2(self) -> None:
        self._drain_queued = False
        for b in self.buckets:
            self._complete_stage2(b)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: stages 0/1 skip the DP reduction until the last micro-batch
        (stage 2 reduces every micro-batch regardless: it keeps only the shard between them)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Issue the reduction of every bucket not yet issued in this iteration."""
        for buf in self.grad_buffers:
            for b in buf.buckets:
                if buf.zero_stage == 2:
                    if b.pending_out is None and b.grad_data is not None:
                        self._launch(buf, b)  # partial buckets (unused params, captured B)
                elif not b.launched:
                    self._launch(buf, b)

    def finish_grad_sync(self) -> None:
        """Wait until every bucket's gradients are reduced over the DP group."""
        if self._synced:
            return
        self.start_grad_sync()
        for buf in self.grad_buffers:
            for b in buf.buckets:
                if buf.zero_stage == 2:
                    self._complete_stage2(b)
                if b.replicate_handle is None:  # (a bucket's shard crosses while the next waits)
                    self._cross(buf, b)
                b.launched = False
                b.ready.clear()
        for b in self.buckets:
            if b.replicate_handle is not None:
                b.replicate_handle.wait()
                b.replicate_handle = None
        self._synced = True

    def zero_grad_buffer(self) -> None:
        """Zero the gradients for a new iteration (waits for anything still in flight)."""
        for buf in self.grad_buffers:
            for b in buf.buckets:
                for work in (b.grad_handle, b.replicate_handle):
                    if work is not None:
                        work.wait()
                b.grad_handle = b.replicate_handle = None
                b.pending_out = None
            buf.zero_grad()
        for p in self.param_to_buffer:
            p.grad = None
        self._synced = False

    # ------------------------------------------------------------------------ param all-gather
    def start_param_sync(self, overlap: Optional[bool] = None) -> None:
        """All-gather every bucket's params from their owners' shards (stages 1/2); with overlap
        they stay in flight and the forward pre-hooks wait for them."""
        overlap = self.overlap_param_gather if overlap is None else overlap
        for buf in self.grad_buffers:
            for b in buf.buckets:
                lo = b.shard_start - b.offset
                shard = b.param_data[lo:lo + b.shard_numel]
                self._record("param_gather", b.index)
                b.param_handle = C.all_gather_into_tensor(
                    b.param_data, shard, group=buf.dp_group, async_op=overlap,
                    tag="dp_param_all_gather")
                if not overlap:
                    b.param_handle = None

    def finish_param_sync(self) -> None:
        for b in self.buckets:
            if b.param_handle is not None:
                b.param_handle.wait()
                b.param_handle = None

    def _param_gather_pre_hook(self, module: nn.Module, args) -> None:
        for p in module.parameters(recurse=getattr(module, "compiled_forward", False)):
            buf = self.param_to_buffer.get(p)
            if buf is None:
                continue
            b = buf.param_to_bucket[p]
            if b.param_handle is not None:
                b.param_handle.wait()
                b.param_handle = None
                self._record("param_wait", b.index)

    # ------------------------------------------------------------------------ finalize helpers
    def valid_grad_slices(self, predicate: Callable[[nn.Parameter], bool]) -> List[torch.Tensor]:
        out = []
        for buf in self.grad_buffers:
            for p in buf.slots:
                if predicate(p):
                    g = buf.valid_grad_slice(p)
                    if g is not None:
                        out.append(g)
        return out


def all_reduce_coalesced(grads: List[torch.Tensor], group, tag: str) -> None:
    """All-reduce ``grads`` in place as one flat tensor."""
    if not grads or C.group_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    C.all_reduce(flat, group=group, tag=tag)
    for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(synced.view_as(g))


def add_tied_copies_here(grads: List[torch.Tensor]) -> bool:
    """Both copies of a tied embedding on this rank (the V schedules' rank 0): give both the sum
    of their gradients, no collective. False when at most one copy is here."""
    if len(grads) != 2:
        return False
    grads[0].add_(grads[1])
    grads[1].copy_(grads[0])
    return True


def finalize_model_grads_ddp(chunks: Iterable[DistributedDataParallel], ps: ParallelState) -> None:
    """DP reduction of every chunk, then TP (partial gradients) and embedding-group all-reduces on
    the DP-reduced slices this rank holds (the order is explained in the module docstring)."""
    chunks = list(chunks)
    for c in chunks:
        c.finish_grad_sync()
    if C.group_size(ps.tp_group) > 1:
        sp = [s for c in chunks for s in c.valid_grad_slices(
            lambda p: param_meta(p).grad_partial_over_tp)]
        all_reduce_coalesced(sp, ps.tp_group, "tp_sp_grad_all_reduce")
    if ps.pp_size > 1 and ps.in_embedding_group:
        emb = [s for c in chunks for s in c.valid_grad_slices(
            lambda p: param_meta(p).tied_embedding)]
        if not add_tied_copies_here(emb):
            all_reduce_coalesced(emb, ps.embedding_group, "embedding_grad_all_reduce")


def _gather_hook_sites(module: nn.Module, seen=None):
    """The modules that wait for overlapped parameter all-gathers: each one holding parameters
    itself, except that a ``compiled_forward`` module stands for its whole subtree."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    if getattr(module, "compiled_forward", False):
        yield module
        return
    if any(True for _ in module.parameters(recurse=False)):
        yield module
    for child in module.children():
        yield from _gather_hook_sites(child, seen)


def wrap_chunks(chunks: List[nn.Module], config: OptimizerConfig, ps: ParallelState):
    """(ddp_chunks, no_sync_func, finalize_fn) for the training loop and the schedules."""
    ddp_chunks = [c if isinstance(c, DistributedDataParallel)
                  else DistributedDataParallel(c, config, ps) for c in chunks]

    @contextlib.contextmanager
    def no_sync():
        with contextlib.ExitStack() as stack:
            for c in ddp_chunks:
                stack.enter_context(c.no_sync())
            yield

    def finalize(_chunks=None) -> None:
        finalize_model_grads_ddp(ddp_chunks, ps)

    return ddp_chunks, no_sync, finalize
