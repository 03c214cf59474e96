"""The offline converter behind tools/checkpoint/convert.py: Hugging Face -> megalite, megalite ->
Hugging Face, and resharding a megalite checkpoint to another TP / PP / virtual-PP / DP layout
(docs/checkpoints.md, "Conversion and resharding"). Output is written into ``OUT.tmp-*`` and
renamed to OUT only when complete (docs/design.md, contract 8)."""

from __future__ import annotations

import copy
import json
import os
import shutil
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megalite.checkpoint.format import (MODEL_FILE, RECORD_FILE, TRACKER_FILE, CheckpointError,
                                        distrib_optim_name, iteration_dir, save_file,
                                        shard_dir_name)
from megalite.checkpoint.layout import Layout, ParamSpec, canonical_name, layer_of
from megalite.checkpoint.reshard import MegaliteSource, ReadGroup, assemble_stage, own_storage
from megalite.config import (V_SCHEDULES, MegaliteConfig, ModelConfig, config_to_json,
                             dtype_from_name)
from megalite.convert.hf import (convert_layer_megalite_to_hf, convert_non_layer_megalite_to_hf,
                                 megalite_layer_keys, megalite_non_layer_keys,
                                 model_config_to_hf_config, special_token_ids)
from megalite.convert.hf_files import HFSource, brief

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


@contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary directory that becomes ``path`` only if the block completes."""
    path = os.path.abspath(path.rstrip("/") or path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"--save {path}: already exists and is not empty; choose a new "
                              f"directory (conversion never overwrites)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked above)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_target_layout(cfg: MegaliteConfig, layout: Layout, dp: Optional[int] = None) -> None:
    """Raise ConfigError (one line naming the flag) if the model cannot take ``layout``."""
    if layout.tp < 1 or layout.pp < 1:
        raise CheckpointError(f"--tensor-model-parallel-size ({layout.tp}) and "
                              f"--pipeline-model-parallel-size ({layout.pp}) must be >= 1")
    if dp is not None and dp < 1:
        raise CheckpointError(f"--data-parallel-size must be >= 1, got {dp}")
    m = cfg.model
    m.validate(layout.tp)  # heads, query groups, ffn % t: messages name the flags
    layout.ranges(m.num_layers)  # layers % (p * v), p <= layers
    tr = cfg.training
    if dp is not None and tr.global_batch_size and tr.micro_batch_size:
        if tr.global_batch_size % (tr.micro_batch_size * dp) != 0:
            raise CheckpointError(
                f"--data-parallel-size {dp}: the checkpoint's global batch size "
                f"({tr.global_batch_size}) is not a multiple of micro-batch size "
                f"({tr.micro_batch_size}) x {dp}; resume with a different --global-batch-size or "
                f"choose another data-parallel size")


def _set_layout(cfg: MegaliteConfig, layout: Layout) -> None:
    """Record the new layout in args.json's parallel fields."""
    v = layout.num_chunks(cfg.model.num_layers)
    cfg.parallel.tensor_model_parallel_size = layout.tp
    cfg.parallel.pipeline_model_parallel_size = layout.pp
    cfg.parallel.virtual_pipeline_model_parallel_size = v if v > 1 and not layout.v_schedule \
        else None
    if layout.tp == 1:  # sequence parallelism needs TP; a tp=1 target simply does not use it
        cfg.parallel.sequence_parallel = False
    cfg.training.decoder_first_pipeline_num_layers = layout.decoder_first
    cfg.training.decoder_last_pipeline_num_layers = layout.decoder_last
    if layout.v_schedule or cfg.training.pipeline_schedule in V_SCHEDULES or (
            v == 1 and cfg.training.pipeline_schedule == "interleaved"):
        cfg.training.pipeline_schedule = layout.v_schedule  # the V goes with its schedule


def _write_stages(tmp: str, cfg: MegaliteConfig, layout: Layout, iteration: int,
                  read_group: ReadGroup, *, log: Log = _quiet, **kw) -> None:
    """Write iteration ``iteration`` of ``layout`` into ``tmp``, one pipeline stage at a time
    (assemble_stage builds each in memory; ``kw`` are its options), each file with torch.save."""
    it_dir = iteration_dir(tmp, iteration)
    for r in range(layout.pp):
        stage = assemble_stage(cfg, layout, r, iteration, read_group, **kw)
        while stage:  # each file dropped once written: one stage in memory at a time
            t, model_file, zero_files = stage.pop(0)
            shard = os.path.join(it_dir, shard_dir_name(t, r))
            os.makedirs(shard, exist_ok=True)
            save_file(os.path.join(shard, MODEL_FILE), model_file)
            for d, zsd in (zero_files or {}).items():
                save_file(os.path.join(shard, distrib_optim_name(d)), zsd)
            del model_file, zero_files
        log(f" wrote pipeline stage {r + 1}/{layout.pp} ({layout.tp} tensor-parallel file(s))")


def _finish_checkpoint(tmp: str, cfg: MegaliteConfig, iteration: int,
                       tokenizer_src: Optional[str]) -> None:
    with open(os.path.join(iteration_dir(tmp, iteration), "args.json"), "w") as f:
        f.write(config_to_json(cfg))
    if tokenizer_src is not None:
        shutil.copytree(tokenizer_src, os.path.join(tmp, "tokenizer"))
    with open(os.path.join(tmp, TRACKER_FILE), "w") as f:
        f.write(str(iteration))


def reshard(load_dir: str, save_dir: str, layout: Layout, *, data_parallel_size: Optional[int]
            = None, no_optim: bool = False, iteration: Optional[int] = None,
            zero_stage: Optional[int] = None, log: Log = _quiet) -> str:
    """Rewrite checkpoint ``load_dir`` for ``layout`` (docs/checkpoints.md, "Conversion and
    resharding"); returns the output directory."""
    src = MegaliteSource(load_dir, iteration)
    cfg = copy.deepcopy(src.cfg)
    if zero_stage is not None:
        cfg.optimizer.zero_stage = zero_stage
    dp = data_parallel_size
    if dp is None:
        dp = src.dp_size if src.optim_kind in ("zero", "zero3") else 1
    check_target_layout(cfg, layout, dp)
    optim = None if no_optim else src.optim_for(cfg.optimizer.zero_stage, "pass --no-optim")
    _set_layout(cfg, layout)
    if no_optim:
        cfg.checkpoint.no_save_optim = True
    tok = os.path.join(src.dir, "tokenizer")
    log(f" resharding {load_dir} (iteration {src.iteration}, {src.layout.describe()}) -> "
        f"{layout.describe()}" + (f" dp={dp}" if optim in ("zero", "zero3") else "") +
        ("" if optim else " without optimizer state"))
    with atomic_output(save_dir) as tmp:
        _write_stages(tmp, cfg, layout, src.iteration, src.read_group,
                      consumed=src.consumed_samples, optim=optim, common=src.optim_common,
                      scheduler=src.scheduler, dp=dp, rng=src.rng_state, what=src.what, log=log)
        _finish_checkpoint(tmp, cfg, src.iteration, tok if os.path.isdir(tok) else None)
        if os.path.isfile(record := os.path.join(src.it_dir, RECORD_FILE)):  # the same state
            shutil.copy(record, iteration_dir(tmp, src.iteration))
    return os.path.abspath(save_dir)


def hf_to_megalite(hf_dir: str, save_dir: str, layout: Layout, *,
                   seq_length: Optional[int] = None, params_dtype: Optional[str] = None,
                   make_vocab_size_divisible_by: Optional[int] = None, log: Log = _quiet) -> str:
    """Import an HF model as a megalite checkpoint at iteration 0 (fresh optimizer state)."""
    overrides = dict(seq_length=seq_length, params_dtype=params_dtype,
                     make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    src = HFSource(hf_dir, **{k: v for k, v in overrides.items() if v is not None})
    m = src.model_cfg
    cfg = MegaliteConfig(model=m)
    check_target_layout(cfg, layout)
    _set_layout(cfg, layout)
    if src.has_tokenizer():
        cfg.data.tokenizer_type = "HuggingFaceTokenizer"
        cfg.data.tokenizer_model = os.path.join(os.path.abspath(save_dir), "tokenizer")
    log(f" importing {hf_dir} ({src.hf_config.architectures or [src.family]}, "
        f"{m.num_layers} layers, hidden {m.hidden_size}) -> {layout.describe()}")

    def read_group(group: List[ParamSpec], with_optim: bool):
        i = layer_of(group[0].name)
        if i is not None:
            tensors = src.read_layer(i)
        else:  # read when a stage needs them and dropped after, as a layer is
            tensors = src.read_non_layer(list(dict.fromkeys(
                canonical_name(s.name, m) for s in group)))
        out = {}
        for s in group:
            name = canonical_name(s.name, m)
            if name not in tensors:
                raise CheckpointError(f"{src.what}: no tensor maps to {name}")
            out[name] = {"weight": tensors[name]}
        return out

    with atomic_output(save_dir) as tmp:
        _write_stages(tmp, cfg, layout, 0, read_group, optim="fresh",
                      weight_dtype=dtype_from_name(m.params_dtype),
                      what=f"{src.what} (config.json and weights disagree)", log=log)
        unused = src.unused()
        if unused:
            raise CheckpointError(f"{src.what}: {len(unused)} tensor(s) in the weights map to "
                                  f"nothing in a {m.num_layers}-layer model (config.json and "
                                  f"weights disagree?): {', '.join(unused[:3])}")
        _finish_checkpoint(tmp, cfg, 0, None)
        if src.has_tokenizer():
            _save_hf_tokenizer(src, os.path.join(tmp, "tokenizer"), m, log)
    return os.path.abspath(save_dir)


def _load_tokenizer(path: str, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"{what} cannot be loaded ({brief(e)})")


def _save_hf_tokenizer(src: HFSource, target: str, m: ModelConfig, log: Log) -> None:
    """The HF tokenizer, re-saved with save_pretrained as pretrain.py saves its own, so
    ``--tokenizer-model OUT/tokenizer`` and tools/generate.py find it."""
    tok = _load_tokenizer(src.dir, f"{src.what}: the tokenizer files there")
    tok.save_pretrained(target)
    if len(tok) > m.vocab_size:
        log(f" note: the tokenizer has {len(tok)} ids but the model's vocab_size is only "
            f"{m.vocab_size}; pretrain.py refuses to train with it (ids without an embedding row)")


class _SafetensorsShards:
    """HF's sharded safetensors layout (``model-0000k-of-0000n.safetensors`` + index), written a
    shard at a time so memory holds at most one shard; a single shard is ``model.safetensors``."""

    def __init__(self, out_dir: str, max_bytes: int):
        self.dir, self.max_bytes = out_dir, max_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: List[Tuple[str, List[str]]] = []
        self.total = 0

    def add(self, tensors: Dict[str, torch.Tensor]) -> None:
        for k, t in tensors.items():
            t = own_storage(t.detach().cpu())
            n = t.numel() * t.element_size()
            if self.pending and self.pending_bytes + n > self.max_bytes:
                self._flush()
            self.pending[k] = t
            self.pending_bytes += n
            self.total += n

    def _flush(self) -> None:
        from safetensors.torch import save_file as save_safetensors

        name = f"part-{len(self.files):05d}.safetensors"
        save_safetensors(self.pending, os.path.join(self.dir, name), metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.files)
        if n == 1:
            os.rename(os.path.join(self.dir, self.files[0][0]),
                      os.path.join(self.dir, "model.safetensors"))
            return
        weight_map = {}
        for k, (name, keys) in enumerate(self.files):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.dir, name), os.path.join(self.dir, final))
            weight_map.update({key: final for key in keys})
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)


def megalite_to_hf(load_dir: str, save_dir: str, *, iteration: Optional[int] = None,
                   max_shard_bytes: int = 2 << 30, log: Log = _quiet) -> str:
    """Export any megalite checkpoint (any TP/PP/VPP; optimizer files are not read) as a directory
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads."""
    src = MegaliteSource(load_dir, iteration)
    m = src.model_cfg
    tok_dir = os.path.join(src.dir, "tokenizer")
    tokenizer = (_load_tokenizer(tok_dir, f"--load {load_dir}: tokenizer/")
                 if os.path.isdir(tok_dir) else None)
    # ConfigError if no HF class fits
    hf_config = model_config_to_hf_config(m, **special_token_ids(tokenizer))
    log(f" exporting {load_dir} (iteration {src.iteration}, {src.layout.describe()}) as "
        f"{hf_config.architectures[0]}")
    with atomic_output(save_dir) as tmp:
        shards = _SafetensorsShards(tmp, max_shard_bytes)
        non_layer = {n: v["weight"] for n, v in src.read(megalite_non_layer_keys(m)).items()}
        shards.add(convert_non_layer_megalite_to_hf(non_layer, m))
        del non_layer
        for i in range(m.num_layers):
            full = {n: v["weight"] for n, v in src.read(megalite_layer_keys(i, m)).items()}
            shards.add(convert_layer_megalite_to_hf(i, full, m))
            del full
        shards.finish()
        hf_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return os.path.abspath(save_dir)
