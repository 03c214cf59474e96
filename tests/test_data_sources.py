"""HF datasets from local files (txt, jsonl, parquet, arrow, save_to_disk folders): load, tokenize
on the fly, pack; plus the BPE trained on --data-path text."""

import json
import os
import shutil

import numpy as np
import pytest

from megalite.config import DataConfig
from megalite.data import build_pretraining_datasets, build_tokenizer
from megalite.data import sources

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def make_docs(n=30):
    rng = np.random.RandomState(0)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, 8 + i % 7)) + "." for i in range(n)]


DOCS = make_docs()


def write_format(d, fmt):
    import datasets

    if fmt == "txt":
        p = os.path.join(d, "c.txt")
        open(p, "w").write("\n\n".join(DOCS) + "\n")
    elif fmt == "jsonl":
        p = os.path.join(d, "c.jsonl")
        with open(p, "w") as f:
            for t in DOCS:
                f.write(json.dumps({"text": t, "id": 1}) + "\n")
    elif fmt == "parquet":
        p = os.path.join(d, "c.parquet")
        datasets.Dataset.from_dict({"text": DOCS}).to_parquet(p)
    elif fmt in ("arrow", "saved"):
        saved = os.path.join(d, "saved")
        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(saved)
        if fmt == "saved":
            return saved
        p = os.path.join(d, "c.arrow")
        arrow = [f for f in os.listdir(saved) if f.endswith(".arrow")][0]
        shutil.copy(os.path.join(saved, arrow), p)
    elif fmt == "folder":
        p = os.path.join(d, "folder")
        os.makedirs(os.path.join(p, "sub"))
        for k, part in enumerate((DOCS[:10], DOCS[10:])):
            with open(os.path.join(p, "sub" if k else "", f"part{k}.jsonl"), "w") as f:
                for t in part:
                    f.write(json.dumps({"text": t}) + "\n")
    return p


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet", "arrow", "saved", "folder"])
def test_local_files_load_tokenize_and_pack(tmp_path, fmt):
    path = write_format(str(tmp_path), fmt)
    cache = str(tmp_path / "cache")
    assert sources.classify_data_path(path) == "local"
    cfg = DataConfig(data_path=[path], split="8,1,1")
    tok = build_tokenizer(cfg, cache, 300)  # BPE trained on this file's text
    assert tok.vocab_size == 300 and tok.decode(tok.encode(DOCS[3])) == DOCS[3]
    store = sources.load_document_store(path, cfg, tok, cache)
    # one document per row/paragraph, in file order, each encoded and closed by EOD
    assert store.num_documents == len(DOCS)
    for i, t in enumerate(DOCS):
        assert store.get_document(i).tolist() == tok.encode(t) + [tok.eod]
    tr, va, te = build_pretraining_datasets(cfg, tok, 16, 1, (20, 4, 2), cache_dir=cache)
    assert len(tr) >= 20 and va is not None and te is not None
    x = tr[0]["tokens"]
    assert x.dtype == np.int64 and x.shape == (17,)
    # the train split (documents 0..23) is exactly what train samples are packed from
    train_tokens = sum(len(tok.encode(t)) + 1 for t in DOCS[:24])
    assert tr.cum_tokens[-1] == tr.num_epochs * train_tokens


def test_tokenized_data_is_cached_by_datasets(tmp_path):
    path = write_format(str(tmp_path), "jsonl")
    cache = str(tmp_path / "cache")
    cfg = DataConfig(data_path=[path])
    tok = build_tokenizer(cfg, cache, 300)
    ds = sources.load_text_dataset(path, cache)
    a = sources.tokenize_dataset(ds, tok, "text")
    b = sources.tokenize_dataset(ds, tok, "text")
    assert a.cache_files and a.cache_files == b.cache_files  # the second map read the cache
    # a different tokenizer is a different cache entry
    other = build_tokenizer(DataConfig(data_path=[path]), cache, 290)
    c = sources.tokenize_dataset(ds, other, "text")
    assert c.cache_files != a.cache_files


def test_tokenize_with_worker_processes(tmp_path):
    path = write_format(str(tmp_path), "jsonl")
    cache = str(tmp_path / "cache")
    cfg = DataConfig(data_path=[path])
    tok = build_tokenizer(cfg, cache, 300)
    ds = sources.load_text_dataset(path, cache)
    one = sources.store_from_tokenized(sources.tokenize_dataset(ds, tok, "text", 1), "x")
    two = sources.store_from_tokenized(sources.tokenize_dataset(ds, tok, "text", 2), "x")
    assert np.array_equal(one.tokens, two.tokens) and np.array_equal(one.offsets, two.offsets)


def test_custom_text_field_and_empty_documents_skipped(tmp_path):
    p = tmp_path / "c.jsonl"
    rows = [{"content": t} for t in DOCS[:5]] + [{"content": ""}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = DataConfig(data_path=[str(p)], dataset_text_field="content")
    tok = build_tokenizer(cfg, str(tmp_path / "cache"), 300)
    store = sources.load_document_store(str(p), cfg, tok, str(tmp_path / "cache"))
    assert store.num_documents == 6 and store.document_lengths[-1] == 0
    assert store.get_document(0).tolist() == tok.encode(DOCS[0]) + [tok.eod]
