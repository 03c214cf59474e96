"""The file cut of a checkpoint (TP x PP x virtual stages) and what each shard holds, read off a
model built on the meta device (docs/checkpoints.md, "Conversion and resharding")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import List, NamedTuple, Optional, Tuple

import torch

from megalite.config import V_SCHEDULES, MegaliteConfig, ModelConfig, layers_per_virtual_stage
from megalite.convert.sharding import EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME, pad_vocab
from megalite.param_meta import ParamMeta, param_meta, set_param_meta
from megalite.pipeline_parallel.partition import virtual_layer_ranges, virtual_stage
from megalite.tensor_parallel.utils import shard_tensor, unshard_tensors


@dataclass(frozen=True)
class Layout:
    """A TP x PP (x virtual stages) cut of a model: which rank's files hold which tensors (DP, CP
    and EP do not change it: their ranks' model files are identical or whole)."""

    tp: int
    pp: int
    layers_per_virtual_stage: Optional[int] = None
    decoder_first: Optional[int] = None  # uneven first/last stage (--decoder-first/last-...)
    decoder_last: Optional[int] = None
    v_schedule: Optional[str] = None  # zb-v / dualpipev: two chunks per rank in a V
    virtual_stages: Optional[int] = None  # V instead of K (layers_per_virtual_stage): L = PP V K

    @classmethod
    def of_config(cls, cfg: MegaliteConfig) -> "Layout":
        """The layout a run (or a checkpoint's args.json) uses."""
        par, tr = cfg.parallel, cfg.training
        v_schedule = tr.pipeline_schedule if tr.pipeline_schedule in V_SCHEDULES else None
        return cls(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                   None if v_schedule else cfg.layers_per_virtual_stage(),
                   tr.decoder_first_pipeline_num_layers, tr.decoder_last_pipeline_num_layers,
                   v_schedule)

    def ranges(self, num_layers: int) -> List[List[Tuple[int, int]]]:
        """``ranges[pp_rank][chunk]`` = global layer range; raises ConfigError if impossible."""
        per = self.layers_per_virtual_stage or layers_per_virtual_stage(
            num_layers, self.pp, self.virtual_stages)
        return virtual_layer_ranges(num_layers, self.pp, per,
                                    self.decoder_first, self.decoder_last,
                                    v_shape=self.v_schedule is not None)

    def num_chunks(self, num_layers: int) -> int:
        return len(self.ranges(num_layers)[0])

    def same_files(self, other: "Layout", num_layers: int) -> bool:
        """Whether both cut the model's files alike (the same TP size and layer ranges)."""
        return self.tp == other.tp and self.ranges(num_layers) == other.ranges(num_layers)

    def describe(self) -> str:
        v = f" vpp-layers={self.layers_per_virtual_stage}" if self.layers_per_virtual_stage else ""
        vee = f" {self.v_schedule}" if self.v_schedule else ""
        return f"tp={self.tp} pp={self.pp}{v}{vee}"


@dataclass(frozen=True)
class Chunk:
    pp_rank: int
    index: int  # chunk index on its pipeline rank (partition.virtual_stage gives its stage)
    layer_range: Tuple[int, int]
    pre: bool  # owns the embedding
    post: bool  # owns the final norm and output layer


def chunks_of(layout: Layout, num_layers: int) -> List[List[Chunk]]:
    ranges = layout.ranges(num_layers)
    p, v, vee = layout.pp, len(ranges[0]), layout.v_schedule is not None
    vs = [[virtual_stage(p, r, c, v, vee) for c in range(v)] for r in range(p)]
    return [[Chunk(r, c, ranges[r][c], pre=vs[r][c] == 0, post=vs[r][c] == p * v - 1)
             for c in range(v)] for r in range(p)]


@dataclass(frozen=True)
class ParamSpec:
    """One state-dict entry of a chunk, independent of the TP size."""

    name: str
    shape: Tuple[int, ...]  # at tp=1; vocab tensors at padded_vocab_size(1) rows
    dtype: torch.dtype
    meta: ParamMeta  # the record the trainer's parameter carries (TP split, tied embedding)
    is_vocab: bool
    buffer: bool = False  # a persistent buffer: replicated over TP, no optimizer state

    @property
    def decay(self) -> bool:
        return len(self.shape) > 1

    def full_shape(self, cfg: ModelConfig) -> Tuple[int, ...]:
        """The canonical full shape: vocab tensors unpadded (``cfg.vocab_size`` rows)."""
        if self.is_vocab:
            return (cfg.vocab_size,) + self.shape[1:]
        return self.shape

    def local_shape(self, cfg: ModelConfig, tp: int) -> Tuple[int, ...]:
        shape = list(self.shape)
        if self.is_vocab:
            shape[0] = cfg.padded_vocab_size(tp)
        if self.meta.tp_split:
            shape[self.meta.partition_dim] //= tp
        return tuple(shape)

    def numel(self, cfg: ModelConfig, tp: int) -> int:
        return math.prod(self.local_shape(cfg, tp))

    def unshard(self, shards: List[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
        """TP shards (rank order) -> the canonical full tensor (a fresh tensor, vocab unpadded)."""
        m = self.meta
        full = (unshard_tensors(shards, m.partition_dim, m.partition_stride) if m.tp_split
                else shards[0])
        if self.is_vocab:
            full = full[: cfg.vocab_size]
        return full.clone()

    def shard(self, full: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
        """Canonical full tensor -> TP rank ``rank``'s slice (own storage: saved files hold only
        their slice, since torch.save writes a view's whole storage)."""
        if self.is_vocab:
            full = pad_vocab(full, cfg.vocab_size, cfg.padded_vocab_size(tp))
        m = self.meta
        out = (shard_tensor(full, m.partition_dim, rank, tp, m.partition_stride) if m.tp_split
               else full)
        return out.clone() if out.data_ptr() == full.data_ptr() or not out.is_contiguous() else out


class MetaChunk(NamedTuple):
    """A chunk as read off a GPTModel built on the meta device at TP 1 and EP 1."""
    params: Tuple[ParamSpec, ...]  # in registration order (the optimizers' order)
    state: Tuple[ParamSpec, ...]  # every state dict entry in its order: parameters and buffers
    units: Tuple[Tuple[str, Tuple[str, ...]], ...]  # ZeRO-3 units (zero3.unit_plan): parameters


@lru_cache(maxsize=256)
def _meta_chunk(cfg_key: tuple, pre: bool, post: bool, layer_range: Tuple[int, int],
                shared: bool) -> MetaChunk:
    from megalite.distributed.zero3 import unit_plan
    from megalite.models.gpt import GPTModel
    from megalite.parallel_state import ParallelState

    cfg = ModelConfig(**dict(cfg_key))
    model = GPTModel(cfg, ParallelState(), pre_process=pre, post_process=post,
                     layer_range=layer_range, seed=None, device="meta")
    specs = {}
    for name, p in model.named_parameters():
        # build_model_chunks flags both copies of a tied embedding when pp > 1 (with MTP, the
        # embedding's copies, an untied output layer not)
        vocab = name in (EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME)
        set_param_meta(p, tied_embedding=shared and vocab and (
            cfg.tie_embeddings or name == EMBEDDING_WEIGHT_NAME))
        specs[name] = ParamSpec(name=name, shape=tuple(p.shape), dtype=p.dtype,
                                meta=param_meta(p), is_vocab=vocab)
    state = tuple(specs.get(name) or ParamSpec(name=name, shape=tuple(t.shape), dtype=t.dtype,
                                               meta=ParamMeta(), is_vocab=False, buffer=True)
                  for name, t in model.state_dict().items())
    units = tuple((unit, tuple(n for _, _, nps in uses for n, _ in nps))
                  for unit, uses in unit_plan(model))
    return MetaChunk(tuple(specs.values()), state, units)


def meta_chunk(cfg: ModelConfig, chunk: Chunk, pp: int) -> MetaChunk:
    return _meta_chunk(tuple(sorted(cfg.to_dict().items())), chunk.pre, chunk.post,
                       tuple(chunk.layer_range),
                       (cfg.tie_embeddings or bool(cfg.mtp_num_layers)) and pp > 1)


def chunk_specs(cfg: ModelConfig, chunk: Chunk, pp: int) -> Tuple[ParamSpec, ...]:
    """The parameters of ``chunk`` in registration order (the optimizers' order)."""
    return meta_chunk(cfg, chunk, pp).params


def layer_of(name: str) -> Optional[int]:
    """Global layer number of a parameter name, None outside the transformer layers."""
    if name.startswith("layers."):
        return int(name.split(".", 2)[1])
    return None


def canonical_name(name: str, cfg: ModelConfig) -> str:
    """The name a parameter's value is stored under in the full model: the last stage's copy of a
    tied embedding *is* the word embedding (finalize_model_grads keeps the two copies equal)."""
    if name == OUTPUT_WEIGHT_NAME and cfg.tie_embeddings:
        return EMBEDDING_WEIGHT_NAME
    return name


def rank_param_order(cfg: ModelConfig, chunks: List[Chunk], pp: int) -> List[ParamSpec]:
    """This rank's parameters in optimizer.model_parameters order (chunk by chunk, each once)."""
    out, seen = [], set()
    for ch in chunks:
        for s in chunk_specs(cfg, ch, pp):
            if s.name not in seen:
                seen.add(s.name)
                out.append(s)
    return out
