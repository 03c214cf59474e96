"""Which layers live on which pipeline stage, and building this rank's model chunks.

Without interleaving, stage r of p holds a contiguous block of L/p layers (or the uneven split of
``--decoder-first/last-pipeline-num-layers``). With v virtual stages per rank (interleaved 1F1B,
Narayanan et al. 2021 §2.2) the model is cut into p*v chunks of L/(p*v) layers and, as in
Megatron-LM, chunk c of rank r is virtual stage c*p + r: rank 0 holds virtual stages 0, p, 2p, ...
so a micro-batch visits every rank v times, and the p2p ring wraps from rank p-1 back to rank 0.

The embedding lives on the first virtual stage (rank 0, chunk 0); the final norm, output layer and
loss on the last (rank p-1, chunk v-1). Layers keep their *global* numbers (GPTModel keys them so),
so parameter names, seeds and checkpoint keys are the same in every layout
(docs/design.md, contract 3).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from megalite.config import V_SCHEDULES, ConfigError, ModelConfig  # noqa: F401
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
    """Layers on each of the p (non-virtual) stages; raises ConfigError with one line if invalid."""
    L, p = num_layers, pp_size
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    if p > L:
        raise ConfigError(f"--pipeline-model-parallel-size ({p}) exceeds --num-layers ({L}): every "
                          f"stage needs at least one layer")
    for flag, val in (("--decoder-first-pipeline-num-layers", first),
                      ("--decoder-last-pipeline-num-layers", last)):
        if val is not None and (val < 1 or p == 1):
            raise ConfigError(f"{flag} ({val}) must be >= 1 and needs "
                              f"--pipeline-model-parallel-size > 1")
    if first is None and last is None:
        if L % p != 0:
            raise ConfigError(f"--num-layers ({L}) must be divisible by "
                              f"--pipeline-model-parallel-size ({p}); or set "
                              f"--decoder-first/last-pipeline-num-layers for an uneven split")
        return [L // p] * p
    fixed = (first or 0) + (last or 0)
    n_rest = p - (first is not None) - (last is not None)
    rest = L - fixed
    if n_rest == 0:
        if rest != 0:
            raise ConfigError(f"--decoder-first-pipeline-num-layers ({first}) + "
                              f"--decoder-last-pipeline-num-layers ({last}) must equal "
                              f"--num-layers ({L}) with --pipeline-model-parallel-size 2")
        return [first, last]
    if rest < n_rest or rest % n_rest != 0:
        raise ConfigError(f"after --decoder-first/last-pipeline-num-layers ({first}, {last}), the "
                          f"remaining {rest} of --num-layers ({L}) layers must split evenly (>= 1 "
                          f"each) over the other {n_rest} pipeline stages")
    counts = [rest // n_rest] * p
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
    """``ranges[r][c]`` = global layer range [start, end) of chunk c on pipeline rank r."""
    L, p = num_layers, pp_size
    per_vstage = num_layers_per_virtual_pipeline_stage
    if v_shape:  # two chunks of L/(2p) layers per rank, in a V (V_SCHEDULES)
        if per_vstage is not None or decoder_first_pipeline_num_layers is not None or \
                decoder_last_pipeline_num_layers is not None or L % (2 * p) != 0:
            raise ConfigError(f"--pipeline-schedule zb-v/dualpipev cut --num-layers ({L}) into "
                              f"2 x --pipeline-model-parallel-size ({p}) equal chunks: it must be "
                              f"divisible by {2 * p}, without virtual-stage or uneven-split flags")
        n = L // (2 * p)
        return [[(virtual_stage(p, r, c, 2, True) * n, (virtual_stage(p, r, c, 2, True) + 1) * n)
                 for c in range(2)] for r in range(p)]
    if per_vstage is None:
        counts = stage_layer_counts(L, p, decoder_first_pipeline_num_layers,
                                    decoder_last_pipeline_num_layers)
        starts = [sum(counts[:r]) for r in range(p)]
        return [[(starts[r], starts[r] + counts[r])] for r in range(p)]
    if (decoder_first_pipeline_num_layers is not None
            or decoder_last_pipeline_num_layers is not None):
        raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                          "--num-layers-per-virtual-pipeline-stage")
    if p == 1:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage needs "
                          "--pipeline-model-parallel-size > 1")
    if per_vstage < 1 or L % (per_vstage * p) != 0:
        raise ConfigError(f"--num-layers ({L}) must be divisible by "
                          f"--num-layers-per-virtual-pipeline-stage ({per_vstage}) x "
                          f"--pipeline-model-parallel-size ({p}) = {per_vstage * p}")
    v = L // (per_vstage * p)
    # chunk c of rank r is virtual stage c*p + r (Megatron's assignment)
    return [[((c * p + r) * per_vstage, (c * p + r + 1) * per_vstage) for c in range(v)]
            for r in range(p)]


def build_model_chunks(model_config: ModelConfig, ps: ParallelState, seed: int = 1234,
                       num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                       decoder_first_pipeline_num_layers: Optional[int] = None,
                       decoder_last_pipeline_num_layers: Optional[int] = None,
                       device=None, v_shape: bool = False,
                       sequence_parallel: bool = False) -> List[GPTModel]:
    """This rank's model chunks (one per virtual stage; one chunk without pipelining).

    Sets ``ps.vpp_size`` (v, or None) so the schedules and the checkpoint code know the layout.
    """
    if ps.pp_size == 1:
        if num_layers_per_virtual_pipeline_stage is not None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs "
                              "--pipeline-model-parallel-size > 1")
        virtual_layer_ranges(model_config.num_layers, 1, None, decoder_first_pipeline_num_layers,
                             decoder_last_pipeline_num_layers)  # validates the uneven flags
        ps.vpp_size = None
        return [GPTModel(model_config, ps, seed=seed, device=device,
                         sequence_parallel=sequence_parallel)]
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
                         sequence_parallel=sequence_parallel)
        if model_config.tie_embeddings:
            # Two copies of one tied weight (input embedding on the first stage, output layer on
            # the last): GPTModel seeds the output copy from the embedding's name, so they start
            # equal; both must be flagged so finalize_model_grads sums their gradients every
            # step, which keeps them equal: over the embedding group, or here when the V puts
            # both on rank 0 (chunk 0 and chunk 1). Then the output copy is a local duplicate,
            # which the gradient norm must not count a second time (clip_grads.counts_for_norm).
            if pre:
                set_param_meta(chunk.embedding.word_embeddings.weight, tied_embedding=True)
            if post:
                set_param_meta(chunk.output_layer.weight, tied_embedding=True,
                               local_tied_copy=v_shape)
        chunks.append(chunk)
    return chunks
