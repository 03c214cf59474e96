"""Megatron MMIDIDX .bin/.idx: round trip, byte layout (docs/data.md), corruption, oracle."""

import os
import struct

import numpy as np
import pytest

from megalite.config import ConfigError
from megalite.data.indexed_dataset import (DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder,
                                           dtype_code, optimal_dtype)

DOCS = [[5, 6, 7], [1], [9, 9, 9, 9, 2], [], [65000, 3]]


def write(prefix, docs=DOCS, dtype=np.uint16):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(np.array(d, dtype=np.int64))
    b.finalize(prefix + ".idx")
    return prefix


def test_round_trip_documents_and_sequences(tmp_path):
    prefix = write(str(tmp_path / "rt"))
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == len(DOCS) and ds.num_documents == len(DOCS)
    for i, d in enumerate(DOCS):
        assert ds[i].tolist() == d
        assert ds.get_document(i).tolist() == d
    assert ds.document_lengths.tolist() == [len(d) for d in DOCS]
    assert ds.get(2, offset=1, length=3).tolist() == [9, 9, 9]
    assert ds.num_tokens == sum(map(len, DOCS))


def test_multi_sequence_documents(tmp_path):
    prefix = str(tmp_path / "ms")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    b.add_document([1, 2, 3, 4, 5], lengths=[2, 3])  # two "sentences"
    b.add_item([7])
    b.add_item([8, 8])
    b.end_document()
    b.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.num_documents == 2
    assert ds.document_indices.tolist() == [0, 2, 4]
    assert ds.get_document(0).tolist() == [1, 2, 3, 4, 5]
    assert ds.get_document(1).tolist() == [7, 8, 8]
    assert ds.document_lengths.tolist() == [5, 3]


def test_header_and_index_layout_field_by_field(tmp_path):
    """The bytes of PREFIX.idx, read with struct exactly as docs/data.md's table describes."""
    prefix = write(str(tmp_path / "lay"))
    raw = open(prefix + ".idx", "rb").read()
    assert raw[0:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert struct.unpack("<B", raw[17:18]) == (8,)  # uint16 is code 8
    S, D = struct.unpack("<QQ", raw[18:34])
    assert (S, D) == (len(DOCS), len(DOCS) + 1)
    lengths = np.frombuffer(raw, np.int32, S, 34)
    pointers = np.frombuffer(raw, np.int64, S, 34 + 4 * S)
    doc_idx = np.frombuffer(raw, np.int64, D, 34 + 12 * S)
    assert len(raw) == 34 + 12 * S + 8 * D
    assert lengths.tolist() == [3, 1, 5, 0, 2]
    assert pointers.tolist() == [0, 6, 8, 18, 18]  # byte offsets, 2 bytes per uint16 token
    assert doc_idx.tolist() == [0, 1, 2, 3, 4, 5]
    assert open(prefix + ".bin", "rb").read() == np.array(sum(DOCS, []), "<u2").tobytes()


def test_dtype_codes_and_optimal_dtype():
    assert {k: np.dtype(v).name for k, v in DTYPE_CODES.items()} == {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
        8: "uint16"}
    assert dtype_code(np.int32) == 4
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(128256) == np.int32


def _corrupt(tmp_path, mutate):
    prefix = write(str(tmp_path / "bad"))
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw = mutate(raw)
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(ConfigError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert "--data-path" in msg and "bad.idx" in msg and "\n" not in msg
    return msg


def test_corrupt_magic(tmp_path):
    assert "bad magic" in _corrupt(tmp_path, lambda r: b"NOTANIDX\x00" + r[9:])


def test_corrupt_version(tmp_path):
    assert "version 2" in _corrupt(tmp_path, lambda r: r[:9] + struct.pack("<Q", 2) + r[17:])


def test_corrupt_truncated(tmp_path):
    assert "truncated" in _corrupt(tmp_path, lambda r: r[:-5])
    assert "truncated" in _corrupt(tmp_path, lambda r: r[:20])


def test_corrupt_dtype_code(tmp_path):
    assert "dtype code 42" in _corrupt(tmp_path, lambda r: r[:17] + bytes([42]) + r[18:])


def test_truncated_bin(tmp_path):
    prefix = write(str(tmp_path / "tb"))
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(ConfigError, match="truncated .bin"):
        IndexedDataset(prefix)


def test_builder_failure_leaves_no_pair(tmp_path):
    prefix = str(tmp_path / "fail")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
            b.add_document([1, 2])
            raise RuntimeError("tokenizer crashed")
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")


def test_add_index_merges(tmp_path):
    a = write(str(tmp_path / "a"), [[1, 2], [3]])
    b = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    b.add_document([4, 4])
    b.add_index(a)
    b.finalize(str(tmp_path / "m.idx"))
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds.get_document(i).tolist() for i in range(ds.num_documents)] == [[4, 4], [1, 2], [3]]


# --- megatron-core as an oracle (pip install "megatron-core==0.16.1"; CPU-only import) --------


def _mcore():
    """The oracle is the test extra: missing, these tests fail rather than skip."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def test_megalite_files_load_in_megatron_core(tmp_path):
    mc = _mcore()
    prefix = str(tmp_path / "ours")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    b.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
    for d in DOCS:
        b.add_document(d)
    b.finalize(prefix + ".idx")
    theirs = mc.IndexedDataset(prefix)
    ours = IndexedDataset(prefix)
    assert len(theirs) == len(ours)
    assert theirs.document_indices.tolist() == ours.document_indices.tolist()
    assert theirs.sequence_lengths.tolist() == ours.sequence_lengths.tolist()
    for i in range(len(ours)):
        assert theirs[i].tolist() == ours[i].tolist()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_megatron_core_files_load_in_megalite(tmp_path):
    mc = _mcore()
    import torch

    prefix = str(tmp_path / "theirs")
    b = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    b.add_document(torch.tensor([10, 11, 12, 13]), [1, 3])
    for d in DOCS:
        b.add_document(torch.tensor(d, dtype=torch.int64), [len(d)])
    b.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.int32 and ours.num_documents == len(DOCS) + 1
    assert ours.get_document(0).tolist() == [10, 11, 12, 13]
    assert [ours.get_document(i + 1).tolist() for i in range(len(DOCS))] == DOCS
    # and byte-identical to what our builder writes for the same input
    mine = str(tmp_path / "mine")
    mb = IndexedDatasetBuilder(mine + ".bin", dtype=np.int32)
    mb.add_document([10, 11, 12, 13], lengths=[1, 3])
    for d in DOCS:
        mb.add_document(d)
    mb.finalize(mine + ".idx")
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(mine + ext, "rb").read()
