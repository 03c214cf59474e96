"""The ZeRO distributed optimizer (stages 0, 1, 2) over DistributedDataParallel's buffers.

ZeRO (Rajbhandari et al. 2020; docs/theory.md, "ZeRO"): with N data-parallel ranks, rank r owns
shard r of every bucket (``bucket[r*B/N:(r+1)*B/N]``, param_and_grad_buffer.py) and keeps the fp32
master parameters and the Adam moments of that shard only. A step is

    reduce-scatter grads (DDP, during/after backward)  ->  unscale, overflow check, clip
    ->  AdamW on the flat shard  ->  copy master -> model param shard
    ->  all-gather each bucket's params (at once, or overlapped with the next forward)

which moves the same 2Ψ elements per rank as the all-reduce of plain DP (docs/theory.md: all-reduce
= reduce-scatter + all-gather) while cutting optimizer memory by N. Stage 2 additionally keeps only
the gradient shard (ddp.py). Stage 0 is the same code with the "shard" = the whole bucket: every
rank all-reduces and steps the full model.

Per-rank model-state bytes (megalite's layout; measured by megalite/memory.py):

    fp32:        params 4Ψ + grads 4Ψ (stage 2: 4Ψ/N) + Adam 8Ψ/N (stage 0: 8Ψ)   [masters = params]
    bf16/fp16:   params 2Ψ + fp32 grads 4Ψ (stage 2: 4Ψ/N) + masters 4Ψ/N + Adam 8Ψ/N
                 (stage 0: 4Ψ + 8Ψ), i.e. Megatron's 6 + 12/N bytes per parameter for stage 1.

The step (unscale, overflow check, norm, clipping, AdamW on the flat shards) is
``optimizer.ShardedAdamW``'s, shared with ZeRO-3. Shards straddle parameters, so weight decay is
applied per segment (the part of a parameter inside the shard): matrices decay, biases and norm
weights (dim <= 1) do not — the same rule as the plain optimizer.

Checkpoints: :meth:`state_dict` is this DP rank's shard (``sharded_state_dict_per_dp_rank``: the
checkpoint writer saves one file per DP rank) and loads only at the same DP size and layout. To
change the DP size, save :meth:`gather_full_optimizer_state` (collective over DP; unsharded fp32
params and moments keyed by parameter name) and load it with :meth:`load_full_optimizer_state`, which
re-splits it for the new layout without communication. See docs/data_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn as nn

from megalite import collectives as C
from megalite.config import ConfigError, OptimizerConfig
from megalite.distributed.ddp import DistributedDataParallel
from megalite.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer
from megalite.optimizer.clip_grads import counts_for_norm
from megalite.optimizer.optimizer import ADAM_KINDS, ShardedAdamW, merge_pieces
from megalite.parallel_state import ParallelState

FULL_STATE_FORMAT = "megalite.zero.full/v1"
SHARD_FORMAT = "megalite.zero.shard/v1"


@dataclass
class Segment:
    """The part [lo, hi) of a flat shard that belongs to one parameter (elements [plo, phi) of it)."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    plo: int
    phi: int


@dataclass
class Shard:
    """What this rank's optimizer owns of one bucket."""

    ddp: DistributedDataParallel
    buffer: ParamAndGradBuffer
    bucket: Bucket
    start: int  # buffer coordinates
    end: int
    master: torch.Tensor  # fp32; for fp32 models a view of the param buffer (no copy)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    segments: List[Segment] = field(default_factory=list)

    @property
    def model_param_shard(self) -> torch.Tensor:
        return self.buffer.param_data[self.start:self.end]

    @property
    def grad(self) -> torch.Tensor:
        return self.buffer.grad_shard(self.bucket)


class DistributedOptimizer(ShardedAdamW):
    """AdamW over this rank's ZeRO shards; the interface of megalite/optimizer/optimizer.py."""

    def __init__(self, model_chunks, config: OptimizerConfig, ps: ParallelState, **unused):
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        for c in chunks:
            if not isinstance(c, DistributedDataParallel):
                raise ConfigError(
                    "--zero-stage >= 1 / --use-distributed-optimizer needs the model chunks wrapped "
                    "in megalite.distributed.DistributedDataParallel (training.py's "
                    "wrap_model_for_data_parallel does it)")
        self._init_shared(config, ps)
        self.chunks = chunks
        self.zero_stage = config.zero_stage
        self.dp_sharded = self.zero_stage >= 1
        self.dp_group = ps.dp_cp_group  # ZeRO shards over DP x CP (parallel_state.py)
        self.dp_size = C.group_size(self.dp_group)
        self.dp_rank = C.group_rank(self.dp_group)
        names: Dict[str, nn.Parameter] = {}
        self.shards: List[Shard] = []
        for ci, ddp in enumerate(chunks):
            for buf in ddp.grad_buffers:
                for b in buf.buckets:
                    self.shards.append(self._make_shard(ci, ddp, buf, b, names))
        self.param_names = names
        self.masters = [s.master for s in self.shards]
        self.exp_avg = [s.exp_avg for s in self.shards]
        self.exp_avg_sq = [s.exp_avg_sq for s in self.shards]
        self.runs = [[(g.lo, g.hi, 0 if g.param.dim() > 1 else 1) for g in s.segments]
                     for s in self.shards]
        self.norm_runs = [[(g.lo, g.hi) for g in s.segments
                           if counts_for_norm(g.param, ps.tp_rank, ps.is_pipeline_first_stage)]
                          for s in self.shards]

    # ------------------------------------------------------------------------------ layout
    def _key(self, ci: int, name: str) -> str:
        return name if len(self.chunks) == 1 else f"chunk{ci}.{name}"

    def _make_shard(self, ci, ddp, buf, bucket, names) -> Shard:
        start, end = buf.shard_range(bucket)
        model_shard = buf.param_data[start:end]
        if buf.param_dtype == torch.float32:
            master = model_shard  # fp32 params are their own masters (docs/theory.md: K = 8)
        else:
            master = model_shard.detach().clone().float()
        shard = Shard(ddp, buf, bucket, start, end, master,
                      torch.zeros_like(master, dtype=torch.float32),
                      torch.zeros_like(master, dtype=torch.float32))
        for slot in bucket.slots:
            a, b = max(slot.start, start), min(slot.end, end)
            key = self._key(ci, slot.name)
            if key in names and names[key] is not slot.param:
                raise ValueError(f"parameter name {key} appears twice among the model chunks")
            names[key] = slot.param
            if a < b:
                shard.segments.append(Segment(key, slot.param, a - start, b - start,
                                              a - slot.start, b - slot.start))
        return shard

    # ---------------------------------------------------------------------------- interface
    def zero_grad(self, set_to_none: bool = True) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def _finish_grads(self) -> None:
        for c in self.chunks:  # normally done by the schedule's finalize hook; harmless twice
            c.finish_grad_sync()
        for c in self.chunks:
            c.finish_param_sync()  # never write params while last step's gather is in flight

    def _grads(self) -> List[torch.Tensor]:
        return [s.grad for s in self.shards]

    def _publish(self) -> None:
        self._copy_masters_to_model()
        for c in self.chunks:
            c.start_param_sync()

    def _copy_masters_to_model(self) -> None:
        for s in self.shards:
            if s.master.data_ptr() != s.model_param_shard.data_ptr():
                s.model_param_shard.copy_(s.master)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Masters <- model params (after loading model weights without optimizer state)."""
        for c in self.chunks:
            c.finish_param_sync()
        for s in self.shards:
            if s.master.data_ptr() != s.model_param_shard.data_ptr():
                s.master.copy_(s.model_param_shard.float())

    # -------------------------------------------------------------------------- checkpoints
    def _layout(self) -> List[List[int]]:
        return [[s.bucket.numel, s.start - s.bucket.offset, s.end - s.bucket.offset]
                for s in self.shards]

    def state_dict(self) -> dict:
        """This DP rank's shard (tensors and primitives only: safe for weights_only loading)."""
        for c in self.chunks:
            c.finish_param_sync()
        return {
            "format": SHARD_FORMAT, "zero_stage": self.zero_stage, "dp_size": self.dp_size,
            "dp_rank": self.dp_rank, **self._common_state(), "layout": self._layout(),
            "shards": [{"master": s.master.detach().clone(), "exp_avg": s.exp_avg.clone(),
                        "exp_avg_sq": s.exp_avg_sq.clone(),
                        # enough to rebuild the unsharded state from all DP ranks' files
                        "segments": [[g.name, g.lo, g.hi, g.plo, g.phi, list(g.param.shape)]
                                     for g in s.segments]} for s in self.shards],
        }

    def shard_fits(self, sd: dict) -> bool:
        """Whether a per-DP-rank state dict was saved with this DP size and bucket layout."""
        return (sd.get("format") == SHARD_FORMAT and sd.get("dp_size") == self.dp_size
                and sd.get("dp_rank") == self.dp_rank
                and [list(x) for x in sd.get("layout", [])] == self._layout())

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if sd.get("format") == FULL_STATE_FORMAT:
            return self.load_full_optimizer_state(sd)
        if not self.shard_fits(sd):
            raise ValueError(
                f"optimizer shard was saved with DP size {sd.get('dp_size')} and a different "
                f"bucket layout; this run has DP size {self.dp_size}. Load the unsharded state "
                f"with load_full_optimizer_state() (docs/data_parallel.md)")
        self._load_common(sd)
        for c in self.chunks:
            c.finish_param_sync()
        for s, saved in zip(self.shards, sd["shards"]):
            s.exp_avg.copy_(saved["exp_avg"])
            s.exp_avg_sq.copy_(saved["exp_avg_sq"])
            s.master.copy_(saved["master"])
        self._copy_masters_to_model()
        for c in self.chunks:
            c.start_param_sync(overlap=False)

    @torch.no_grad()
    def gather_full_optimizer_state(self) -> dict:
        """Unsharded fp32 params and Adam moments keyed by parameter name (collective over DP).

        Every DP rank returns the same dict; names are the chunk's own (prefixed "chunk{i}." when
        there are several chunks). The params/moments are this rank's TP/PP slice, unsharded over DP.
        """
        for c in self.chunks:
            c.finish_param_sync()
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        for s in self.shards:
            full = {}
            for kind, local in zip(ADAM_KINDS, (s.master, s.exp_avg, s.exp_avg_sq)):
                if self.zero_stage == 0:
                    full[kind] = local.detach().clone()
                else:
                    full[kind] = torch.empty(s.bucket.numel, dtype=torch.float32,
                                             device=local.device)
                    C.all_gather_into_tensor(full[kind], local.detach().float(),
                                             group=self.dp_group, tag="checkpoint_all_gather")
            ci = self.chunks.index(s.ddp)
            for slot in s.bucket.slots:
                lo = slot.start - s.bucket.offset
                out[self._key(ci, slot.name)] = {k: v[lo:lo + slot.numel].view(slot.param.shape)
                                                 .clone() for k, v in full.items()}
        return {"format": FULL_STATE_FORMAT, **self._common_state(), "params": out}

    @torch.no_grad()
    def load_full_optimizer_state(self, full: dict) -> None:
        """Re-split an unsharded state (any DP size it came from) into this rank's shards.

        Also writes the fp32 params into the model (rounded for 16-bit models), so model and
        masters agree; no communication is needed since every rank reads the full tensors.
        """
        if full.get("format") != FULL_STATE_FORMAT:
            raise ValueError("not an unsharded ZeRO optimizer state (gather_full_optimizer_state)")
        params = full["params"]
        missing = sorted(set(self.param_names) - set(params))
        if missing:
            raise ValueError(f"optimizer state lacks parameters {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        self._load_common(full)
        for c in self.chunks:
            c.finish_param_sync()
        for name, p in self.param_names.items():
            saved = params[name]["param"]
            if tuple(saved.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state for {name} has shape {tuple(saved.shape)}, the "
                                 f"model {tuple(p.shape)}: a different TP layout?")
            p.data.copy_(saved.to(p.dtype))
        for s in self.shards:
            for seg in s.segments:
                for kind, local in zip(ADAM_KINDS, (s.master, s.exp_avg, s.exp_avg_sq)):
                    local[seg.lo:seg.hi].copy_(params[seg.name][kind].reshape(-1)[seg.plo:seg.phi])


def zero12_pieces(sds: List[dict]):
    """The per-parameter pieces (optimizer.merge_pieces) of DistributedOptimizer files: each
    shard lists its segments, so the files are read without rebuilding the bucket layout."""
    for sd in sds:
        if sd.get("format") != SHARD_FORMAT:
            raise ValueError(f"not a ZeRO-1/2 optimizer shard (format {sd.get('format')!r})")
        for shard in sd["shards"]:
            for name, lo, hi, plo, _phi, shape in shard["segments"]:
                yield name, shape, plo, {k: shard[f][lo:hi] for k, f in
                                         zip(ADAM_KINDS, ("master", "exp_avg", "exp_avg_sq"))}


def check_shard_set(sds: List[dict]) -> List[dict]:
    """Every DP rank's file exactly once, in rank order (stage 0: rank 0's, which holds all)."""
    if not sds:
        raise ValueError("no optimizer shards to merge")
    sds = sorted(sds, key=lambda sd: int(sd["dp_rank"]))
    n = int(sds[0]["dp_size"])
    if [int(sd["dp_rank"]) for sd in sds] != list(range(n)) or any(
            int(sd["dp_size"]) != n for sd in sds):
        raise ValueError(f"optimizer shards of DP ranks {[sd['dp_rank'] for sd in sds]} do not "
                         f"make up one DP group of {n} (missing or mixed files?)")
    return sds[:1] if sds[0].get("zero_stage") == 0 else sds


def merge_shard_state_dicts(shard_state_dicts: List[dict]) -> dict:
    """The unsharded state (as gather_full_optimizer_state returns) from *all* DP ranks' shards.

    For resuming at a different DP size or bucket layout: the checkpoint loader reads every
    ``distrib_optim_dp*.pt`` of one (TP, PP) rank and hands the result to
    :meth:`DistributedOptimizer.load_full_optimizer_state` (through ``load_state_dict``), which
    re-splits it. No communication: each rank merges the files itself.
    """
    sds = check_shard_set(shard_state_dicts)
    first = sds[0]
    return {"format": FULL_STATE_FORMAT, "step": first["step"],
            "param_groups": first["param_groups"], "grad_scaler": first["grad_scaler"],
            "params": merge_pieces(zero12_pieces(sds))}
