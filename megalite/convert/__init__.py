"""Hugging Face <-> megalite conversion and loading a full state dict (docs/models.md)."""

from megalite.convert.hf import (  # noqa: F401
    SUPPORTED_ARCHITECTURES, convert_layer_hf_to_megalite, convert_layer_megalite_to_hf,
    convert_non_layer_hf_to_megalite, convert_non_layer_megalite_to_hf, hf_config_to_model_config,
    hf_layer_keys, hf_non_layer_keys, hf_to_megalite_state_dict, megalite_layer_keys,
    megalite_non_layer_keys, megalite_to_hf_state_dict, model_config_to_hf_config, model_family)
from megalite.convert.hf_files import from_hf, to_hf  # noqa: F401
from megalite.convert.sharding import (  # noqa: F401
    full_state_dict, load_full_state_dict_into, pad_vocab)
