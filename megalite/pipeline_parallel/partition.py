"""Which layers live on which pipeline stage, and building this rank's model chunks."""

from __future__ import annotations

from typing import List, Optional

from megalite.config import ConfigError, ModelConfig
from megalite.models.gpt import GPTModel
from megalite.parallel_state import ParallelState


def build_model_chunks(model_config: ModelConfig, ps: ParallelState, seed: int = 1234,
                       num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                       decoder_first_pipeline_num_layers: Optional[int] = None,
                       decoder_last_pipeline_num_layers: Optional[int] = None,
                       device=None) -> List[GPTModel]:
    """This rank's model chunks (one per virtual stage; one chunk without pipelining)."""
    if ps.pp_size == 1:
        return [GPTModel(model_config, ps, seed=seed, device=device)]
    raise ConfigError("--pipeline-model-parallel-size > 1 is added by the pipeline-parallel work")
