"""Which layers live on which pipeline stage, and this rank's model chunks
(docs/pipeline_parallel.md, "Stages and chunks")."""

from __future__ import annotations

from typing import List, Optional, Tuple

from megalite.config import ExecutionConfig, ModelConfig, check_layer_split
from megalite.models.gpt import GPTModel
from megalite.param_meta import set_param_meta
from megalite.parallel_state import ParallelState


def virtual_stage(p: int, r: int, c: int, v: int = 1, v_shape: bool = False) -> int:
    """The virtual stage that chunk c of rank r holds: c*p + r (Megatron's), or the V's."""
    return (r if c == 0 else 2 * p - 1 - r) if v_shape else c * p + r


def stage_rank(p: int, vs: int, v: int = 1, v_shape: bool = False) -> int:
    """The pipeline rank holding virtual stage vs (inverse of virtual_stage)."""
    return (vs if vs < p else 2 * p - 1 - vs) if v_shape else vs % p


def stage_layer_counts(num_layers: int, pp_size: int,
                       decoder_first_pipeline_num_layers: Optional[int] = None,
                       decoder_last_pipeline_num_layers: Optional[int] = None) -> List[int]:
    """Layers on each of the p (non-virtual) stages (a split config.check_layer_split accepts)."""
    L, p = num_layers, pp_size
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    n_rest = p - (first is not None) - (last is not None)
    counts = [(L - (first or 0) - (last or 0)) // n_rest if n_rest else 0] * p
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def virtual_layer_ranges(num_layers: int, pp_size: int,
                         num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                         decoder_first_pipeline_num_layers: Optional[int] = None,
                         decoder_last_pipeline_num_layers: Optional[int] = None,
                         v_shape: bool = False) -> List[List[Tuple[int, int]]]:
    """``ranges[r][c]`` = global layer range [start, end) of chunk c on pipeline rank r; the
    planner and the converter reach the split's checks (config.check_layer_split) through here."""
    L, p = num_layers, pp_size
    per_vstage = num_layers_per_virtual_pipeline_stage
    check_layer_split(L, p, per_vstage, decoder_first_pipeline_num_layers,
                      decoder_last_pipeline_num_layers, v_shape)
    if v_shape:  # two chunks of L/(2p) layers per rank, in a V (V_SCHEDULES)
        n = L // (2 * p)
        return [[(virtual_stage(p, r, c, 2, True) * n, (virtual_stage(p, r, c, 2, True) + 1) * n)
                 for c in range(2)] for r in range(p)]
    if per_vstage is None:
        counts = stage_layer_counts(L, p, decoder_first_pipeline_num_layers,
                                    decoder_last_pipeline_num_layers)
        starts = [sum(counts[:r]) for r in range(p)]
        return [[(starts[r], starts[r] + counts[r])] for r in range(p)]
    v = L // (per_vstage * p)
    # chunk c of rank r is virtual stage c*p + r (Megatron's assignment)
    return [[((c * p + r) * per_vstage, (c * p + r + 1) * per_vstage) for c in range(v)]
            for r in range(p)]


def build_model_chunks(model_config: ModelConfig, ps: ParallelState, seed: int = 1234,
                       num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                       decoder_first_pipeline_num_layers: Optional[int] = None,
                       decoder_last_pipeline_num_layers: Optional[int] = None,
                       device=None, v_shape: bool = False, sequence_parallel: bool = False,
                       execution: ExecutionConfig = ExecutionConfig()) -> List[GPTModel]:
    """This rank's model chunks (one per virtual stage; one chunk without pipelining); sets
    ``ps.vpp_size`` (v, or None) so the schedules and the checkpoint code know the layout."""
    if ps.pp_size == 1:
        ps.vpp_size = None
        return [GPTModel(model_config, ps, seed=seed, device=device,
                         sequence_parallel=sequence_parallel, execution=execution)]
    ranges = virtual_layer_ranges(model_config.num_layers, ps.pp_size,
                                  num_layers_per_virtual_pipeline_stage,
                                  decoder_first_pipeline_num_layers,
                                  decoder_last_pipeline_num_layers, v_shape)[ps.pp_rank]
    v = len(ranges)
    ps.vpp_size = v if num_layers_per_virtual_pipeline_stage is not None or v_shape else None
    chunks = []
    for c, layer_range in enumerate(ranges):
        vs = virtual_stage(ps.pp_size, ps.pp_rank, c, v, v_shape)
        pre, post = vs == 0, vs == ps.pp_size * v - 1
        chunk = GPTModel(model_config, ps, pre_process=pre, post_process=post,
                         layer_range=layer_range, seed=seed, device=device,
                         sequence_parallel=sequence_parallel, execution=execution)
        if model_config.tie_embeddings or model_config.mtp_num_layers:
            # both copies flagged, so finalize_model_grads sums their gradients every step; under
            # the V both sit on rank 0, and the norm counts the output copy once
            # (docs/pipeline_parallel.md, "Stages and chunks"). With MTP the last stage's copy
            # is an embedding (its depths embed tokens), shared by a tied output layer.
            if pre:
                set_param_meta(chunk.embedding.word_embeddings.weight, tied_embedding=True)
            if post:
                copy = (chunk.embedding.word_embeddings if chunk.mtp is not None
                        else chunk.output_layer).weight
                set_param_meta(copy, tied_embedding=True, local_tied_copy=v_shape)
        chunks.append(chunk)
    return chunks
