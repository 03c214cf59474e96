"""ZeRO stage 3: parameters, gradients and optimizer states sharded over data parallelism.

docs/theory.md (ZeRO, stage 3): every rank keeps 1/N of everything, 16Ψ/N bytes with mixed-precision
Adam, and pays 3Ψ of communication per step instead of DP's 2Ψ: the parameters are all-gathered
once in forward, once more in backward, and the gradients are reduce-scattered.

Sharding unit. Each transformer layer is one unit; so is the embedding, and so is the group
(final norm + output layer). With tied embeddings on one stage the output layer multiplies by the
embedding weight, so the embedding and the head are *one* unit with two forward uses (the
embedding at the start, the head at the end): the shared weight then lives in exactly one flat
buffer and its two gradient contributions meet before a single reduce-scatter (documented in
docs/zero3.md). A unit's parameters are packed, in ``named_parameters`` order, into one flat
buffer, each starting at a multiple of 64 elements, the buffer padded to a multiple of lcm(N, 128)
(param_and_grad_buffer.packed, the grad buffers' rule); rank r owns elements [r*S, (r+1)*S) with
S = padded/N. Outside its use a rank holds only that shard (plus, in the optimizer's view, the
fp32 master (the shard itself in fp32), the fp32 gradient shard and the Adam moments), and each
``param.data`` is a size-0 placeholder.

The life of a unit in one micro-batch (docs/zero3.md draws it):

  forward pre-hook   all-gather the flat buffer (or wait for the prefetch); params become views of
                     it; issue the prefetch of the next ``depth`` units (async all-gather)
  forward hook       free the gathered storage (``untyped_storage().resize_(0)``), except after
                     the last use in forward, which backward needs at once (FSDP's choice);
                     register the pre-backward hook on the output
  pre-backward       (a hook on the output's gradient) re-gather (normally already prefetched),
                     point ``param.grad`` at views of a zeroed flat gradient buffer, prefetch the
                     previous ``depth`` units. The embedding's backward reads no weights (it
                     scatter-adds gradient rows), so it is not re-gathered: params get their full
                     shape as zero-stride views of one element, just for autograd's bookkeeping
  post-backward      (post-accumulate-grad hooks: every parameter's gradient has landed)
                     async reduce-scatter of the flat gradient — it overlaps the previous unit's
                     backward — summed into the fp32 gradient shard (micro-batches accumulate
                     there), then free the full gradient and the full parameters.

Autograd keeps the views of the flat buffer that the forward saved; because we resize the *same*
storage back and all-gather into it, those saved views see the parameters again in backward
without the forward ever holding them. Activation recomputation re-runs a unit's forward inside
backward: the pre-hook is idempotent (gathered: nothing to do; in flight: wait), and during
backward the forward hook does not free (the unit's backward follows immediately).

Expert parallelism (EP > 1, docs/moe.md): a MoE layer's expert weights differ between EP ranks
and are the same only over the expert-data-parallel group, so they are a unit of their own
(``layers.<k>.experts``, used by the same layer's forward) gathered and reduce-scattered over that
group; the rest of the layer shards over DP x CP as ever.

Scope: any TP/SP layout, and pipelining with 1F1B or interleaved 1F1B: each pipeline chunk is a
Zero3Model of its own, whose units are its layers plus the embedding / head where the chunk has
them. A micro-batch's backward may come after later micro-batches' forwards: the forward's saved
views survive the reshard because the storage is resized, never replaced, and every backward
re-gathers what it reads. A tied embedding split over stages is two one-parameter units (one per
copy) whose gradient shards are summed over the embedding group in ``finalize_grads``. Gradient
accumulation: each micro-batch's backward reduce-scatters into the fp32 shard, so ``no_sync`` is
not needed and is a no-op; the cost is 3Ψ per micro-batch, as in FSDP. Deferred weight gradients
(zb-h1's WeightGradStore) are refused: they would need the unit's full parameters and gradient
alive until the W pass.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from megalite import collectives as C
from megalite.config import OptimizerConfig
from megalite.distributed.param_and_grad_buffer import packed
from megalite.param_meta import param_meta
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import WeightGradStore

SHARDED, GATHERING, FULL = "sharded", "gathering", "full"
IDLE, FORWARD, BACKWARD = "idle", "forward", "backward"


@dataclass
class Segment:
    """Where (part of) one parameter falls inside this rank's shard: shard[start:end] holds
    param.view(-1)[param_start:param_start + end - start]."""

    param_index: int
    start: int
    end: int
    param_start: int


@dataclass
class Use:
    """One place in the forward where a unit's parameters are needed: modules ``first`` .. ``last``
    run consecutively; ``owned`` are the unit's parameters whose backward ends with this use."""

    unit: "ShardedUnit"
    index: int  # position in the forward order of all uses
    first: nn.Module
    last: nn.Module
    owned: List[int] = field(default_factory=list)  # indices into unit.params
    # The embedding lookup's backward is a scatter-add of the output gradient into the looked-up
    # rows: it never reads the weights, so its backward needs no all-gather (only the gradient
    # buffer). This saves the largest unit's backward gather (vocab x hidden).
    backward_reads_params: bool = True


class ShardedUnit:
    """One flat, padded, DP-sharded parameter buffer and its gradient and fp32 master shards."""

    def __init__(self, name: str, named_params: List[Tuple[str, nn.Parameter]], ps: ParallelState,
                 compute_dtype: torch.dtype, device: torch.device, expert: bool = False):
        self.name = name
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        # ZeRO shards over DP x CP (parallel_state.py); an expert unit over the ranks that hold
        # the same experts, the expert-data-parallel group (the same group at EP 1)
        self.expert = expert
        self.dp_group = ps.edp_group if expert else ps.dp_cp_group
        self.dp_size = C.group_size(self.dp_group)
        self.dp_rank = C.group_rank(self.dp_group)
        # Padding to a multiple of N makes every shard the same size (all-gather/reduce-scatter
        # need equal pieces); the padding is zero and stays zero under AdamW.
        self.offsets, self.padded = packed(self.numels, self.dp_size)
        self.shard_size = self.padded // self.dp_size
        self.compute_dtype = compute_dtype
        self.device = device
        lo = self.dp_rank * self.shard_size
        hi = lo + self.shard_size
        self.segments: List[Segment] = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                self.segments.append(Segment(i, a - lo, b - lo, a - off))

        with torch.no_grad():
            flat = torch.zeros(self.padded, dtype=torch.float32, device=device)
            for p, off, n in zip(self.params, self.offsets, self.numels):
                flat[off:off + n].copy_(p.detach().reshape(-1))
            # fp32 master shard; in fp32 it *is* the shard that forward gathers (docs/theory.md: the
            # params are already fp32, K = 8), so no second copy exists.
            self.main = flat[lo:hi].clone()
            del flat
            self.shard = (self.main if compute_dtype == torch.float32
                          else self.main.to(compute_dtype))
        self.grad = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        # The full buffers exist as tensor objects for the unit's whole life, with storage only
        # while gathered: the views autograd saves in forward alias this storage.
        self.full = torch.empty(self.padded, dtype=compute_dtype, device=device)
        self.full_grad = torch.empty(self.padded, dtype=compute_dtype, device=device)
        self._free(self.full)
        self._free(self.full_grad)
        self.state = SHARDED
        self.work = None
        self.grad_views: Optional[List[torch.Tensor]] = None
        self.done: set = set()  # indices of params whose gradient landed in this backward
        self.uses: List[Use] = []
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=device)
        self._one = torch.zeros(1, dtype=compute_dtype, device=device)
        self._set_placeholders()

    # ---------------------------------------------------------------------------------- storage
    @staticmethod
    def _free(t: torch.Tensor) -> None:
        t.untyped_storage().resize_(0)

    @staticmethod
    def _alloc(t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().nbytes() != nbytes:
            t.untyped_storage().resize_(nbytes)

    def full_bytes(self) -> int:
        return self.padded * self.full.element_size()

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()

    def _set_placeholders(self) -> None:
        for p in self.params:
            p.data = self._placeholder

    def set_shape_only(self) -> None:
        """Params with their full shapes but no memory (zero-stride views of one element): enough
        for autograd to accumulate into param.grad when the backward reads no parameter values."""
        if self.state == SHARDED:
            for p, shape in zip(self.params, self.shapes):
                p.data = self._one.expand(shape)

    def _set_views(self) -> None:
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.data = self.full[off:off + n].view(shape)

    # ------------------------------------------------------------------------- gather / reshard
    def issue_gather(self, async_op: bool, tag: str) -> bool:
        """Start the all-gather if the unit is sharded; True if one was issued."""
        if self.state != SHARDED:
            return False
        self._alloc(self.full)
        self.work = C.all_gather_into_tensor(self.full, self.shard, group=self.dp_group,
                                             async_op=async_op, tag=tag)
        self.state = GATHERING
        return True

    def wait_gather(self) -> None:
        if self.state == GATHERING:
            if self.work is not None:
                self.work.wait()
                self.work = None
            self.state = FULL
            self._set_views()

    def reshard(self) -> None:
        if self.state != SHARDED:
            self.wait_gather()
            self._free(self.full)
            self.state = SHARDED
        self._set_placeholders()

    # ---------------------------------------------------------------------------- gradients
    def prepare_grads(self) -> None:
        """Point each param.grad at a view of a zeroed flat gradient buffer, so autograd's
        in-place accumulation writes straight into the buffer the reduce-scatter sends."""
        if self.grad_views is None:
            self._alloc(self.full_grad)
            self.full_grad.zero_()
            self.grad_views = [self.full_grad[off:off + n].view(shape) for off, n, shape
                               in zip(self.offsets, self.numels, self.shapes)]
        for p, g in zip(self.params, self.grad_views):
            if p.grad is None:
                p.grad = g

    def collect_stray_grads(self) -> None:
        """A gradient that autograd allocated itself (no pre-backward ran) joins the buffer."""
        for p, g in zip(self.params, self.grad_views):
            if p.grad is not None and p.grad is not g:
                g.add_(p.grad.to(g.dtype))
            p.grad = None

    def release_grad_buffer(self) -> None:
        self.grad_views = None
        self._free(self.full_grad)


def unit_plan(model: nn.Module, split_experts: bool = False
              ) -> List[Tuple[str, List[Tuple[nn.Module, nn.Module, list]]]]:
    """The sharding units of a GPTModel chunk, in flat-buffer order (the rules of the module
    docstring): ``(unit name, uses)`` with one ``(first module, last module, [(param name,
    param)])`` per forward use. Zero3Model and the checkpoint converter (which runs it on a model
    built on the meta device) both take the layout from here. ``split_experts`` (EP > 1): a
    layer's expert weights are a unit of their own, ``layers.<k>.experts``, used by the same
    layer, since they shard over another group (ShardedUnit)."""

    def params_of(prefix: str, module: nn.Module):
        return [(f"{prefix}.{n}", p) for n, p in module.named_parameters()]

    pre = getattr(model, "pre_process", True)
    post = getattr(model, "post_process", True)
    tied = pre and post and model.output_layer.weight is None
    units = []
    if pre:
        emb = params_of("embedding", model.embedding)
        if tied:
            head = (params_of("final_layernorm", model.final_layernorm)
                    + params_of("output_layer", model.output_layer))
            units.append(("embedding+output", [(model.embedding, model.embedding, emb),
                                               (model.final_layernorm, model.output_layer, head)]))
        else:
            # A tied embedding split over pipeline stages (pp > 1) has a copy on the last stage
            # too: each copy is a unit of its own, so both have the same flat layout and their
            # reduce-scattered gradient shards line up element for element for the all-reduce
            # over the embedding group (finalize_grads).
            own = [np_ for np_ in emb if param_meta(np_[1]).tied_embedding]
            rest = [np_ for np_ in emb if not param_meta(np_[1]).tied_embedding]
            units += [(name, [(model.embedding, model.embedding, nps)]) for name, nps in
                      (("embedding.word_embeddings", own), ("embedding", rest)) if nps]
    for k, layer in model.layers.items():
        nps = params_of(f"layers.{k}", layer)
        experts = [np_ for np_ in nps if split_experts and param_meta(np_[1]).expert]
        units += [(name, [(layer, layer, part)]) for name, part in (
            (f"layers.{k}", [np_ for np_ in nps if np_ not in experts]),
            (f"layers.{k}.experts", experts)) if part]
    if post and not tied:
        norm, out = model.final_layernorm, model.output_layer
        norm_params, out_params = params_of("final_layernorm", norm), params_of("output_layer", out)
        if any(param_meta(p).tied_embedding for _, p in out_params):  # the last stage's copy
            if len(out_params) != 1:
                raise RuntimeError("ZeRO-3: a shared output layer must hold its weight only")
            units += [("output", [(norm, norm, norm_params)]),
                      ("output_layer", [(out, out, out_params)])]
        else:
            units.append(("output", [(norm, out, norm_params + out_params)]))
    return units


class Zero3Model(nn.Module):
    """A GPTModel whose parameters are ZeRO-3 sharded; forward/backward as the plain model.

    Build it with :func:`shard_model_zero3`. Its :meth:`forward` has the wrapped model's
    signature. After backward the gradients are in ``unit.grad`` (fp32 shards);
    :class:`megalite.optimizer.zero3_optimizer.Zero3Optimizer` steps on them.
    """

    def __init__(self, model: nn.Module, ps: ParallelState, opt_cfg: OptimizerConfig):
        super().__init__()
        self.module = model
        self.ps = ps
        self.opt_cfg = opt_cfg
        self.zero_stage = 3
        self.dp_size = C.group_size(ps.dp_cp_group)
        # Prefetch is stage 3's default (the `depth` next units' all-gathers in flight while one
        # computes); --zero3-prefetch-depth 0 turns it off and makes every collective blocking.
        self.prefetch_depth = int(opt_cfg.zero3_prefetch_depth)
        self.overlap = self.prefetch_depth > 0
        # the model's dtype (ModelConfig.params_dtype) is the compute dtype; masters are fp32
        compute = next(model.parameters()).dtype
        self.compute_dtype = compute
        self.units: List[ShardedUnit] = []
        self.uses: List[Use] = []
        self._build_units(model, compute)
        self.phase = IDLE
        self._pending_rs: List[tuple] = []  # (unit, fp32 out, work, fp32 send)
        self._grads_finalized = True
        self._handles = []
        self._install_hooks()
        # Instrumentation for tests and benchmarks (cheap; off unless asked).
        self.record = False
        self.trace: List[Tuple[str, str, str, float]] = []
        self.peak_gathered_bytes = {FORWARD: 0, BACKWARD: 0}
        self.peak_gathered_units = {FORWARD: 0, BACKWARD: 0}

    def __getattr__(self, name: str):
        # The pipeline schedules use the chunk's config and set_input_tensor: pass them through.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    # ----------------------------------------------------------------------------- structure
    def _build_units(self, model: nn.Module, dtype: torch.dtype) -> None:
        device = next(model.parameters()).device
        split = self.ps.experts_apart  # experts over another group than DP x CP
        for name, uses in unit_plan(model, split_experts=split):
            nps = [np_ for _, _, nps in uses for np_ in nps]
            unit = ShardedUnit(name, nps, self.ps, dtype, device,
                               expert=split and param_meta(nps[0][1]).expert)
            k = 0
            for first, last, nps in uses:
                unit.uses.append(Use(unit, -1, first, last, list(range(k, k + len(nps))),
                                     backward_reads_params=first is not getattr(
                                         model, "embedding", None)))
                k += len(nps)
            self.units.append(unit)
        # forward order: every unit's first use in plan order, then a tied head's second use
        self.uses = [u.uses[0] for u in self.units] + [x for u in self.units for x in u.uses[1:]]
        for i, use in enumerate(self.uses):
            use.index = i
        covered = {id(p) for u in self.units for p in u.params}
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise RuntimeError(f"ZeRO-3 units do not cover parameters {missing}")

    def _install_hooks(self) -> None:
        for use in self.uses:
            self._handles.append(use.first.register_forward_pre_hook(
                lambda m, args, use=use: self._pre_forward(use)))
            self._handles.append(use.last.register_forward_hook(
                lambda m, args, out, use=use: self._post_forward(use, out)))
        for unit in self.units:
            for use in unit.uses:
                for i in use.owned:
                    self._handles.append(unit.params[i].register_post_accumulate_grad_hook(
                        lambda p, unit=unit, use=use, i=i: self._post_accumulate(unit, use, i)))

    # ------------------------------------------------------------------------- instrumentation
    def _event(self, what: str, unit: ShardedUnit, kind: str = "") -> None:
        if self.record:
            self.trace.append((what, unit.name, kind, time.perf_counter()))

    def _note_memory(self) -> None:
        phase = BACKWARD if self.phase == BACKWARD else FORWARD
        gathered = [u for u in self.units if u.gathered_bytes() > 0]
        nbytes = sum(u.gathered_bytes() for u in gathered)
        self.peak_gathered_bytes[phase] = max(self.peak_gathered_bytes[phase], nbytes)
        self.peak_gathered_units[phase] = max(self.peak_gathered_units[phase], len(gathered))

    def reset_stats(self) -> None:
        self.trace = []
        self.peak_gathered_bytes = {FORWARD: 0, BACKWARD: 0}
        self.peak_gathered_units = {FORWARD: 0, BACKWARD: 0}

    # --------------------------------------------------------------------------------- gather
    def _gather(self, unit: ShardedUnit, kind: str, async_op: bool) -> None:
        if unit.issue_gather(async_op, tag=f"zero3_all_gather_{kind}"):
            self._event("ag_issue", unit, kind)

    def _prefetch(self, use: Use, step: int) -> None:
        """Issue the async all-gathers of the next ``depth`` uses' units in direction ``step``."""
        kind = "fwd" if step > 0 else "bwd"
        for d in range(1, self.prefetch_depth + 1):
            j = use.index + step * d
            if not 0 <= j < len(self.uses) or self.uses[j].unit is use.unit:
                continue
            if step < 0 and not self.uses[j].backward_reads_params:
                continue  # nothing to gather for a backward that reads no weights
            self._gather(self.uses[j].unit, kind, async_op=True)

    def _ensure_full(self, use: Use, kind: str, step: int) -> None:
        unit = use.unit
        # Own gather first, then the prefetch behind it: gloo runs a group's collectives in issue
        # order, so the unit needed now is never queued behind one needed later.
        self._gather(unit, kind, async_op=self.overlap)
        if self.overlap and step != 0:
            self._prefetch(use, step)
        self._note_memory()
        if unit.state == GATHERING:
            unit.wait_gather()
            self._event("ag_done", unit, kind)

    # ------------------------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        if self.phase == BACKWARD:
            raise RuntimeError("ZeRO-3: a new forward started inside a backward of the same "
                               "model chunk")
        self.phase = FORWARD
        self._grads_finalized = False if torch.is_grad_enabled() else self._grads_finalized
        out = self.module(*args, **kwargs)
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(self._on_backward_begin)
        else:
            self._reshard_all()
            self.phase = IDLE
        return out

    def _pre_forward(self, use: Use) -> None:
        if self.phase == BACKWARD:  # recomputation inside backward: gather, the backward follows
            self._ensure_full(use, "bwd", step=0)
        else:
            self._ensure_full(use, "fwd", step=+1)
        self._event("fwd_begin", use.unit)

    def _post_forward(self, use: Use, out) -> None:
        self._event("fwd_end", use.unit)
        grad_needed = torch.is_grad_enabled()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g, use=use: self._pre_backward(use))
        if self.phase == BACKWARD:
            return
        last = use.index == len(self.uses) - 1
        if not (last and grad_needed):
            use.unit.reshard()
            self._event("reshard", use.unit)

    # ------------------------------------------------------------------------------ backward
    def _on_backward_begin(self, grad):
        self.phase = BACKWARD
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        return None

    def _pre_backward(self, use: Use):
        if WeightGradStore.is_capturing():
            raise RuntimeError("ZeRO-3 does not support deferred weight gradients (zb-h1 "
                               "pipeline schedule): the unit's full parameters would have to live "
                               "until the W pass; use --zero-stage 1/2 or another schedule")
        self.phase = BACKWARD
        if use.backward_reads_params:
            self._ensure_full(use, "bwd", step=-1)
        else:
            use.unit.set_shape_only()
            if self.overlap:
                self._prefetch(use, -1)
        use.unit.prepare_grads()
        self._event("bwd_begin", use.unit)
        return None

    def _post_accumulate(self, unit: ShardedUnit, use: Use, index: int) -> None:
        unit.done.add(index)
        if not all(i in unit.done for i in use.owned):
            return
        if len(unit.done) == len(unit.params):
            self._reduce_scatter(unit)
        else:
            # Tied embedding+output unit after the head's backward: the embedding's backward comes
            # last, so free the parameters now but keep the gradient buffer (the shared weight's
            # two contributions are summed by autograd before it lands).
            unit.reshard()
            self._event("reshard", unit)

    def _reduce_scatter(self, unit: ShardedUnit) -> None:
        self._complete_reduce_scatters()  # at most one in flight: bounded full-gradient memory
        unit.collect_stray_grads()
        # Reduced in fp32, as stages 0-2 reduce their fp32 main_grad buffers: summing N 16-bit
        # partial gradients in 16 bits would round at every hop of the ring, so bf16 results
        # would depend on the ZeRO stage. The fp32 copy lives only until this reduce-scatter
        # completes (one at a time), and the traffic is 4 bytes per element as in stages 0-2.
        send = unit.full_grad.float()
        out = torch.empty(unit.shard_size, dtype=torch.float32, device=unit.device)
        # SUM, not mean: the loss is already divided by the global batch's token count
        # (docs/design.md, contract 4), so summing over DP ranks gives the global gradient.
        work = C.reduce_scatter_tensor(out, send, group=unit.dp_group,
                                       async_op=self.overlap, tag="zero3_reduce_scatter")
        self._event("rs_issue", unit)
        self._pending_rs.append((unit, out, work, send))
        unit.done.clear()
        unit.reshard()
        self._event("reshard", unit)
        if not self.overlap:
            self._complete_reduce_scatters()

    def _complete_reduce_scatters(self) -> None:
        for unit, out, work, _send in self._pending_rs:
            if work is not None:
                work.wait()
            unit.grad.add_(out)  # fp32 accumulation across micro-batches
            unit.release_grad_buffer()
            self._event("rs_done", unit)
        self._pending_rs = []

    def _finish_backward(self) -> None:
        """End of backward (autograd callback): flush what the hooks did not (a parameter that got
        no gradient), wait for the last reduce-scatters, free everything still gathered."""
        for unit in self.units:
            if unit.grad_views is not None and unit not in [p[0] for p in self._pending_rs]:
                self._reduce_scatter(unit)
        self._complete_reduce_scatters()
        self._reshard_all()
        self.phase = IDLE

    def _reshard_all(self) -> None:
        for unit in self.units:
            unit.reshard()

    # ------------------------------------------------------------------------ optimizer side
    @contextlib.contextmanager
    def no_sync(self):
        """Not needed: every micro-batch's gradient is reduce-scattered into the fp32 shard
        (keeping full gradients to the last micro-batch would undo stage 3's memory saving)."""
        yield

    def zero_grad_shards(self) -> None:
        for unit in self.units:
            unit.grad.zero_()
        self._grads_finalized = True

    @torch.no_grad()
    def finalize_grads(self, *unused) -> None:
        """After the last micro-batch: parameters whose gradient is partial over TP (under SP the
        norms, row-parallel biases and position embeddings, which saw only this rank's sequence
        shard; qk-norms) have their gradients summed over TP. The flat layouts are the same on
        every TP rank (same local shapes), so this is an all-reduce of the same shard segments:
        done once per step, on 1/N of the elements."""
        if self._grads_finalized:
            return
        self._complete_reduce_scatters()
        if C.group_size(self.ps.tp_group) > 1:
            pieces = [u.grad[s.start:s.end] for u in self.units for s in u.segments
                      if param_meta(u.params[s.param_index]).grad_partial_over_tp]
            if pieces:
                flat = torch.cat(pieces)
                C.all_reduce(flat, group=self.ps.tp_group, tag="tp_sp_grad_all_reduce")
                k = 0
                for piece in pieces:
                    piece.copy_(flat[k:k + piece.numel()])
                    k += piece.numel()
        # Tied embedding over pipeline stages: the first stage's input embedding and the last
        # stage's output layer are two copies of one weight, each a one-parameter unit with the
        # same padded layout on the same DP rank, so their fp32 gradient *shards* can be summed
        # over the embedding group directly (1/N of the bytes of stage 0's all-reduce). Both
        # copies then take identical AdamW steps and stay equal.
        if self.ps.pp_size > 1 and self.ps.embedding_group is not None:
            for u in self.units:
                if len(u.params) == 1 and param_meta(u.params[0]).tied_embedding:
                    C.all_reduce(u.grad, group=self.ps.embedding_group,
                                 tag="zero3_embedding_grad_all_reduce")
        self._grads_finalized = True

    # ---------------------------------------------------------------------- full-model export
    @torch.no_grad()
    def gather_flat(self, unit: ShardedUnit, shard: torch.Tensor) -> torch.Tensor:
        """All-gather a shard-shaped tensor of ``unit`` into its full flat layout (collective)."""
        full = torch.empty(unit.padded, dtype=shard.dtype, device=shard.device)
        C.all_gather_into_tensor(full, shard.contiguous(), group=unit.dp_group,
                                 tag="zero3_export_all_gather")
        return full

    def split_flat(self, unit: ShardedUnit, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {name: flat[off:off + n].view(shape).clone() for name, off, n, shape
                in zip(unit.names, unit.offsets, unit.numels, unit.shapes)}

    def local_shard_of(self, unit: ShardedUnit, named: Dict[str, torch.Tensor],
                       dtype=torch.float32) -> torch.Tensor:
        """This rank's shard of ``unit`` built from full per-parameter tensors."""
        out = torch.zeros(unit.shard_size, dtype=dtype, device=unit.device)
        for s in unit.segments:
            name = unit.names[s.param_index]
            if name not in named:
                raise KeyError(f"ZeRO-3 full state has no tensor for parameter {name}")
            src = named[name]
            if tuple(src.shape) != tuple(unit.shapes[s.param_index]):
                raise ValueError(f"{name}: full state shape {tuple(src.shape)} != this model's "
                                 f"{tuple(unit.shapes[s.param_index])} (TP layout differs?)")
            flat = src.reshape(-1)
            out[s.start:s.end].copy_(flat[s.param_start:s.param_start + s.end - s.start])
        return out

    @torch.no_grad()
    def full_state_dict(self, keep: bool = True) -> Dict[str, torch.Tensor]:
        """Every parameter by its megalite name, at full (this TP rank's) shape, in the model's
        dtype, from the fp32 masters: the same keys and shapes as the plain GPTModel's
        state_dict. Collective over DP: every DP rank must call it. ``keep=False`` takes part in
        the gathers but keeps nothing (the checkpoint writer keeps the result on DP rank 0 only,
        so the other ranks never hold more than one gathered unit)."""
        out = {}
        for unit in self.units:
            flat = self.gather_flat(unit, unit.main)
            if keep:
                out.update({k: v.to(self.compute_dtype)
                            for k, v in self.split_flat(unit, flat).items()})
            del flat
        # registration order, as the plain model's state_dict (units group them differently),
        # then its persistent buffers (the MoE expert bias), which no unit holds
        out = {n: out[n] for n, _ in self.module.named_parameters() if n in out}
        if keep:
            own = self.module.state_dict()
            out.update({k: own[k].detach().clone() for k in self._buffer_names()})
        return out

    def _buffer_names(self) -> List[str]:
        params = {n for n, _ in self.module.named_parameters()}
        return [k for k in self.module.state_dict() if k not in params]

    @torch.no_grad()
    def load_full_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Load full per-parameter weights (any DP size saved them) into the local shards. Local:
        each rank slices out its own shard, no communication."""
        for unit in self.units:
            unit.main.copy_(self.local_shard_of(unit, state))
            if unit.shard is not unit.main:
                unit.shard.copy_(unit.main)

    def state_dict(self, *args, **kwargs):
        """The consolidated model (:meth:`full_state_dict`), as a stage-0 model's state_dict, so
        checkpoints, ``--finetune`` and the conversion tools see one format whatever the ZeRO
        stage. Collective over DP, as FSDP's full state dict."""
        return self.full_state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full model state dict (a stage-3 checkpoint's consolidated model, or any other
        stage's): each DP rank keeps its slice. A resumed run's optimizer state then overwrites
        the fp32 masters (exact for 16-bit params, whose model file is rounded)."""
        buffers = set(self._buffer_names())
        names = {n for u in self.units for n in u.names}
        missing = sorted((names | buffers) - set(state_dict))
        unexpected = sorted(set(state_dict) - names - buffers)
        if strict and (missing or unexpected):
            raise RuntimeError(f"ZeRO-3 load_state_dict: missing {missing[:3]}, unexpected "
                               f"{unexpected[:3]}")
        if not missing:
            self.load_full_state_dict(state_dict)
            self.module.load_state_dict({k: state_dict[k] for k in buffers}, strict=False)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ---------------------------------------------------------------------------- accounting
    def shard_elements(self) -> int:
        return sum(u.shard_size for u in self.units)

    def expected_step_bytes(self, num_microbatches: int = 1) -> Dict[str, int]:
        """The collectives' bytes per step predicted by the schedule (docs/theory.md: 3Ψ, ring
        factor (N−1)/N on padded sizes): each forward use gathers; each backward use that reads the
        parameters gathers, except the first one in backward when it is the last forward use
        (still full); one reduce-scatter per unit per micro-batch."""
        if all(u.dp_size == 1 for u in self.units):
            return {}
        fwd = bwd = rs = 0
        for unit in self.units:  # each over its own group (EP > 1: experts over EDP)
            n = unit.dp_size
            b = unit.full_bytes() * (n - 1) // n
            last = len(self.uses) - 1
            fwd += len(unit.uses) * b
            bwd += b * sum(1 for use in unit.uses
                           if use.backward_reads_params and use.index != last)
            rs += unit.padded * 4 * (n - 1) // n  # gradients are reduced in fp32
        m = num_microbatches
        return {"zero3_all_gather_fwd": m * fwd, "zero3_all_gather_bwd": m * bwd,
                "zero3_reduce_scatter": m * rs}


def shard_model_zero3(model: nn.Module, ps: ParallelState, opt_cfg: OptimizerConfig) -> Zero3Model:
    """Shard a GPTModel's parameters for ZeRO stage 3 (one unit per layer, embedding, head)."""
    return Zero3Model(model, ps, opt_cfg)


def wrap_chunks_zero3(model_chunks, cfg, ps: ParallelState):
    """The training loop's data-parallel seam for --zero-stage 3 (megalite.training.
    wrap_model_for_data_parallel): (chunks, no_sync_func, finalize_model_grads_func). Each
    pipeline chunk (one per virtual stage) is sharded on its own: its layers, and its embedding
    or head where it has them, are its units."""
    models = [shard_model_zero3(chunk, ps, cfg.optimizer) for chunk in model_chunks]

    def finalize(chunks):
        for chunk in chunks:
            chunk.finalize_grads()

    # no_sync is None: each micro-batch's gradient is reduce-scattered into the fp32 shard.
    return models, None, finalize
