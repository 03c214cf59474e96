"""Megatron-LM's preprocessed token format, ``PREFIX.bin`` (tokens) + ``PREFIX.idx`` (the index),
byte-compatible with megatron/core/datasets/indexed_dataset.py (docs/data.md, "The MMIDIDX byte
layout", has the table)."""

from __future__ import annotations

import os
import struct
from typing import Iterable, Optional, Sequence

import numpy as np

from megalite.config import ConfigError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = "<QBQQ"  # after the magic: version, dtype code, sequence count, document index count
HEADER_SIZE = len(INDEX_MAGIC) + struct.calcsize(_HEADER)  # 34 bytes before the three arrays

# Megatron-LM's DType enum values; the codes are part of the file format.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no MMIDIDX code; valid: "
                         f"{sorted(str(np.dtype(v)) for v in DTYPE_CODES.values())}") from None


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when every id fits (same threshold as Megatron-LM, 65500), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def exists(prefix: str) -> bool:
    """Both PREFIX.bin and PREFIX.idx exist."""
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


# ------------------------------------------------------------------------------------------ writer


class IndexedDatasetBuilder:
    """Writes PREFIX.bin while tokens arrive and PREFIX.idx at :meth:`finalize` (Megatron-LM's
    method names). The .idx is renamed into place last, so a crash never leaves a pair that looks
    valid (docs/design.md, contract 8)."""

    def __init__(self, bin_path: str, dtype=np.int32) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # reject dtypes the format cannot name, before writing anything
        self._bin = open(bin_path, "wb")
        self.sequence_lengths: list = []
        self.document_indices: list = [0]

    def add_item(self, tokens: Iterable[int]) -> None:
        """Append one sequence (not closing the document)."""
        arr = np.ascontiguousarray(np.asarray(tokens), dtype=self.dtype).reshape(-1)
        self._bin.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Iterable[int], lengths: Optional[Sequence[int]] = None) -> None:
        """Append a document: one sequence, or several when ``lengths`` splits ``tokens``."""
        arr = np.asarray(tokens)
        for piece in [arr] if lengths is None else np.split(arr, np.cumsum(lengths))[:-1]:
            self.add_item(piece)
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append every document of another indexed dataset (same dtype) to this one."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {other.dtype} differs from the builder's "
                             f"{self.dtype}")
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(d) + base for d in other.document_indices[1:])
        with open(data_file_path(prefix), "rb") as f:
            while True:
                chunk = f.read(1 << 24)
                if not chunk:
                    break
                self._bin.write(chunk)

    def finalize(self, idx_path: str) -> None:
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        # Pointers are byte offsets: the running sum of the previous sequences' sizes.
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self.document_indices, dtype=np.int64)
        tmp = idx_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack(_HEADER, INDEX_VERSION, dtype_code(self.dtype), len(lengths),
                                len(doc_idx)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
        os.replace(tmp, idx_path)

    def abort(self) -> None:
        """Close and delete the partial .bin (used when preprocessing fails)."""
        if not self._bin.closed:
            self._bin.close()
        if os.path.exists(self.bin_path):
            os.remove(self.bin_path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


# ------------------------------------------------------------------------------------------ reader


def _corrupt(path: str, what: str) -> ConfigError:
    return ConfigError(f"--data-path: {path} is not a valid Megatron MMIDIDX index: {what} "
                       f"(rebuild it with tools/preprocess_data.py)")


class IndexedDataset:
    """Read-only ``np.memmap`` view of PREFIX.bin/PREFIX.idx: ``ds[i]`` is sequence i,
    :meth:`get_document` a whole document (one sequence unless preprocessing split sentences)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise ConfigError(f"--data-path: {p} does not exist; an indexed dataset needs both "
                                  f"{prefix}.bin and {prefix}.idx")
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < len(INDEX_MAGIC) or header[:len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise _corrupt(idx_path, f"bad magic {header[:len(INDEX_MAGIC)]!r}, expected "
                                     f"{INDEX_MAGIC!r}")
        if len(header) < HEADER_SIZE:
            raise _corrupt(idx_path, f"truncated header ({len(header)} of {HEADER_SIZE} bytes)")
        version, code, self.sequence_count, self.document_count = struct.unpack_from(
            _HEADER, header, len(INDEX_MAGIC))
        if version != INDEX_VERSION:
            raise _corrupt(idx_path, f"unsupported version {version}, expected {INDEX_VERSION}")
        if code not in DTYPE_CODES:
            raise _corrupt(idx_path, f"unknown dtype code {code}, valid codes "
                                     f"{sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + self.sequence_count * (4 + 8) + self.document_count * 8
        if size < expected:
            raise _corrupt(idx_path, f"truncated: {size} bytes, the header promises {expected} "
                                     f"({self.sequence_count} sequences, "
                                     f"{self.document_count} document indices)")
        # Megatron appends an int8 mode per sequence for multimodal data; bytes beyond `expected`
        # are therefore tolerated and ignored.
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        S, D = self.sequence_count, self.document_count
        self.sequence_lengths = np.frombuffer(self._idx, dtype=np.int32, count=S, offset=off)
        off += 4 * S
        self.sequence_pointers = np.frombuffer(self._idx, dtype=np.int64, count=S, offset=off)
        off += 8 * S
        self.document_indices = np.frombuffer(self._idx, dtype=np.int64, count=D, offset=off)
        if D < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != S or (
                D > 1 and np.any(np.diff(self.document_indices) < 0)):
            raise _corrupt(idx_path, "document_indices must start at 0, be non-decreasing and "
                                     f"end at the sequence count {S}")
        total_tokens = int(self.sequence_lengths.astype(np.int64).sum())
        bin_size = os.path.getsize(bin_path)
        if bin_size < total_tokens * self.dtype.itemsize:
            raise _corrupt(bin_path, f"truncated .bin: {bin_size} bytes, the index needs "
                                     f"{total_tokens * self.dtype.itemsize}")
        if S and (self.sequence_pointers[-1] + int(self.sequence_lengths[-1]) * self.dtype.itemsize
                  > bin_size):
            raise _corrupt(idx_path, "sequence pointers run past the end of the .bin")
        # np.memmap refuses empty files; an empty dataset simply has no tokens to map.
        self._bin = (np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_size
                     else np.zeros(0, dtype=self.dtype))
        self.num_tokens = total_tokens

    # pickling (DataLoader workers under spawn): reopen the maps instead of copying their data.
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence i (a view into the .bin map)."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    @property
    def num_documents(self) -> int:
        return self.document_count - 1

    @property
    def document_lengths(self) -> np.ndarray:
        """Tokens per document (a document spans one or more consecutive sequences)."""
        cum = np.zeros(self.sequence_count + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=cum[1:])
        return cum[self.document_indices[1:]] - cum[self.document_indices[:-1]]

    def get_document(self, d: int) -> np.ndarray:
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == last:
            return self._bin[0:0]
        parts = [self.get(i) for i in range(first, last)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
