"""ZeRO stage 3: parameters, gradients and optimizer states sharded over data parallelism.

Units (a layer, the embedding, the head; a tied embedding+head on one stage is one unit with two
uses), their flat padded buffers, the life of a unit in a micro-batch (gather, free, re-gather,
reduce-scatter), prefetch, pipelining and expert units: docs/zero3.md.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from megalite import collectives as C
from megalite import torch_private as P
from megalite.config import OptimizerConfig
from megalite.distributed.ddp import all_reduce_coalesced
from megalite.distributed.param_and_grad_buffer import packed
from megalite.param_meta import param_meta
from megalite.parallel_state import ParallelState

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
    # False for the embedding, whose backward reads no weights: no backward all-gather
    # (docs/zero3.md, "The life of a unit")
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
        # over DP x CP (HSDP: one instance of it); an expert unit over the expert-data-parallel
        # group (docs/zero3.md)
        self.expert = expert
        self.dp_group = ps.edp_group if expert else ps.zero_group
        self.dp_size = C.group_size(self.dp_group)
        self.dp_rank = C.group_rank(self.dp_group)
        # equal shards for all-gather/reduce-scatter; the zero padding stays zero under AdamW
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
            # the fp32 master shard, which in fp32 *is* the shard forward gathers (no second copy)
            self.main = flat[lo:hi].clone()
            del flat
            self.shard = (self.main if compute_dtype == torch.float32
                          else self.main.to(compute_dtype))
        self.grad = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        # storage only while gathered: autograd's saved views alias it (docs/zero3.md, "The life
        # of a unit")
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
        """Params with their full shapes but no memory, for a backward that reads no weights."""
        if self.state == SHARDED:
            for p, shape in zip(self.params, self.shapes):
                p.data = self._one.expand(shape)

    def _set_views(self) -> None:
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.data = self.full[off:off + n].view(shape)

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
    """The sharding units of a GPTModel chunk (docs/zero3.md, "Sharding units"), for Zero3Model
    and the checkpoint converter: ``(unit name, uses)``, one ``(first module, last module,
    [(param name, param)])`` per forward use; ``split_experts``: experts are units of their own."""

    def params_of(prefix: str, module: nn.Module):
        return [(f"{prefix}.{n}", p) for n, p in module.named_parameters()]

    pre = getattr(model, "pre_process", True)
    post = getattr(model, "post_process", True)
    tied = pre and post and model.output_layer.weight is None
    mtp = getattr(model, "mtp", None)  # MTP's depths: a unit each, after the layers
    units = []
    if pre or mtp is not None:  # (the last stage's copy of the embedding, for MTP)
        emb = params_of("embedding", model.embedding)
        if tied:
            head = (params_of("final_layernorm", model.final_layernorm)
                    + params_of("output_layer", model.output_layer))
            units.append(("embedding+output", [(model.embedding, model.embedding, emb),
                                               (model.final_layernorm, model.output_layer, head)]))
        else:
            # each copy of a tied embedding split over stages is a unit of its own, so that the
            # two copies' gradient shards line up (docs/zero3.md, "With pipelining")
            own = [np_ for np_ in emb if param_meta(np_[1]).tied_embedding]
            rest = [np_ for np_ in emb if not param_meta(np_[1]).tied_embedding]
            units += [(name, [(model.embedding, model.embedding, nps)]) for name, nps in
                      (("embedding.word_embeddings", own), ("embedding", rest)) if nps]
    layers = [(f"layers.{k}", layer) for k, layer in model.layers.items()]
    layers += [(f"mtp.layers.{k}", layer) for k, layer in enumerate(mtp.layers if mtp else [])]
    for prefix, layer in layers:
        nps = params_of(prefix, layer)
        experts = [np_ for np_ in nps if split_experts and param_meta(np_[1]).expert]
        units += [(name, [(layer, layer, part)]) for name, part in (
            (prefix, [np_ for np_ in nps if np_ not in experts]),
            (f"{prefix}.experts", experts)) if part]
    if post and not tied:
        norm, out = model.final_layernorm, model.output_layer
        norm_params, out_params = params_of("final_layernorm", norm), params_of("output_layer", out)
        # the last stage's copy, or a head MTP's depths call again: gathered at each call
        if mtp is not None or any(param_meta(p).tied_embedding for _, p in out_params):
            if len(out_params) != 1:
                raise RuntimeError("ZeRO-3: a shared output layer must hold its weight only")
            units += [("output", [(norm, norm, norm_params)]),
                      ("output_layer", [(out, out, out_params)])]
        else:
            units.append(("output", [(norm, out, norm_params + out_params)]))
    return units


class Zero3Model(nn.Module):
    """A GPTModel whose parameters are ZeRO-3 sharded; forward/backward as the plain model. After
    backward the gradients are in ``unit.grad`` (fp32 shards), where ``Zero3Optimizer`` steps."""

    def __init__(self, model: nn.Module, ps: ParallelState, opt_cfg: OptimizerConfig):
        super().__init__()
        self.module = model
        self.ps = ps
        self.zero_stage = 3
        self.dp_size = C.group_size(ps.zero_group)
        # --zero3-prefetch-depth (docs/zero3.md, "Prefetching and overlap"); 0: all blocking
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
        self.reset_stats()

    def __getattr__(self, name: str):
        # The pipeline schedules use the chunk's config and set_input_tensor: pass them through.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

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
        self.trace: List[Tuple[str, str, str, float]] = []
        self.peak_gathered_bytes = {FORWARD: 0, BACKWARD: 0}
        self.peak_gathered_units = {FORWARD: 0, BACKWARD: 0}

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
        # own gather first: gloo runs a group's collectives in issue order, so the unit needed
        # now is never queued behind one needed later
        self._gather(unit, kind, async_op=self.overlap)
        if self.overlap and step != 0:
            self._prefetch(use, step)
        self._note_memory()
        if unit.state == GATHERING:
            unit.wait_gather()
            self._event("ag_done", unit, kind)

    def forward(self, *args, **kwargs):
        if self.phase == BACKWARD:
            raise RuntimeError("ZeRO-3: a new forward started inside a backward of the same "
                               "model chunk")
        self.phase = FORWARD
        self._grads_finalized = False if torch.is_grad_enabled() else self._grads_finalized
        out = self.module(*args, **kwargs)
        # a tensor, or the loss stage's LossOutput (a tuple) whose scalar backward starts from
        start = next((t for t in (out if isinstance(out, tuple) else (out,))
                      if torch.is_tensor(t) and t.requires_grad), None)
        if start is not None:
            start.register_hook(self._on_backward_begin)
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

    def _on_backward_begin(self, grad):
        self.phase = BACKWARD
        P.queue_backward_callback(self._finish_backward)
        return None

    def _pre_backward(self, use: Use):
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
            # the tied embedding+output unit after the head's backward: the embedding's comes
            # last, so free the parameters but keep the gradient buffer
            unit.reshard()
            self._event("reshard", unit)

    def _reduce_scatter(self, unit: ShardedUnit) -> None:
        self._complete_reduce_scatters()  # at most one in flight: bounded full-gradient memory
        unit.collect_stray_grads()
        # Reduced in fp32, as stages 0-2 reduce main_grad, so that bf16 results do not depend on
        # the ZeRO stage (docs/zero3.md, "Optimizer")
        send = unit.full_grad.float()
        out = torch.empty(unit.shard_size, dtype=torch.float32, device=unit.device)
        # SUM: the loss is already divided by the global token count (docs/design.md, contract 4)
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
        """End of backward (autograd callback): flush what the hooks did not, free the rest."""
        if any(param_meta(p).weight_grads_queued for unit in self.units for p in unit.params):
            raise RuntimeError("ZeRO-3 does not support deferred weight gradients (zb-h1 "
                               "pipeline schedule): the unit's full parameters would have to live "
                               "until the W pass; use --zero-stage 1/2 or another schedule")
        for unit in self.units:
            if unit.grad_views is not None and unit not in [p[0] for p in self._pending_rs]:
                self._reduce_scatter(unit)
        self._complete_reduce_scatters()
        self._reshard_all()
        self.phase = IDLE

    def _reshard_all(self) -> None:
        for unit in self.units:
            unit.reshard()

    @contextlib.contextmanager
    def no_sync(self):
        """A no-op (docs/zero3.md, "Communication")."""
        yield

    def zero_grad_shards(self) -> None:
        for unit in self.units:
            unit.grad.zero_()
        self._grads_finalized = True

    @torch.no_grad()
    def finalize_grads(self, *unused) -> None:
        """Sum the gradients partial over TP (flat layouts agree over TP) and a split tied
        embedding's, once per step after the last micro-batch."""
        if self._grads_finalized:
            return
        self._complete_reduce_scatters()
        # HSDP: each shard summed across the instances once a step, after the last micro-batch
        across = [C.all_reduce(u.grad, group=self.ps.replicate_group, async_op=True,
                               tag="dp_replicate") for u in self.units]
        for work in across:
            if work is not None:
                work.wait()
        pieces = [u.grad[s.start:s.end] for u in self.units for s in u.segments
                  if param_meta(u.params[s.param_index]).grad_partial_over_tp]
        all_reduce_coalesced(pieces, self.ps.tp_group, "tp_sp_grad_all_reduce")
        # the two copies' gradient shards line up (unit_plan): summed directly, 1/N of the bytes
        if self.ps.pp_size > 1 and self.ps.embedding_group is not None:
            for u in self.units:
                if len(u.params) == 1 and param_meta(u.params[0]).tied_embedding:
                    C.all_reduce(u.grad, group=self.ps.embedding_group,
                                 tag="zero3_embedding_grad_all_reduce")
        self._grads_finalized = True

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
            out[s.start:s.end].copy_(src.reshape(-1)[s.param_start:s.param_start + s.end - s.start])
        return out

    @torch.no_grad()
    def full_state_dict(self, keep: bool = True) -> Dict[str, torch.Tensor]:
        """The plain GPTModel's state_dict, from the fp32 masters. Collective over DP;
        ``keep=False`` takes part in the gathers but keeps nothing (DP ranks > 0 when saving)."""
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

    def state_dict(self, *args, **kwargs):
        """:meth:`full_state_dict`: one checkpoint format whatever the ZeRO stage (collective)."""
        return self.full_state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full model state dict (any stage's): each DP rank keeps its slice; a resumed
        run's optimizer state then overwrites the fp32 masters."""
        buffers = set(self._buffer_names())
        names = {n for u in self.units for n in u.names}
        missing = sorted((names | buffers) - set(state_dict))
        unexpected = sorted(set(state_dict) - names - buffers)
        if strict and (missing or unexpected):
            raise RuntimeError(f"ZeRO-3 load_state_dict: missing {missing[:3]}, unexpected "
                               f"{unexpected[:3]}")
        if not missing:  # each rank copies its own shards out of the full tensors
            for unit in self.units:
                unit.main.copy_(self.local_shard_of(unit, state_dict))
                if unit.shard is not unit.main:
                    unit.shard.copy_(unit.main)
            self.module.load_state_dict({k: state_dict[k] for k in buffers}, strict=False)
        return P.IncompatibleKeys(missing, unexpected)

    def shard_elements(self) -> int:
        return sum(u.shard_size for u in self.units)

    def expected_step_bytes(self, num_microbatches: int = 1) -> Dict[str, int]:
        """The collectives' bytes per step (docs/zero3.md, "Communication (3Ψ)")."""
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
    """--zero-stage 3's (chunks, no_sync_func, finalize_model_grads_func), chunk by chunk."""
    models = [shard_model_zero3(chunk, ps, cfg.optimizer) for chunk in model_chunks]

    def finalize(chunks):
        for chunk in chunks:
            chunk.finalize_grads()

    # no_sync is None: each micro-batch's gradient is reduce-scattered into the fp32 shard.
    return models, None, finalize
