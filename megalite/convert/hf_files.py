"""Hugging Face model directories and whole models: a directory read tensor by tensor
(:class:`HFSource`, the converter's reader), :func:`from_hf` and :func:`to_hf`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from megalite.config import ConfigError, dtype_from_name
from megalite.convert.hf import (FAMILY_OF_MODEL_TYPE, IGNORED_HF_SUFFIXES, IMPORTED_ARCHITECTURES,
                                 SUPPORTED_ARCHITECTURES, check_hf_weight_names,
                                 convert_layer_hf_to_megalite,
                                 convert_non_layer_hf_to_megalite,
                                 hf_config_to_model_config, hf_family, hf_layer_keys,
                                 hf_non_layer_keys, hf_to_megalite_state_dict,
                                 megalite_to_hf_state_dict, model_config_to_hf_config,
                                 mtp_copies, refused_hf_config, special_token_ids,
                                 unsupported_architecture)
from megalite.convert.mxfp4 import dequantize_mxfp4
from megalite.convert.sharding import (EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME, full_state_dict,
                                       load_full_state_dict_into)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model",
                   "spiece.model")


def brief(e: BaseException) -> str:
    """An exception's message on one short line (error messages here are one line)."""
    return " ".join(str(e).split())[:200] or type(e).__name__


class HFSource:
    """A local Hugging Face directory of a SUPPORTED_ARCHITECTURES model, read tensor by tensor."""

    def __init__(self, hf_dir: str, **config_overrides):
        self.dir = os.path.abspath(hf_dir)
        self.what = f"--hf-dir {hf_dir}"
        if not os.path.isdir(self.dir):
            raise ConfigError(f"{self.what}: no such directory")
        cfg_path = os.path.join(self.dir, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"{self.what}: no config.json (not a Hugging Face model directory)")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{self.what}: config.json is not valid JSON ({e})")
        refusal = refused_hf_config(raw)  # Llama 4, FP8: the field that is refused
        if refusal is not None:
            raise ConfigError(f"{self.what}: {refusal}")
        # Checked before AutoConfig, whose error for an unknown model_type is long and vague.
        # GPT2Model (no LM head) is accepted: its keys lack only the "transformer." prefix.
        ok = IMPORTED_ARCHITECTURES + ("GPT2Model",)
        archs = raw.get("architectures") or []
        if raw.get("model_type") not in FAMILY_OF_MODEL_TYPE or any(a not in ok for a in archs):
            bad = next((a for a in archs if a not in ok), raw.get("model_type"))
            raise ConfigError(f"{self.what}: unsupported Hugging Face architecture {bad!r} "
                              f"(model_type {raw.get('model_type')!r}); megalite converts "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        from transformers import AutoConfig

        try:
            self.hf_config = AutoConfig.from_pretrained(self.dir, local_files_only=True)
        except Exception as e:
            raise ConfigError(f"{self.what}: config.json cannot be read by transformers "
                              f"({brief(e)})")
        self.family = hf_family(self.hf_config)
        self.model_cfg = hf_config_to_model_config(self.hf_config, **config_overrides)
        self.key_file = self._index_weights()
        check_hf_weight_names(self.key_file, self.what)
        mtp = hf_non_layer_keys(self.model_cfg, ["mtp.layers.0.eh_proj.weight"])
        if self.model_cfg.mtp_num_layers and mtp[0] not in self.key_file:
            # HF's save_pretrained leaves the MTP layers out, their count in config.json
            self.model_cfg = hf_config_to_model_config(
                self.hf_config, **{**config_overrides, "mtp_num_layers": None})
        self._alias: Dict[str, str] = {}
        if self.family == "gpt2" and not any(k.startswith("transformer.") for k in self.key_file):
            # GPT2Model checkpoints (e.g. the original "gpt2" upload) lack the LM-head prefix
            self._alias = {"transformer." + k: k for k in self.key_file
                           if not k.startswith("lm_head.")}
        wrapped = "model.language_model."  # a vision-language wrapper's text model (WRAPPERS)
        self._alias.update({"model." + k[len(wrapped):]: k for k in self.key_file
                            if k.startswith(wrapped)})
        self.used: set = set()

    def _index_weights(self) -> Dict[str, str]:
        """tensor name -> file, from an index (sharded checkpoints) or the single file."""
        d = self.dir
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = os.path.join(d, index_name)
            if os.path.isfile(index):
                try:
                    with open(index) as f:
                        weight_map = json.load(f)["weight_map"]
                except (OSError, json.JSONDecodeError, KeyError) as e:
                    raise ConfigError(f"{self.what}: {index_name} is not a valid index ({e})")
                for fname in sorted(set(weight_map.values())):
                    if not os.path.isfile(os.path.join(d, fname)):
                        raise ConfigError(f"{self.what}: {fname} is missing (named by "
                                          f"{index_name})")
                return {k: os.path.join(d, v) for k, v in weight_map.items()}
        for fname in ("model.safetensors", "pytorch_model.bin"):
            path = os.path.join(d, fname)
            if os.path.isfile(path):
                return {k: path for k in self._keys_of(path)}
        raise ConfigError(f"{self.what}: no weights (model.safetensors, "
                          f"model.safetensors.index.json, pytorch_model.bin or "
                          f"pytorch_model.bin.index.json)")

    def _keys_of(self, path: str) -> List[str]:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            try:
                with safe_open(path, framework="pt") as f:
                    return list(f.keys())
            except Exception as e:
                raise ConfigError(f"{self.what}: {os.path.basename(path)} is not a readable "
                                  f"safetensors file ({brief(e)})")
        return list(self._load_bin(path).keys())

    def _load_bin(self, path: str) -> dict:
        # weights_only: a checkpoint never executes code on load (docs/design.md, contract 9)
        for mmap in (True, False):  # legacy (pre-zip) torch files cannot be memory-mapped
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except Exception as e:
                if mmap and isinstance(e, RuntimeError):
                    continue
                raise ConfigError(f"{self.what}: {os.path.basename(path)} cannot be loaded "
                                  f"({brief(e)})")

    def _stored(self, k: str) -> Tuple[str, ...]:
        """The stored tensor(s) HF name ``k`` is read from: an MXFP4 one's blocks and scales."""
        s = self._alias.get(k, k)
        packed = s not in self.key_file and s + "_blocks" in self.key_file
        return (s + "_blocks", s + "_scales") if packed else (s,)

    def get(self, keys: Sequence[str], where: str) -> Dict[str, torch.Tensor]:
        """Copies of the named tensors (HF LM-head names; MXFP4 ones dequantised to
        --params-dtype), reading only those; each file is closed (unmapped) again once they are
        copied out."""
        from safetensors import safe_open

        by_file: Dict[str, List[Tuple[str, str]]] = {}
        for k in keys:
            for stored in self._stored(k):
                if stored not in self.key_file:
                    raise ConfigError(f"{self.what}: tensor {stored} ({where}) is missing from "
                                      f"the weights; config.json and the weights disagree")
                name = k if stored == self._alias.get(k, k) else stored
                by_file.setdefault(self.key_file[stored], []).append((name, stored))
        out = {}
        for path, pairs in by_file.items():
            if path.endswith(".safetensors"):
                try:
                    with safe_open(path, framework="pt") as f:
                        for k, stored in pairs:
                            out[k] = f.get_tensor(stored)
                except Exception as e:
                    raise ConfigError(f"{self.what}: {os.path.basename(path)} cannot be read "
                                      f"({brief(e)})")
            else:
                sd = self._load_bin(path)
                for k, stored in pairs:
                    out[k] = sd[stored].clone()
                del sd
            self.used.update(stored for _, stored in pairs)
        for k in keys:
            if len(parts := self._stored(k)) == 2:
                out[k] = dequantize_mxfp4(out.pop(parts[0]), out.pop(parts[1]),
                                          dtype_from_name(self.model_cfg.params_dtype))
        return out

    def lazy(self, keys: Sequence[str], where: str) -> "_LazyTensors":
        """The named tensors as a mapping that reads each when it is looked up and keeps none (the
        stacked experts are filled one hub tensor at a time)."""
        for k in keys:
            if any(s not in self.key_file for s in self._stored(k)):
                raise ConfigError(f"{self.what}: tensor {k} ({where}) is missing from the "
                                  f"weights; config.json and the weights disagree")
        return _LazyTensors(self, keys, where)

    def unused(self) -> List[str]:
        skip = {"lm_head.weight"} if self.model_cfg.tie_embeddings else set()
        skip.update(mtp_copies(self.model_cfg))  # the MTP layers' copies of embedding and head
        return [k for k in self.key_file if k not in self.used and k not in skip
                and not k.endswith(IGNORED_HF_SUFFIXES)]

    def read_layer(self, i: int) -> Dict[str, torch.Tensor]:
        where = f"layer {i}"
        hf = self.lazy(hf_layer_keys(i, self.model_cfg), where)
        try:
            return convert_layer_hf_to_megalite(i, hf, self.model_cfg)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"{self.what}: {where} tensors do not fit config.json ({brief(e)})")

    def read_non_layer(self, names: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
        """The non-layer tensors (megalite ``names`` of them, default all), canonical."""
        # lazily, as a layer: an MTP depth's experts are stacked one hub tensor at a time
        hf = self.lazy(hf_non_layer_keys(self.model_cfg, names), "embeddings / head / MTP")
        try:
            out = convert_non_layer_hf_to_megalite(hf, self.model_cfg, names)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"{self.what}: embedding or output tensors do not fit "
                              f"config.json ({brief(e)})")
        # canonical vocab tensors are unpadded (a clone where rows were cut: no view of padding)
        vocab = self.model_cfg.vocab_size
        return {k: (v[:vocab].clone() if k in (EMBEDDING_WEIGHT_NAME, OUTPUT_WEIGHT_NAME)
                    and v.shape[0] != vocab else v) for k, v in out.items()}

    def has_tokenizer(self) -> bool:
        return any(os.path.isfile(os.path.join(self.dir, f)) for f in TOKENIZER_FILES)


class _LazyTensors(Mapping):
    """HFSource.lazy's mapping: a KeyError for names it was not given, as a dict."""

    def __init__(self, src: HFSource, keys: Sequence[str], where: str):
        self.src, self.keys_, self.where = src, list(keys), where

    def __getitem__(self, k: str) -> torch.Tensor:
        if k not in self.keys_:
            raise KeyError(k)
        return self.src.get([k], self.where)[k]

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


def from_hf(hf_model_or_dir, **config_overrides):
    """A single-process :class:`GPTModel` (eval mode) with the weights of an HF model of one of
    ``SUPPORTED_ARCHITECTURES`` (an instance, or a local directory holding config.json and
    weights). ``config_overrides`` go to :func:`hf_config_to_model_config`."""
    from megalite.models import GPTModel
    from megalite.parallel_state import ParallelState

    if isinstance(hf_model_or_dir, (str, os.PathLike)):  # the converter's reader of HF dirs
        src = HFSource(str(hf_model_or_dir), **config_overrides)
        cfg, hf_sd = src.model_cfg, src.get(list(src.key_file), "weights")
    else:
        name = type(hf_model_or_dir).__name__
        if name not in IMPORTED_ARCHITECTURES:
            raise unsupported_architecture(name)
        # HF's model classes hold no MTP layers (num_nextn_predict_layers is only recorded)
        cfg = hf_config_to_model_config(hf_model_or_dir.config,
                                        **{**config_overrides, "mtp_num_layers": None})
        hf_sd = hf_model_or_dir.state_dict()
    model = GPTModel(cfg, ParallelState(), seed=None)  # every parameter comes from the checkpoint
    sd = hf_to_megalite_state_dict(hf_sd, cfg)
    load_full_state_dict_into(model, sd, tp_rank=0, tp_size=1)
    return model.eval()


def to_hf(model, out_dir: Union[str, os.PathLike], tokenizer=None) -> Path:
    """Write a single-process GPTModel as an HF checkpoint: config.json + model.safetensors (and
    the tokenizer's files if given), loadable by ``AutoModelForCausalLM.from_pretrained``."""
    from safetensors.torch import save_file

    cfg = model.config
    hf_config = model_config_to_hf_config(cfg, **special_token_ids(tokenizer))
    sd = megalite_to_hf_state_dict(full_state_dict(model), cfg)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
