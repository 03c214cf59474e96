"""Checkpoint conversion: Hugging Face -> megalite, megalite -> Hugging Face, and resharding a
megalite checkpoint to another TP / PP / virtual-PP / DP layout (the library behind
tools/checkpoint/convert.py; docs/checkpoints.md, "Conversion and resharding").

Everything goes through one *canonical* form: full (TP-unsharded) tensors under the layout-free
parameter names of GPTModel (layers are keyed by their global number, models/gpt.py), vocab
tensors unpadded, and for the optimizer the same per name (optimizer_state.py). A source is read
and a target written in that form, so any layout converts to any other.

Streaming. Conversion runs one *layer* at a time: the source shard files of the stage holding the
layer are opened with ``torch.load(mmap=True, weights_only=True)`` (nothing is read until a tensor
is touched), that layer's tensors are copied out and the files closed again (which unmaps them),
so source memory stays near one layer whatever the model size. The target is built stage by stage:
one pipeline stage's TP files are complete in memory, written, and dropped before the next stage.
Peak host memory is therefore about one layer plus one target stage (docs give a measurement).

Atomicity (docs/design.md, contract 8). Output goes to ``OUT.tmp-<pid>-<rand>/`` and is renamed to
OUT only when complete; on any error the temporary directory is removed, so OUT is never left
half-written, and an existing non-empty OUT is refused rather than overwritten.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import types
from contextlib import contextmanager
from pathlib import Path
from typing import (Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import torch

from megalite import checkpointing as ckpt
from megalite.config import (
    V_SCHEDULES,
    ConfigError,
    MegaliteConfig,
    ModelConfig,
    config_to_json,
    dtype_from_name,
)
from megalite.convert.hf import (
    IGNORED_HF_SUFFIXES,
    FAMILY_OF_MODEL_TYPE,
    check_hf_weight_names,
    convert_layer_hf_to_megalite,
    convert_layer_megalite_to_hf,
    convert_non_layer_hf_to_megalite,
    convert_non_layer_megalite_to_hf,
    dropped_hf_keys,
    hf_config_to_model_config,
    hf_family,
    hf_layer_keys,
    hf_to_megalite_state_dict,
    hf_non_layer_keys,
    megalite_layer_keys,
    megalite_non_layer_keys,
    megalite_to_hf_state_dict,
    model_config_to_hf_config,
    refused_hf_config,
    special_token_ids,
    SUPPORTED_ARCHITECTURES,
    unsupported_architecture,
)
from megalite.convert.layout import (
    Layout,
    ParamSpec,
    canonical_name,
    chunk_key,
    chunk_state_specs,
    chunks_of,
    layer_of,
    layout_of_config,
    rank_param_order,
)
from megalite.convert.optimizer_state import (
    OptimCommon,
    OptimizerStateError,
    PlainIndex,
    build_plain,
    check_plain,
    plain_common,
    read_plain,
    zero_common,
    zero_target,
)
from megalite.optimizer.optimizer import ADAM_KINDS, merge_shard_state_dicts, upgrade_shard
from megalite.convert.sharding import (
    EMBEDDING_WEIGHT_NAME, full_state_dict, load_full_state_dict_into)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model",
                    "spiece.model")
Log = Callable[[str], None]


class ConversionError(ConfigError):
    """Conversion cannot proceed; the one-line message names the file or flag and why."""


def _quiet(_msg: str) -> None:
    pass


def _brief(e: BaseException) -> str:
    """An exception's message on one short line (error messages here are one line)."""
    return " ".join(str(e).split())[:200] or type(e).__name__


# ============================================================================== atomic output
@contextmanager
def atomic_output(path: str, flag: str = "--save") -> Iterator[str]:
    """Yield a temporary directory that becomes ``path`` only if the block completes."""
    path = os.path.abspath(path.rstrip("/") or path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConversionError(f"{flag} {path}: already exists and is not empty; choose a new "
                              f"directory (conversion never overwrites)")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
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


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage is exactly its data (torch.save and safetensors write whole
    storages; a view of a bigger tensor would bloat the file or be refused)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def _release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc's ``malloc_trim``; elsewhere a no-op).

    Once a large tensor is freed, glibc raises its mmap threshold to that size, so the next
    tensors of that size come from the heap, and freed heap memory stays resident: a converter
    that reads and drops a layer at a time would keep every layer's pages (measured: 5.7 layers
    at pp = 2 where 1 are live). Trimming after each layer keeps resident memory at what is
    live."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def _mapped_ranges(path: str) -> List[Tuple[int, int]]:
    """Address ranges where this process has ``path`` memory-mapped (Linux; else none)."""
    real, out = os.path.realpath(path), []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].rstrip("\n") == real:
                    a, b = fields[0].split("-")
                    out.append((int(a, 16), int(b, 16)))
    except OSError:
        pass
    return out


def _drop_mapped_pages(t: torch.Tensor, ranges: List[Tuple[int, int]]) -> None:
    """Let the kernel drop the resident pages of ``t``, a read-only view into a memory-mapped
    checkpoint file (``ranges``, from :func:`_mapped_ranges`), once it has been copied out: a
    touched page of a mapped file counts as the process's memory until the file is unmapped,
    which would hold a layer's source bytes beside its copy. Pages of a private file mapping
    that were never written are re-read from the file if touched again (``MADV_DONTNEED``),
    so this is only ever applied inside ``ranges``."""
    import ctypes
    import mmap

    st = t.untyped_storage()
    p, n = st.data_ptr(), st.nbytes()
    if not any(a <= p and p + n <= b for a, b in ranges):
        return
    page = mmap.PAGESIZE
    lo, hi = -(-p // page) * page, (p + n) // page * page
    if hi > lo:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo),
                                  mmap.MADV_DONTNEED)


# ====================================================================== streamed stage files
class _Spool:
    """A stage's tensors parked on disk while its files are assembled, then replayed into
    ``torch.save``'s own records: a stage is never whole in memory.

    ``torch.save`` writes ``data.pkl`` (the object's structure, which needs only each tensor's
    dtype, shape and storage) before the storages' bytes, so the bytes can arrive later. Each
    tensor handed to :meth:`stash` is written to a scratch file and replaced by a *stand-in*: a
    tensor of the same dtype, shape and storage size over an anonymous memory mapping that is
    never touched (no resident pages). :meth:`save` runs torch's serializer over the object of
    stand-ins, so the pickle and the record order are torch's own, and as each storage record
    is written it reads that tensor's bytes back from the scratch file. The file is byte for
    byte what ``torch.save`` of the real tensors writes (tests/test_checkpoint_convert.py);
    memory during the write is one tensor. Tensors below ``min_bytes`` are kept as they are
    (norms, biases: not worth a mapping each)."""

    def __init__(self, path: str, min_bytes: int = 1 << 16):
        self.path, self.min_bytes = path, min_bytes
        self._f = open(path, "w+b")
        self._at: Dict[int, Tuple[int, int]] = {}  # stand-in storage data_ptr -> (offset, n)
        self._keep: List[object] = []  # the mappings behind the stand-ins

    def stash(self, t: torch.Tensor) -> torch.Tensor:
        import mmap

        n = t.untyped_storage().nbytes()
        if n < self.min_bytes or n != t.numel() * t.element_size() or t.storage_offset():
            return t
        offset = self._f.seek(0, os.SEEK_END)
        self._f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        buf = mmap.mmap(-1, n)
        stand_in = torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(t.shape)
        self._keep.append(buf)
        self._at[stand_in.untyped_storage().data_ptr()] = (offset, n)
        return stand_in

    def save(self, obj, f) -> None:
        """``torch.save(obj, f)`` with the stand-ins' bytes read back from the scratch file."""
        import pickle

        from torch import serialization as ser

        spool = self

        class Records:
            """torch's zip writer, with each stand-in storage swapped for its bytes."""

            def __init__(self, writer):
                self.writer = writer

            def write_record(self, name, data, size):
                at = (spool._at.get(data.data_ptr())
                      if isinstance(data, torch.UntypedStorage) else None)
                if at is not None:
                    buf = torch.empty(at[1], dtype=torch.uint8)
                    spool._f.seek(at[0])
                    spool._f.readinto(buf.numpy().data)
                    data = buf.untyped_storage()
                self.writer.write_record(name, data, size)
                if at is not None:
                    del data, buf
                    _release_freed_memory()

            def write_record_metadata(self, name, size):
                self.writer.write_record_metadata(name, size)

        self._f.flush()
        writer = torch._C.PyTorchFileWriter(f, ser.get_crc32_options(),
                                            ser._get_storage_alignment())
        # torch.save's own steps for a file object (protocol 2, byte-order record kept)
        ser._save(obj, Records(writer), pickle, ser.DEFAULT_PROTOCOL, False)
        writer.write_end_of_file()

    def close(self) -> None:
        self._at.clear()
        self._f.close()
        for b in self._keep:
            try:
                b.close()
            except BufferError:  # a stand-in still referenced: the mapping goes with it
                pass
        self._keep.clear()
        os.unlink(self.path)


# ========================================================================== target checks
def check_target_layout(cfg: MegaliteConfig, layout: Layout, dp: Optional[int] = None) -> None:
    """Raise ConfigError (one line naming the flag) if the model cannot take ``layout``."""
    if layout.tp < 1 or layout.pp < 1:
        raise ConversionError(f"--tensor-model-parallel-size ({layout.tp}) and "
                              f"--pipeline-model-parallel-size ({layout.pp}) must be >= 1")
    if dp is not None and dp < 1:
        raise ConversionError(f"--data-parallel-size must be >= 1, got {dp}")
    m = cfg.model
    m.validate(layout.tp)  # heads, query groups, ffn % t: messages name the flags
    layout.ranges(m.num_layers)  # layers % (p * v), p <= layers
    tr = cfg.training
    if dp is not None and tr.global_batch_size and tr.micro_batch_size:
        if tr.global_batch_size % (tr.micro_batch_size * dp) != 0:
            raise ConversionError(
                f"--data-parallel-size {dp}: the checkpoint's global batch size "
                f"({tr.global_batch_size}) is not a multiple of micro-batch size "
                f"({tr.micro_batch_size}) x {dp}; resume with a different --global-batch-size or "
                f"choose another data-parallel size")


def _set_layout(cfg: MegaliteConfig, layout: Layout) -> None:
    """Record the new layout in args.json's parallel fields."""
    L = cfg.model.num_layers
    cfg.parallel.tensor_model_parallel_size = layout.tp
    cfg.parallel.pipeline_model_parallel_size = layout.pp
    v = layout.num_chunks(L)
    vpp = v > 1 and not layout.v_schedule
    cfg.parallel.virtual_pipeline_model_parallel_size = v if vpp else None
    if layout.tp == 1:  # sequence parallelism needs TP; a tp=1 target simply does not use it
        cfg.parallel.sequence_parallel = False
    cfg.training.decoder_first_pipeline_num_layers = layout.decoder_first
    cfg.training.decoder_last_pipeline_num_layers = layout.decoder_last
    if layout.v_schedule or cfg.training.pipeline_schedule in V_SCHEDULES or (
            v == 1 and cfg.training.pipeline_schedule == "interleaved"):
        cfg.training.pipeline_schedule = layout.v_schedule  # the V goes with its schedule


def _groups(specs: Sequence[ParamSpec], location: Callable[[str], tuple]
            ) -> List[List[ParamSpec]]:
    """Consecutive parameters read together: one transformer layer, or the non-layer tensors of
    one source stage. This is the unit of streaming."""
    out: List[List[ParamSpec]] = []
    key = None
    for s in specs:
        k = (layer_of(s.name), location(s.name))
        if out and k == key:
            out[-1].append(s)
        else:
            out.append([s])
            key = k
    return out


# ========================================================================= megalite source
class MegaliteSource:
    """A megalite checkpoint opened for streaming reads of canonical tensors."""

    def __init__(self, load_dir: str, iteration: Optional[int] = None, flag: str = "--load"):
        self.dir = os.path.abspath(load_dir)
        self.what = f"{flag} {load_dir}"
        if not os.path.isdir(self.dir):
            raise ConversionError(f"{self.what}: no such directory")
        if iteration is None:
            iteration = ckpt.read_tracker(self.dir)
            if iteration is None:
                raise ConversionError(f"{self.what}: no {ckpt.TRACKER_FILE} (not a megalite "
                                      f"checkpoint directory, or no save has completed)")
        self.iteration = int(iteration)
        self.it_dir = ckpt.iteration_dir(self.dir, self.iteration)
        if not os.path.isdir(self.it_dir):
            raise ConversionError(f"{self.what}: iteration {self.iteration} is missing "
                                  f"({self.it_dir} does not exist)")
        self.cfg = ckpt.read_checkpoint_config(self.dir, self.iteration)
        self.model_cfg = self.cfg.model
        self.layout = layout_of_config(self.cfg)
        try:
            self.chunks = chunks_of(self.layout, self.model_cfg.num_layers)
        except ConfigError as e:
            raise ConversionError(f"{self.what}: args.json describes an impossible layout ({e})")
        self.num_chunks = len(self.chunks[0])
        for r in range(self.layout.pp):
            for t in range(self.layout.tp):
                path = self._path(t, r)
                if not os.path.isfile(path):
                    raise ConversionError(f"{self.what}: {path} is missing (args.json says "
                                          f"{self.layout.describe()}; incomplete checkpoint?)")
        self._loc: Dict[int, Tuple[int, int]] = {}
        for r, rank_chunks in enumerate(self.chunks):
            for ch in rank_chunks:
                for i in range(*ch.layer_range):
                    self._loc[i] = (r, ch.index)
        head = self._open(0, 0)
        saved = (head.get("tensor_model_parallel_size"), head.get("pipeline_model_parallel_size"),
                 head.get("num_model_chunks", 1))
        if saved != (self.layout.tp, self.layout.pp, self.num_chunks):
            raise ConversionError(
                f"{self.what}: the shard files were saved with tp={saved[0]} pp={saved[1]} and "
                f"{saved[2]} chunk(s) per rank, args.json says {self.layout.describe()} and "
                f"{self.num_chunks}")
        self.consumed_samples = int(head.get("consumed_samples", 0))
        self.scheduler = head.get("opt_param_scheduler")
        # Which optimizer format the checkpoint holds (optimizer_state.py).
        self.optim_kind: Optional[str] = None
        self.dp_size = 1
        self.optim_common: Optional[OptimCommon] = None
        if "opt_param_scheduler" in head:
            if "optimizer" in head:
                self.optim_kind = "plain"
                self.optim_common = plain_common(head["optimizer"])
            elif os.path.isfile(self._dp_path(0, 0, 0)):
                while os.path.isfile(self._dp_path(0, 0, self.dp_size)):
                    self.dp_size += 1
                dp0 = upgrade_shard(self._load(self._dp_path(0, 0, 0)))
                self.optim_kind = "zero3" if dp0.get("zero_stage") == 3 else "zero"
                self.optim_common = zero_common(dp0)
                del dp0
        del head
        self._checked: set = set()
        self._plain_index = [None] * self.layout.pp

    # ------------------------------------------------------------------------------ files
    def _path(self, t: int, r: int) -> str:
        return os.path.join(self.it_dir, ckpt.shard_dir_name(t, r), ckpt.MODEL_FILE)

    def _dp_path(self, t: int, r: int, d: int) -> str:
        return os.path.join(self.it_dir, ckpt.shard_dir_name(t, r), ckpt.distrib_optim_name(d))

    def _load(self, path: str) -> dict:
        if not os.path.isfile(path):
            raise ConversionError(f"{self.what}: {path} is missing (incomplete checkpoint)")
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # truncated zip, bad pickle, disallowed global, ...
            raise ConversionError(f"{self.what}: {path} is corrupt or truncated ({_brief(e)})")

    def _open(self, t: int, r: int) -> dict:
        return self._load(self._path(t, r))

    def rng_state(self, t: int, r: int):
        """The RNG state of source rank (t mod T, r mod P): see docs (resharding cannot
        reproduce dropout masks of another layout anyway; this keeps every stream well defined)."""
        sd = self._open(t % self.layout.tp, r % self.layout.pp)
        state = sd.get("rng_state")
        return copy.deepcopy(state) if state is not None else None

    # ------------------------------------------------------------------------- locations
    def location(self, name: str) -> Tuple[int, int]:
        """(pp rank, chunk index) of the source chunk holding canonical parameter ``name``."""
        i = layer_of(name)
        if i is not None:
            if i not in self._loc:
                raise ConversionError(f"{self.what}: no layer {i} in this checkpoint")
            return self._loc[i]
        want = "pre" if name.startswith("embedding.") else "post"
        return next((c.pp_rank, c.index) for row in self.chunks for c in row if getattr(c, want))

    def _index(self, r: int) -> PlainIndex:
        if self._plain_index[r] is None:
            self._plain_index[r] = PlainIndex.build(
                rank_param_order(self.model_cfg, self.chunks[r], self.layout.pp))
        return self._plain_index[r]

    # ------------------------------------------------------------------------------ reads
    def read(self, names: Sequence[str], with_optim: bool = False
             ) -> Dict[str, Dict[str, Optional[torch.Tensor]]]:
        """Canonical tensors of ``names`` (all on one source chunk): ``{name: {"weight": ...,
        "master"/"exp_avg"/"exp_avg_sq": ... or None}}``; every tensor is a fresh copy."""
        if not names:
            return {}
        r, c = self.location(names[0])
        assert all(self.location(n) == (r, c) for n in names), names
        specs = {s.name: s for s in chunk_state_specs(self.model_cfg, self.chunks[r][c],
                                                       self.layout.pp)}
        key = chunk_key(c, self.num_chunks)
        per_t: Dict[str, Dict[str, List[torch.Tensor]]] = {n: {} for n in names}
        mapped: List[Tuple[int, int]] = []
        for t in range(self.layout.tp):
            sd = self._open(t, r)
            mapped += _mapped_ranges(self._path(t, r))
            where = f"{self.what}: {self._path(t, r)}"
            model_sd = sd.get(key)
            if model_sd is None:
                raise ConversionError(f"{where} has no {key!r} entry")
            for n in names:
                if n not in specs or n not in model_sd:
                    raise ConversionError(f"{where} has no tensor {n} (chunk {key})")
                w = model_sd[n]
                expect = specs[n].local_shape(self.model_cfg, self.layout.tp)
                if tuple(w.shape) != expect:
                    raise ConversionError(f"{where}: {n} has shape {tuple(w.shape)}, args.json "
                                          f"implies {expect}")
                per_t[n].setdefault("weight", []).append(w)
            if with_optim:  # (buffers have no optimizer state)
                self._read_optim(sd, t, r, c, [n for n in names if not specs[n].buffer], specs,
                                 per_t)
            # the state dict goes out of scope with this iteration: its file is unmapped once
            # the tensors copied out below are the only survivors
            del sd, model_sd
        out: Dict[str, Dict[str, Optional[torch.Tensor]]] = {}
        for n in names:
            out[n] = {}
            for k, shards in per_t[n].items():
                # a state that some TP rank lacks (never stepped) is absent as a whole
                out[n][k] = (None if any(x is None for x in shards)
                             else specs[n].unshard(shards, self.model_cfg))
            for w in per_t[n].get("weight", ()):  # copied out: its file pages can go
                _drop_mapped_pages(w, mapped)
            per_t[n] = {}
        return out

    def _read_optim(self, sd, t, r, c, names, specs, per_t) -> None:
        where = f"{self.what}: tp rank {t}, pp rank {r}"
        if not names:
            return
        if self.optim_kind is None:
            raise ConversionError(f"{self.what}: the checkpoint has no optimizer state (saved "
                                  f"with --no-save-optim); pass --no-optim")
        if self.optim_kind == "plain":
            opt_sd, index = sd["optimizer"], self._index(r)
            if (t, r) not in self._checked:
                check_plain(opt_sd, index, where)
                self._checked.add((t, r))
            for n in names:
                for k, v in read_plain(opt_sd, index, n).items():
                    per_t[n].setdefault(k, []).append(v)
            return
        sds = [self._load(self._dp_path(t, r, d)) for d in range(self.dp_size)]
        # Files that shard experts over an expert-data-parallel group (EP > 1) hold only some
        # EP ranks' experts; that group can span TP ranks, so the stage's every file comes along.
        stage = []
        if "edp_size" in sds[0] and self.layout.tp > 1:
            stage = [x for u in range(self.layout.tp) for x in (
                sds if u == t else [self._load(self._dp_path(u, r, d))
                                    for d in range(self.dp_size)])]
        # The files name each piece: the checkpoint loader's own merge reads them (no layout
        # rebuilt), experts by global index.
        key = (lambda n: n) if self.optim_kind == "zero3" or self.num_chunks == 1 else (
            lambda n: f"chunk{c}.{n}")
        metas = {key(n): specs[n].meta for n in names}
        try:
            merged = merge_shard_state_dicts(sds, stage, metas.__getitem__,
                                             names=[key(n) for n in names])["params"]
        except (KeyError, ValueError) as e:
            raise OptimizerStateError(f"{where}: the distrib_optim_dp*.pt files cannot be merged "
                                      f"({e}); pass --no-optim")
        for n in names:
            expect = specs[n].local_shape(self.model_cfg, self.layout.tp)
            entry = merged[key(n)]
            if tuple(entry["master"].shape) != expect:
                raise OptimizerStateError(f"{where}: the optimizer state of {n} has shape "
                                          f"{tuple(entry['master'].shape)}, args.json implies "
                                          f"{expect}")
            for k in ADAM_KINDS:
                per_t[n].setdefault(k, []).append(entry[k])
        del sds, stage


# ======================================================================== target writing
def _stage_header(iteration: int, consumed: int, layout: Layout, num_chunks: int) -> dict:
    return {"checkpoint_version": ckpt.CHECKPOINT_VERSION, "iteration": int(iteration),
            "consumed_samples": int(consumed), "tensor_model_parallel_size": layout.tp,
            "pipeline_model_parallel_size": layout.pp, "num_model_chunks": num_chunks}


def _fresh_scheduler_state(cfg: MegaliteConfig) -> dict:
    from megalite.optimizer.lr_scheduler import OptimizerParamScheduler

    holder = types.SimpleNamespace(param_groups=[{}])
    return OptimizerParamScheduler.from_config(holder, cfg.optimizer,
                                               cfg.training.train_iters).state_dict()


class StageFiles(NamedTuple):
    """What one (tp, pp) rank of a layout holds: its model file (``model_optim_rng.pt``'s
    dict) and, for a ZeRO optimizer, its DP ranks' ``distrib_optim_dp{d}.pt`` dicts by d."""
    tp_rank: int
    model_file: dict
    zero_files: Optional[Dict[int, dict]]


def assemble_stage(cfg: MegaliteConfig, layout: Layout, r: int, iteration: int,
                   read_group: Callable[[List[ParamSpec], bool],
                                        Dict[str, Dict[str, torch.Tensor]]],
                   *, tp_ranks: Optional[Sequence[int]] = None,
                   dp_ranks: Optional[Sequence[int]] = None, consumed: int = 0,
                   optim: Optional[str] = None, common: Optional[OptimCommon] = None,
                   scheduler: Optional[dict] = None, dp: int = 1,
                   rng: Optional[Callable[[int, int], object]] = None,
                   weight_dtype: Optional[torch.dtype] = None,
                   what: str = "source",
                   hold: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                   ) -> List[StageFiles]:
    """The files of pipeline stage ``r`` of ``layout`` for TP ranks ``tp_ranks`` (default all)
    and, with a ZeRO ``optim``, DP ranks ``dp_ranks`` of ``dp`` (default all): the one assembly
    of a target layout, which the converter writes (:func:`_write_stages`) and a load at another
    layout keeps in memory (:func:`load_resharded`).

    ``read_group(specs, with_optim)`` returns canonical tensors for a group of parameters (one
    layer, or the non-layer tensors), read one group at a time; ``optim`` is None (no optimizer
    state), "plain", "zero" (ZeRO-1/2 files), "zero3" (ZeRO-3 files) or "fresh" (an empty plain
    state, so a plain --load of an imported model works). Memory: the TP ranks' model shards of
    the stage, their optimizer state (for ZeRO only the asked DP ranks' shards, filled as each
    group is read) and one group's canonical tensors. ``hold`` (given a model-file tensor,
    returns what the file keeps of it: the streamed writer's :meth:`_Spool.stash`) takes the
    model shards out of memory as they are made; not with a "plain" ``optim``, whose fp32
    masters are the model tensors themselves.
    """
    assert hold is None or optim != "plain"
    m = cfg.model
    chunks = chunks_of(layout, m.num_layers)
    v = len(chunks[0])
    tps = list(range(layout.tp)) if tp_ranks is None else list(tp_ranks)
    with_optim = optim in ("plain", "zero", "zero3")
    mixed = m.params_dtype != "float32"
    files = {t: _stage_header(iteration, consumed, layout, v) for t in tps}
    zero = None
    if optim in ("zero", "zero3"):
        zero = {t: zero_target(optim, m, chunks[r], layout.pp, layout.tp, dp, cfg.optimizer,
                               dp_ranks) for t in tps}
    # plain optimizer state, per TP rank (ZeRO state goes straight into its shards instead)
    local: Dict[int, Dict[str, Dict[str, torch.Tensor]]] = {t: {} for t in tps}
    for c, ch in enumerate(chunks[r]):
        key = chunk_key(c, v)
        for f in files.values():
            f[key] = {}
        specs = chunk_state_specs(m, ch, layout.pp)
        for group in _groups(specs, lambda n: layer_of(n) is None and n.split(".")[0]):
            full = read_group(group, with_optim)
            for s in group:
                src = full[canonical_name(s.name, m)]
                w = src["weight"]
                if tuple(w.shape) != s.full_shape(m):
                    raise ConversionError(f"{what}: {s.name} has shape {tuple(w.shape)}, the "
                                          f"model needs {s.full_shape(m)}")
                if weight_dtype is not None and not s.buffer:  # (buffers keep theirs)
                    w = w.to(weight_dtype)
                for t in tps:
                    w_t = _own_storage(s.shard(w, m, t, layout.tp))
                    files[t][key][s.name] = w_t if hold is None else hold(w_t)
                    if not with_optim or s.buffer:
                        continue
                    state = {k: (s.shard(x, m, t, layout.tp) if x is not None else None)
                             for k, x in src.items() if k != "weight"}
                    if state.get("master") is None:
                        # fp32 models have no separate master: the weight is the master
                        state["master"] = w_t.float()
                    if zero is not None:
                        for k in ADAM_KINDS:
                            zero[t].fill(s.name, k, state.get(k))
                    else:
                        local[t][s.name] = {k: (_own_storage(x) if x is not None else None)
                                            for k, x in state.items()}
            del full
            w = w_t = None  # (the last group's tensors go too)
            _release_freed_memory()
    out = []
    order = rank_param_order(m, chunks[r], layout.pp) if optim is not None else None
    for t in tps:
        f = files[t]
        if optim in ("plain", "fresh"):
            f["optimizer"] = build_plain(
                PlainIndex.build(order), lambda n, k, t=t: local[t].get(n, {}).get(k),
                common or OptimCommon(), cfg.optimizer, mixed=mixed and optim == "plain")
        if optim is not None:
            f["opt_param_scheduler"] = (scheduler if scheduler is not None
                                        else _fresh_scheduler_state(cfg))
        if rng is not None:
            state = rng(t, r)
            if state is not None:
                f["rng_state"] = state
        out.append(StageFiles(t, f, None if zero is None else
                              zero[t].files(common or OptimCommon(), cfg.optimizer)))
        local[t] = {}
    return out


def _write_stages(tmp: str, cfg: MegaliteConfig, layout: Layout, iteration: int,
                  read_group: Callable[[List[ParamSpec], bool], Dict[str, Dict[str, torch.Tensor]]],
                  *, log: Log = _quiet, **kw) -> None:
    """Write iteration ``iteration`` of ``layout`` into ``tmp``, one pipeline stage at a time
    (:func:`assemble_stage` builds each; ``kw`` are its options). Model files are streamed
    (:class:`_Spool`: a layer in memory, not the stage) unless the optimizer is "plain", whose
    state sits in the model file and shares the fp32 weights' storage; then the stage is
    assembled in memory and saved with one ``torch.save``."""
    it_dir = ckpt.iteration_dir(tmp, iteration)
    streamed = kw.get("optim") != "plain"
    for r in range(layout.pp):
        spool = _Spool(os.path.join(tmp, f".stage-{r}.spool")) if streamed else None
        try:
            stage = assemble_stage(cfg, layout, r, iteration, read_group,
                                   hold=spool.stash if spool else None, **kw)
            while stage:  # each file dropped once written: one stage in memory at a time
                t, model_file, zero_files = stage.pop(0)
                shard = os.path.join(it_dir, ckpt.shard_dir_name(t, r))
                os.makedirs(shard, exist_ok=True)
                path = os.path.join(shard, ckpt.MODEL_FILE)
                if spool is None:
                    ckpt.save_file(path, model_file)
                else:  # the same bytes, flushed and fsynced as save_file's
                    ckpt._write(path, lambda f, obj=model_file: spool.save(obj, f))
                for d, zsd in (zero_files or {}).items():
                    ckpt.save_file(os.path.join(shard, ckpt.distrib_optim_name(d)), zsd)
                del model_file, zero_files
        finally:
            if spool is not None:
                spool.close()
        log(f" wrote pipeline stage {r + 1}/{layout.pp} ({layout.tp} tensor-parallel file(s))")


def _finish_checkpoint(tmp: str, cfg: MegaliteConfig, iteration: int,
                       tokenizer_src: Optional[str]) -> None:
    with open(os.path.join(ckpt.iteration_dir(tmp, iteration), "args.json"), "w") as f:
        f.write(config_to_json(cfg))
    if tokenizer_src is not None:
        shutil.copytree(tokenizer_src, os.path.join(tmp, "tokenizer"))
    with open(os.path.join(tmp, ckpt.TRACKER_FILE), "w") as f:
        f.write(str(iteration))


# ================================================================================= reshard
def _source_reader(src: MegaliteSource, m: ModelConfig):
    """assemble_stage's ``read_group`` over a megalite checkpoint: a group's canonical tensors,
    read from the source stage(s) holding them."""

    def read_group(group: List[ParamSpec], with_optim: bool):
        by_loc: Dict[Tuple[int, int], List[str]] = {}
        for s in group:
            name = canonical_name(s.name, m)
            names = by_loc.setdefault(src.location(name), [])
            if name not in names:
                names.append(name)
        out = {}
        for names in by_loc.values():
            out.update(src.read(names, with_optim))
        return out

    return read_group


def reshard(load_dir: str, save_dir: str, layout: Layout, *, data_parallel_size: Optional[int]
            = None, no_optim: bool = False, iteration: Optional[int] = None,
            zero_stage: Optional[int] = None, log: Log = _quiet) -> str:
    """Rewrite checkpoint ``load_dir`` for ``layout``: weights and (unless ``no_optim``) the
    optimizer (Adam moments, fp32 masters, step, grad scaler), LR-scheduler position, RNG state,
    iteration and consumed samples. Returns the output directory."""
    src = MegaliteSource(load_dir, iteration)
    cfg = copy.deepcopy(src.cfg)
    if zero_stage is not None:
        cfg.optimizer.zero_stage = zero_stage
    target_zero = cfg.optimizer.zero_stage >= 1
    dp = data_parallel_size
    if dp is None:
        dp = src.dp_size if src.optim_kind in ("zero", "zero3") else 1
    check_target_layout(cfg, layout, dp)
    optim = None
    if not no_optim:
        if src.optim_kind is None:
            raise ConversionError(f"--load {load_dir}: the checkpoint has no optimizer state "
                                  f"(saved with --no-save-optim); pass --no-optim")
        optim = ("zero3" if cfg.optimizer.zero_stage == 3 else
                 "zero" if target_zero else "plain")
        if target_zero and cfg.optimizer.zero_stage == 0:
            cfg.optimizer.zero_stage = 1
    _set_layout(cfg, layout)
    if no_optim:
        cfg.checkpoint.no_save_optim = True
    tok = os.path.join(src.dir, "tokenizer")
    log(f" resharding {load_dir} (iteration {src.iteration}, {src.layout.describe()}) -> "
        f"{layout.describe()}" + (f" dp={dp}" if optim in ("zero", "zero3") else "") +
        ("" if optim else " without optimizer state"))

    read_group = _source_reader(src, cfg.model)

    with atomic_output(save_dir) as tmp:
        _write_stages(tmp, cfg, layout, src.iteration, read_group,
                      consumed=src.consumed_samples, optim=optim, common=src.optim_common,
                      scheduler=src.scheduler, dp=dp, rng=src.rng_state, what=src.what, log=log)
        _finish_checkpoint(tmp, cfg, src.iteration, tok if os.path.isdir(tok) else None)
    return os.path.abspath(save_dir)


def load_resharded(load_dir: str, iteration: int, cfg: MegaliteConfig, ps, with_optim: bool
                   ) -> Tuple[dict, Optional[dict]]:
    """Resharding on load: this rank's model file and optimizer state at the running job's
    layout (``cfg``: TP, PP, virtual stages, ZeRO stage; ``ps``: this rank and the DP x CP size),
    assembled from checkpoint ``load_dir`` saved at any other layout, by the same
    :func:`assemble_stage` the converter writes with. Only this rank's (TP, PP) shards and, for
    ZeRO, its own DP shard are built; the source files are memory-mapped and read a layer at a
    time, so no rank holds more than its share and one layer (docs/checkpoints.md, "Resharding
    on load"). The dicts are what the rank's own files would hold after an offline reshard, less
    the RNG state (checkpointing.load_checkpoint re-seeds instead); it loads them as its own."""
    src = MegaliteSource(load_dir, iteration)
    z = cfg.optimizer.zero_stage
    optim = None
    if with_optim:
        if src.optim_kind is None:
            raise ConversionError(f"{src.what}: the checkpoint has no optimizer state (saved "
                                  f"with --no-save-optim); pass --no-load-optim or --finetune")
        optim = "zero3" if z == 3 else "zero" if z >= 1 else "plain"
    layout = layout_of_config(cfg)
    (files,) = assemble_stage(cfg, layout, ps.pp_rank, src.iteration,
                              _source_reader(src, cfg.model), tp_ranks=[ps.tp_rank],
                              dp_ranks=[ps.dp_cp_rank], consumed=src.consumed_samples,
                              optim=optim, common=src.optim_common, scheduler=src.scheduler,
                              dp=ps.dp_cp_size, what=src.what)
    state = files.model_file
    if optim == "plain":
        return state, state.pop("optimizer")
    return state, None if files.zero_files is None else files.zero_files[ps.dp_cp_rank]


# ============================================================================ Hugging Face in
class HFSource:
    """A local Hugging Face directory of a SUPPORTED_ARCHITECTURES model, read tensor by tensor."""

    def __init__(self, hf_dir: str, **config_overrides):
        self.dir = os.path.abspath(hf_dir)
        self.what = f"--hf-dir {hf_dir}"
        if not os.path.isdir(self.dir):
            raise ConversionError(f"{self.what}: no such directory")
        cfg_path = os.path.join(self.dir, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConversionError(f"{self.what}: no config.json (not a Hugging Face model "
                                  f"directory)")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConversionError(f"{self.what}: config.json is not valid JSON ({e})")
        refusal = refused_hf_config(raw)  # GPT-OSS, Llama 4, FP8: the field that is refused
        if refusal is not None:
            raise ConversionError(f"{self.what}: {refusal}")
        # Checked before AutoConfig, whose error for an unknown model_type is long and vague.
        # GPT2Model (no LM head) is accepted: its keys lack only the "transformer." prefix.
        ok = SUPPORTED_ARCHITECTURES + ("GPT2Model",)
        archs = raw.get("architectures") or []
        if raw.get("model_type") not in FAMILY_OF_MODEL_TYPE or any(a not in ok for a in archs):
            bad = next((a for a in archs if a not in ok), raw.get("model_type"))
            raise ConversionError(f"{self.what}: unsupported Hugging Face architecture {bad!r} "
                                  f"(model_type {raw.get('model_type')!r}); megalite converts "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        from transformers import AutoConfig

        try:
            self.hf_config = AutoConfig.from_pretrained(self.dir, local_files_only=True)
        except Exception as e:
            raise ConversionError(f"{self.what}: config.json cannot be read by transformers "
                                  f"({_brief(e)})")
        self.family = hf_family(self.hf_config)
        self.model_cfg = hf_config_to_model_config(self.hf_config, **config_overrides)
        self.key_file = self._index_weights()
        check_hf_weight_names(self.key_file, self.what)
        self._alias: Dict[str, str] = {}
        if self.family == "gpt2" and not any(k.startswith("transformer.") for k in self.key_file):
            # GPT2Model checkpoints (e.g. the original "gpt2" upload) lack the LM-head prefix
            self._alias = {"transformer." + k: k for k in self.key_file
                           if not k.startswith("lm_head.")}
        self.used: set = set()
        self._st_headers: Dict[str, Tuple[int, dict]] = {}

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
                    raise ConversionError(f"{self.what}: {index_name} is not a valid index ({e})")
                for fname in sorted(set(weight_map.values())):
                    if not os.path.isfile(os.path.join(d, fname)):
                        raise ConversionError(f"{self.what}: {fname} is missing (named by "
                                              f"{index_name})")
                return {k: os.path.join(d, v) for k, v in weight_map.items()}
        for fname in ("model.safetensors", "pytorch_model.bin"):
            path = os.path.join(d, fname)
            if os.path.isfile(path):
                return {k: path for k in self._keys_of(path)}
        raise ConversionError(f"{self.what}: no weights (model.safetensors, "
                              f"model.safetensors.index.json, pytorch_model.bin or "
                              f"pytorch_model.bin.index.json)")

    def _keys_of(self, path: str) -> List[str]:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            try:
                with safe_open(path, framework="pt") as f:
                    return list(f.keys())
            except Exception as e:
                raise ConversionError(f"{self.what}: {os.path.basename(path)} is not a readable "
                                      f"safetensors file ({_brief(e)})")
        return list(self._load_bin(path).keys())

    def _load_bin(self, path: str) -> dict:
        # weights_only: a checkpoint never executes code on load (docs/design.md, contract 9)
        for mmap in (True, False):  # legacy (pre-zip) torch files cannot be memory-mapped
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except Exception as e:
                if mmap and isinstance(e, RuntimeError):
                    continue
                raise ConversionError(f"{self.what}: {os.path.basename(path)} cannot be loaded "
                                      f"({_brief(e)})")

    def get(self, keys: Sequence[str], where: str) -> Dict[str, torch.Tensor]:
        """Copies of the named tensors (HF LM-head names), reading only those."""
        by_file: Dict[str, List[Tuple[str, str]]] = {}
        for k in keys:
            stored = self._alias.get(k, k)
            if stored not in self.key_file:
                raise ConversionError(f"{self.what}: tensor {k} ({where}) is missing from the "
                                      f"weights; config.json and the weights disagree")
            by_file.setdefault(self.key_file[stored], []).append((k, stored))
        out = {}
        for path, pairs in by_file.items():
            if path.endswith(".safetensors"):
                for k, stored in pairs:
                    out[k] = self._read_safetensor(path, stored)
            else:
                sd = self._load_bin(path)
                for k, stored in pairs:
                    out[k] = sd[stored].clone()
                del sd
            self.used.update(stored for _, stored in pairs)
        return out

    def _read_safetensor(self, path: str, key: str) -> torch.Tensor:
        """One tensor of a safetensors file, read with plain file reads straight into its own
        memory. (safetensors' reader memory-maps the file: every page it copies from stays
        resident beside the copy until the file is closed, a second layer of memory.) The format
        is an 8-byte little-endian header length, a JSON header of dtype, shape and
        data_offsets per tensor, then the raw little-endian bytes."""
        header = self._st_headers.get(path)
        if header is None:
            try:
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    header = (8 + n, json.loads(f.read(n)))
            except (OSError, ValueError) as e:
                raise ConversionError(f"{self.what}: {os.path.basename(path)} is not a "
                                      f"readable safetensors file ({_brief(e)})")
            self._st_headers[path] = header
        start, entries = header
        e = entries[key]
        dtype = _SAFETENSORS_DTYPES.get(e["dtype"])
        if dtype is None:
            raise ConversionError(f"{self.what}: {os.path.basename(path)}: tensor {key} has "
                                  f"dtype {e['dtype']}, which megalite does not read")
        begin, end = e["data_offsets"]
        t = torch.empty(e["shape"], dtype=dtype)
        if t.numel() * t.element_size() != end - begin:
            raise ConversionError(f"{self.what}: {os.path.basename(path)}: tensor {key} has "
                                  f"{end - begin} bytes for shape {e['shape']} {e['dtype']}")
        if end > begin:
            with open(path, "rb") as f:
                f.seek(start + begin)
                if f.readinto(t.reshape(-1).view(torch.uint8).numpy().data) != end - begin:
                    raise ConversionError(f"{self.what}: {os.path.basename(path)} is truncated "
                                          f"(tensor {key})")
        return t

    def lazy(self, keys: Sequence[str], where: str) -> "_LazyTensors":
        """The named tensors as a mapping that reads each when it is looked up (and keeps
        none): a conversion that copies tensors into a bigger one (the stacked experts) holds
        one hub tensor at a time, not the layer's."""
        for k in keys:
            if self._alias.get(k, k) not in self.key_file:
                raise ConversionError(f"{self.what}: tensor {k} ({where}) is missing from the "
                                      f"weights; config.json and the weights disagree")
        return _LazyTensors(self, keys, where)

    def unused(self) -> List[str]:
        m = self.model_cfg
        skip = {"lm_head.weight"} if m.tie_embeddings else set()
        skip.update(self.dropped())
        return [k for k in self.key_file if k not in self.used and k not in skip
                and not k.endswith(IGNORED_HF_SUFFIXES)]

    def dropped(self) -> List[str]:
        """Tensors the import leaves out on purpose (multi-token-prediction layers)."""
        return dropped_hf_keys(self.key_file, self.model_cfg)

    def read_layer(self, i: int) -> Dict[str, torch.Tensor]:
        where = f"layer {i}"
        hf = self.lazy(hf_layer_keys(i, self.model_cfg), where)
        try:
            return convert_layer_hf_to_megalite(i, hf, self.model_cfg)
        except (RuntimeError, ValueError) as e:
            raise ConversionError(f"{self.what}: {where} tensors do not fit config.json "
                                  f"({_brief(e)})")

    def read_non_layer(self, names: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
        """The non-layer tensors (megalite ``names`` of them, default all), canonical."""
        hf = self.get(hf_non_layer_keys(self.model_cfg, names),
                      "embeddings / final norm / lm_head")
        try:
            out = convert_non_layer_hf_to_megalite(hf, self.model_cfg, names)
        except (RuntimeError, ValueError) as e:
            raise ConversionError(f"{self.what}: embedding or output tensors do not fit "
                                  f"config.json ({_brief(e)})")
        # canonical vocab tensors are unpadded
        # (a clone only where padding rows were added: else the view is the whole tensor)
        vocab = self.model_cfg.vocab_size
        return {k: (v[:vocab].clone() if k in (EMBEDDING_WEIGHT_NAME, "output_layer.weight")
                    and v.shape[0] != vocab else v) for k, v in out.items()}

    def has_tokenizer(self) -> bool:
        return any(os.path.isfile(os.path.join(self.dir, f)) for f in _TOKENIZER_FILES)


class _LazyTensors(Mapping):
    """HFSource.lazy's mapping: a KeyError for names it was not given, as a dict."""

    def __init__(self, src: "HFSource", keys: Sequence[str], where: str):
        self.src, self.keys_, self.where = src, list(keys), where

    def __getitem__(self, k: str) -> torch.Tensor:
        if k not in self.keys_:
            raise KeyError(k)
        return self.src.get([k], self.where)[k]

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


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
        if name not in SUPPORTED_ARCHITECTURES:
            raise unsupported_architecture(name)
        cfg = hf_config_to_model_config(hf_model_or_dir.config, **config_overrides)
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
        out = {}
        i = layer_of(group[0].name)
        if i is not None:
            tensors = src.read_layer(i)
        else:  # read when a stage needs them and dropped after, as a layer is
            tensors = src.read_non_layer(list(dict.fromkeys(
                canonical_name(s.name, m) for s in group)))
        for s in group:
            name = canonical_name(s.name, m)
            if name not in tensors:
                raise ConversionError(f"{src.what}: no tensor maps to {name}")
            out[name] = {"weight": tensors[name]}
        return out

    dtype = dtype_from_name(m.params_dtype)
    with atomic_output(save_dir) as tmp:
        _write_stages(tmp, cfg, layout, 0, read_group, optim="fresh", weight_dtype=dtype,
                      what=f"{src.what} (config.json and weights disagree)", log=log)
        unused, dropped = src.unused(), src.dropped()
        if dropped:
            log(f" note: {len(dropped)} tensor(s) of the multi-token-prediction layer(s) after "
                f"layer {m.num_layers - 1} are not imported (HF drops them on load too)")
        if unused:
            raise ConversionError(f"{src.what}: {len(unused)} tensor(s) in the weights map to "
                                  f"nothing in a {m.num_layers}-layer model (config.json and "
                                  f"weights disagree?): {', '.join(unused[:3])}")
        _finish_checkpoint(tmp, cfg, 0, None)
        if src.has_tokenizer():
            _save_hf_tokenizer(src, os.path.join(tmp, "tokenizer"), m, log)
    return os.path.abspath(save_dir)


def _save_hf_tokenizer(src: HFSource, target: str, m: ModelConfig, log: Log) -> None:
    """The HF tokenizer, re-saved with save_pretrained as pretrain.py saves its own
    (checkpointing.save_tokenizer), so ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model
    OUT/tokenizer`` and tools/generate.py find it."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src.dir, local_files_only=True)
    except Exception as e:
        raise ConversionError(f"{src.what}: the tokenizer files there cannot be loaded "
                              f"({_brief(e)})")
    tok.save_pretrained(target)
    if len(tok) > m.vocab_size:
        log(f" note: the tokenizer has {len(tok)} ids but the model's vocab_size is only "
            f"{m.vocab_size}; pretrain.py refuses to train with it (ids without an embedding row)")


# =========================================================================== Hugging Face out
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
            t = _own_storage(t.detach().cpu())
            n = t.numel() * t.element_size()
            if self.pending and self.pending_bytes + n > self.max_bytes:
                self._flush()
            self.pending[k] = t
            self.pending_bytes += n
            self.total += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, os.path.join(self.dir, name), metadata={"format": "pt"})
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
    tokenizer = None
    if os.path.isdir(tok_dir):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        except Exception as e:
            raise ConversionError(f"--load {load_dir}: tokenizer/ cannot be loaded "
                                  f"({_brief(e)})")
    # ConfigError if no HF class fits
    hf_config = model_config_to_hf_config(m, **special_token_ids(tokenizer))
    log(f" exporting {load_dir} (iteration {src.iteration}, {src.layout.describe()}) as "
        f"{hf_config.architectures[0]}")
    with atomic_output(save_dir) as tmp:
        shards = _SafetensorsShards(tmp, max_shard_bytes)
        by_loc: Dict[Tuple[int, int], List[str]] = {}
        for name in megalite_non_layer_keys(m):
            by_loc.setdefault(src.location(name), []).append(name)
        non_layer = {}
        for names in by_loc.values():
            non_layer.update({n: v["weight"] for n, v in src.read(names).items()})
        shards.add(convert_non_layer_megalite_to_hf(non_layer, m))
        del non_layer
        for i in range(m.num_layers):
            full = {n: v["weight"] for n, v in src.read(megalite_layer_keys(i, m)).items()}
            shards.add(convert_layer_megalite_to_hf(i, full, m))
            del full
            _release_freed_memory()
        shards.finish()
        hf_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return os.path.abspath(save_dir)
