"""A checkpoint's names, files and tracker (docs/checkpoints.md, "Layout on disk")."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import replace
from typing import Optional

import torch

from megalite import collectives as C
from megalite.config import CHECKPOINT_ARGS_FIELDS, ConfigError, MegaliteConfig, config_from_dict

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
RECORD_FILE = "verify.pt"  # what a load must reproduce (checkpoint/verify.py)
CHECKPOINT_VERSION = 1
RESHARD_HINT = ("reshard it to this layout first with "
                "`python tools/checkpoint/convert.py reshard` (docs/checkpoints.md)")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used or written as asked; the message says which file and why."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def loadable_iteration_dir(root: str, iteration: int) -> str:
    """``iter_X``, or while a re-save of X swaps it (or after a crash there), the old copy."""
    final = iteration_dir(root, iteration)
    if not os.path.isdir(final):
        olds = sorted(glob.glob(f"{final}.old-*"), key=os.path.getmtime)
        if olds:
            return olds[-1]
    return final


def shard_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def distrib_optim_name(dp_rank: int) -> str:
    return f"distrib_optim_dp{dp_rank:03d}.pt"


def chunk_key(index: int, num_chunks: int) -> str:
    """The key of a model chunk's state dict in model_optim_rng.pt."""
    return "model" if num_chunks == 1 else f"model{index}"


def file_header(iteration: int, consumed_samples: int, tp: int, pp: int, num_chunks: int) -> dict:
    """The small entries of every model_optim_rng.pt, beside the chunks' state dicts."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration),
            "consumed_samples": int(consumed_samples), "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "num_model_chunks": num_chunks}


def write_fsynced(path: str, write) -> None:
    """Write a file and fsync it, so a crash after the tracker names it cannot lose it."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_file(path: str, obj) -> None:
    """The one writer of checkpoint files (the trainer's saves and the converter's)."""
    write_fsynced(path, lambda f: torch.save(obj, f))


def fsync_dir(path: str) -> None:
    """fsync a directory: makes the names created or renamed in it durable (POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_file(path: str, what: str, mmap: bool = False):
    """A checkpoint file (tensors and primitive containers only: docs/design.md, contract 9)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{what}: {path} is missing (incomplete checkpoint)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, bad pickle, disallowed global, ...
        raise CheckpointError(f"{what}: {path} is corrupt or truncated ({C.one_line(e, 200)})")


def read_tracker(load_dir: str) -> Optional[int]:
    """The latest complete iteration in ``load_dir``, or None if there is no tracker file."""
    path = os.path.join(load_dir, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"--load {load_dir}: {TRACKER_FILE} is corrupt (holds {text!r}, "
                              f"expected an iteration number)")


def latest_iteration(load_dir: str, what: str) -> int:
    """read_tracker, or a CheckpointError where there is no tracker."""
    iteration = read_tracker(load_dir)
    if iteration is None:
        raise CheckpointError(f"{what}: no {TRACKER_FILE} there (not a megalite checkpoint "
                              f"directory, or no save has completed)")
    return iteration


def read_checkpoint_config(load_dir: str, iteration: Optional[int] = None) -> MegaliteConfig:
    """The MegaliteConfig saved with a checkpoint (args.json)."""
    if iteration is None:
        iteration = latest_iteration(load_dir, f"--load {load_dir}")
    path = os.path.join(loadable_iteration_dir(load_dir, iteration), "args.json")
    try:
        with open(path) as f:
            return config_from_dict(json.load(f))
    except FileNotFoundError:
        raise CheckpointError(f"--load {load_dir}: {path} is missing (incomplete checkpoint)")
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"--load {load_dir}: {path} is corrupt ({e})")


def with_checkpoint_args(cfg: MegaliteConfig) -> MegaliteConfig:
    """--use-checkpoint-args: ``cfg`` with the model shape and the tokenizer of ``--load``
    (the saved ``DIR/tokenizer/``, else args.json's; one given on the command line wins)."""
    load = cfg.checkpoint.load
    saved = read_checkpoint_config(load)
    model = replace(cfg.model, **{n: getattr(saved.model, n) for n in CHECKPOINT_ARGS_FIELDS})
    data = cfg.data
    if data.tokenizer_type is None and data.tokenizer_model is None:
        folder = os.path.join(load, "tokenizer")
        if os.path.isdir(folder):
            data = replace(data, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder)
        else:
            data = replace(data, tokenizer_type=saved.data.tokenizer_type,
                           tokenizer_model=saved.data.tokenizer_model)  # the BPE: model's size
    return replace(cfg, model=model, data=data)
