"""Where text comes from: ``--data-path`` entries, the built-in corpus, and on-the-fly tokenization
(docs/data.md, "Formats accepted by --data-path" and "The built-in corpus")."""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from typing import Iterator, List, Optional, Tuple

import numpy as np

from megalite.collectives import one_line
from megalite.config import ConfigError, DataConfig
from megalite.data import indexed_dataset
from megalite.data.gpt_dataset import ArrayDocumentStore, parse_blend

# Bump when the tokenized layout or the corpus recipe changes, so stale caches are not reused.
CACHE_VERSION = "1"

_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
             ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")


def cache_root(data_cfg: Optional[DataConfig] = None, cache_dir: Optional[str] = None) -> str:
    root = cache_dir or (data_cfg.data_cache_path if data_cfg is not None else None)
    return os.path.abspath(os.path.expanduser(root or "~/.cache/megalite"))


def hf_cache_dir(cache_dir: Optional[str]) -> Optional[str]:
    """Where ``datasets`` keeps its cache: under cache_dir when one is given, else its default."""
    return os.path.join(os.path.abspath(cache_dir), "hf_datasets") if cache_dir else None


def _fingerprint(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------- classification


def _builder_for(path: str) -> Optional[str]:
    p = path.lower()
    for c in _COMPRESSION:
        if p.endswith(c):
            p = p[: -len(c)]
    return _BUILDERS.get(os.path.splitext(p)[1])


def _looks_local(path: str) -> bool:
    """A string that cannot be a hub name (``name`` or ``org/name``) is meant as a local path."""
    return (path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or "\\" in path
            or _builder_for(path) is not None or path.endswith((".bin", ".idx")))


def classify_data_path(path: str) -> str:
    """'indexed', 'local' or 'hub'; missing local paths raise."""
    if indexed_dataset.exists(path):
        return "indexed"
    if os.path.exists(path):
        return "local"
    for partial in (indexed_dataset.data_file_path(path), indexed_dataset.index_file_path(path)):
        if os.path.isfile(partial):
            other = ".idx" if partial.endswith(".bin") else ".bin"
            raise ConfigError(f"--data-path: {partial} exists but {path}{other} does not; an "
                              f"indexed dataset needs both PREFIX.bin and PREFIX.idx")
    if _looks_local(os.path.expanduser(path)):
        raise ConfigError(f"--data-path: {path} does not exist; give an existing file or folder "
                          f"(txt, json/jsonl, parquet, arrow), a PREFIX with PREFIX.bin/.idx, "
                          f"or a Hugging Face dataset name")
    return "hub"


# ------------------------------------------------------------------------------------ loading text


def _local_files(path: str) -> Tuple[str, List[str]]:
    if os.path.isfile(path):
        builder = _builder_for(path)
        if builder is None:
            raise ConfigError(f"--data-path: {path} has an unsupported extension; valid: "
                              f"{', '.join(sorted(_BUILDERS))} (optionally compressed), or a "
                              f"PREFIX of .bin/.idx")
        return builder, [path]
    files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                   if os.path.isfile(f) and _builder_for(f) is not None)
    builders = {_builder_for(f) for f in files}
    if not files:
        raise ConfigError(f"--data-path: folder {path} has no data files; valid extensions: "
                          f"{', '.join(sorted(_BUILDERS))}")
    if len(builders) > 1:
        raise ConfigError(f"--data-path: folder {path} mixes formats {sorted(builders)}; give one "
                          f"format per entry (a blend can combine folders)")
    return builders.pop(), files


def load_text_dataset(path: str, cache_dir: Optional[str] = None, num_proc: int = 0):
    """A ``datasets.Dataset`` for a local or hub ``--data-path`` entry (not for indexed data)."""
    import datasets

    kind = classify_data_path(path)
    num_proc = num_proc if num_proc and num_proc > 1 else None
    if kind == "local":
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "state.json")):
            ds = datasets.load_from_disk(path)  # a Dataset.save_to_disk folder
            return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
        builder, files = _local_files(path)
        # a document per paragraph: a line per document would put an EOD every few dozen tokens,
        # a file per document would leave a single-file corpus nothing to split
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        if all(_has_no_content(f) for f in files):
            # datasets' own errors for this case (StopIteration, 'corresponds to no data') do not
            # say what is wrong; an empty or whitespace-only file is the common cause.
            raise ConfigError(f"--data-path: {path} is empty (no documents); give a file with at "
                              f"least one non-empty document")
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train",
                                       cache_dir=hf_cache_dir(cache_dir), num_proc=num_proc,
                                       **kwargs)
        except Exception as e:  # parse errors of user files: name the file, keep one line
            raise ConfigError(f"--data-path: cannot read {path} as {builder}: "
                              f"{one_line(e)}") from e
        if builder == "text":
            # datasets splits paragraphs on "\n\n" literally; the blank lines around a paragraph
            # are separators, not content.
            ds = ds.map(_strip_paragraphs, batched=True, desc="paragraphs")
        return ds
    if kind == "indexed":
        raise ValueError(f"{path} is an indexed dataset; it has no text to load")
    try:
        return datasets.load_dataset(path, split="train", cache_dir=hf_cache_dir(cache_dir),
                                     num_proc=num_proc)
    except Exception as e:
        raise ConfigError(f"--data-path: {path!r} is not a local file/folder or PREFIX.bin/.idx, "
                          f"and loading it as a Hugging Face dataset failed (offline or no such "
                          f"dataset): {one_line(e)}") from e


def _has_no_content(path: str) -> bool:
    """True for an empty or whitespace-only uncompressed file (compressed files: let datasets
    say)."""
    if path.endswith((".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")):
        return False
    if os.path.getsize(path) == 0:
        return True
    if os.path.getsize(path) > 1 << 20:
        return False  # large files are not read twice just for this check
    with open(path, "rb") as f:
        return f.read().strip() == b""


def _strip_paragraphs(batch):
    return {"text": [t.strip("\n") for t in batch["text"]]}


def text_column(ds, text_field: str, where: str) -> str:
    if text_field not in ds.column_names:
        raise ConfigError(f"--dataset-text-field: column {text_field!r} not found in {where}; "
                          f"available columns: {', '.join(ds.column_names) or '(none)'}")
    return text_field


# ------------------------- the built-in corpus: the running interpreter's standard library sources


_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> List[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        out.extend(os.path.join(d, f) for f in sorted(files) if f.endswith(".py"))
    return sorted(out)


def builtin_corpus_fingerprint(files: Optional[List[str]] = None) -> str:
    """Interpreter version and each file's path and size: hashing tens of MB of content would cost
    more than the cache saves on small vocabularies."""
    files = stdlib_files() if files is None else files
    return _fingerprint("stdlib", CACHE_VERSION, sys.version,
                        [(f, os.path.getsize(f)) for f in files])


def _read_files(files, fingerprint):  # fingerprint is in gen_kwargs only to key datasets' cache
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            yield {"text": fh.read(), "path": os.path.relpath(f, sysconfig.get_paths()["stdlib"])}


def builtin_corpus(cache_dir: Optional[str] = None):
    """The built-in corpus, a ``datasets.Dataset`` with a "text" column (one file per row)."""
    import datasets

    files = stdlib_files()
    fp = builtin_corpus_fingerprint(files)
    root = cache_root(None, cache_dir)
    return datasets.Dataset.from_generator(
        _read_files, gen_kwargs={"files": files, "fingerprint": fp},
        cache_dir=os.path.join(root, "hf_datasets"))


def text_datasets(data_cfg: DataConfig, cache_dir: Optional[str] = None):
    """[(name, Dataset)] of every text source the config names (built-in corpus when none)."""
    if data_cfg.data_path is None:
        return [("builtin:stdlib", builtin_corpus(cache_root(data_cfg, cache_dir)))]
    paths, _ = parse_blend(data_cfg.data_path)
    out = []
    for p in paths:
        if classify_data_path(p) == "indexed":
            raise ConfigError(f"--tokenizer-type is required with preprocessed data {p} "
                              f"(.bin/.idx is already tokenized): pass the --tokenizer-type and "
                              f"--tokenizer-model it was preprocessed with")
        out.append((p, load_text_dataset(p, _user_cache(data_cfg, cache_dir),
                                         data_cfg.num_workers)))
    return out


def _user_cache(data_cfg: DataConfig, cache_dir: Optional[str]) -> Optional[str]:
    """User data goes to datasets' own cache unless a cache dir was given explicitly."""
    return cache_dir or data_cfg.data_cache_path


def iter_texts(ds, text_field: str, max_chars: int) -> Iterator[str]:
    """Documents at an even stride over the whole dataset until ``max_chars`` characters are
    reached (representative when the data is sorted by topic or file)."""
    n = len(ds)
    if n == 0:
        return
    total = 0
    # Estimate the stride from the first rows' sizes; stride 1 when the whole set fits.
    head = ds.select(range(min(n, 64)))[text_field]
    avg = max(1.0, sum(len(t or "") for t in head) / max(1, len(head)))
    stride = max(1, int(avg * n / max_chars))
    for start in range(0, n, stride * 1024):
        rows = ds.select(range(start, min(n, start + stride * 1024), stride))[text_field]
        for t in rows:
            if t:
                yield t
                total += len(t)
                if total >= max_chars:
                    return


# ------------------------------------------------------------------------- tokenization on the fly


def _tokenize_batch(batch, tokenizer, text_field, append_eod):
    ids = tokenizer.encode_batch([t or "" for t in batch[text_field]])
    eod = [tokenizer.eod] if append_eod else []
    # an empty document stays empty (it would otherwise become a lone EOD)
    return {"input_ids": [np.asarray(list(x) + eod if t else [], dtype=np.int32)
                          for t, x in zip(batch[text_field], ids)]}


def tokenize_dataset(ds, tokenizer, text_field: str, num_proc: int = 0, append_eod: bool = True,
                     where: str = "dataset", desc: Optional[str] = None):
    """``ds.map`` to an "input_ids" column, cached by ``datasets`` (docs/data.md)."""
    import datasets

    text_column(ds, text_field, where)
    fp = _fingerprint(CACHE_VERSION, ds._fingerprint, tokenizer.fingerprint, text_field,
                      append_eod, tokenizer.eod)
    return ds.map(
        _tokenize_batch, batched=True, batch_size=256,
        fn_kwargs={"tokenizer": tokenizer, "text_field": text_field, "append_eod": append_eod},
        remove_columns=ds.column_names, num_proc=num_proc if num_proc > 1 else None,
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
        new_fingerprint=fp, desc=desc or f"tokenizing {where}")


def store_from_tokenized(tokenized, name: str) -> ArrayDocumentStore:
    import pyarrow as pa

    col = tokenized.data.column("input_ids")
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if isinstance(arr, pa.ChunkedArray):  # zero chunks
        arr = pa.array([], type=pa.list_(pa.int32()))
    lengths = arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    tokens = arr.flatten().to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return ArrayDocumentStore(tokens, offsets, name=name)


def load_document_store(path: str, data_cfg: DataConfig, tokenizer,
                        cache_dir: Optional[str] = None):
    """One ``--data-path`` entry's documents (the built-in corpus for path None)."""
    if path is None:
        ds, name = builtin_corpus(cache_root(data_cfg, cache_dir)), "the built-in corpus"
        text_field = "text"
    elif classify_data_path(path) == "indexed":
        store = indexed_dataset.IndexedDataset(path)
        store.name = path
        if store.num_tokens and tokenizer is not None:
            # Token ids beyond the vocabulary mean the data was preprocessed with another tokenizer.
            hi = int(store._bin.max()) if store.num_tokens <= 50_000_000 else None
            if hi is not None and hi >= tokenizer.vocab_size:
                raise ConfigError(f"--data-path: {path} holds token id {hi} but the tokenizer has "
                                  f"{tokenizer.vocab_size} ids; use the --tokenizer-type/"
                                  f"--tokenizer-model the data was preprocessed with")
        return store
    else:
        ds, name = load_text_dataset(path, _user_cache(data_cfg, cache_dir),
                                     data_cfg.num_workers), path
        text_field = data_cfg.dataset_text_field
    tokenized = tokenize_dataset(ds, tokenizer, text_field, data_cfg.num_workers, where=name)
    return store_from_tokenized(tokenized, name)
