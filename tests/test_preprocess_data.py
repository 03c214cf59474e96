"""tools/preprocess_data.py: Megatron-spelled flags -> PREFIX_text_document.bin/.idx that megalite
(and megatron-core, when installed) reads back, and that trains like on-the-fly data."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megalite.config import ConfigError, DataConfig
from megalite.data import build_pretraining_datasets, build_tokenizer
from megalite.data.indexed_dataset import IndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import preprocess_data  # noqa: E402

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 4) for i in range(25)]


def write_jsonl(path):
    with open(path, "w") as f:
        for i, t in enumerate(DOCS):
            f.write(json.dumps({"text": t, "title": f"t{i}"}) + "\n")
    return str(path)


def test_bpe_preprocess_matches_on_the_fly(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl")
    out = str(tmp_path / "out" / "my")
    rc = preprocess_data.main(["--input", inp, "--json-keys", "text", "title", "--output-prefix",
                               out, "--tokenizer-type", "ByteLevelBPETokenizer", "--vocab-size",
                               "300", "--append-eod", "--workers", "1", "--cache-dir",
                               str(tmp_path / "cache")])
    assert rc == 0
    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer",
                                     tokenizer_model=out + "_tokenizer"))
    ds = IndexedDataset(out + "_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == len(DOCS)
    for i, t in enumerate(DOCS):
        assert ds.get_document(i).tolist() == tok.encode(t) + [tok.eod]
    titles = IndexedDataset(out + "_title_document")
    assert titles.get_document(3).tolist() == tok.encode("t3") + [tok.eod]
    # training from the .bin/.idx sees the same samples as tokenizing the jsonl on the fly
    kw = dict(seq_length=16, seed=3, num_samples=(10, 2, 2))
    pre = build_pretraining_datasets(
        DataConfig(data_path=[out + "_text_document"], tokenizer_type="HuggingFaceTokenizer",
                   tokenizer_model=out + "_tokenizer", split="8,1,1"), tok, **kw)
    fly = build_pretraining_datasets(
        DataConfig(data_path=[inp], tokenizer_type="HuggingFaceTokenizer",
                   tokenizer_model=out + "_tokenizer", split="8,1,1"), tok,
        cache_dir=str(tmp_path / "cache"), **kw)
    for a, b in zip(pre, fly):
        assert len(a) == len(b)
        assert all(np.array_equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))


def test_without_append_eod_and_null_tokenizer(tmp_path):
    inp = tmp_path / "nums.jsonl"
    inp.write_text("\n".join(json.dumps({"text": " ".join(map(str, range(i, i + 4)))})
                             for i in range(5)) + "\n")
    out = str(tmp_path / "n")
    preprocess_data.main(["--input", str(inp), "--output-prefix", out, "--tokenizer-type",
                          "NullTokenizer", "--vocab-size", "100", "--cache-dir",
                          str(tmp_path / "cache")])
    ds = IndexedDataset(out + "_text_document")
    assert ds.get_document(2).tolist() == [2, 3, 4, 5]  # no EOD appended


def test_megatron_core_reads_the_output(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as McIndexed
    inp = write_jsonl(tmp_path / "in.jsonl")
    out = str(tmp_path / "mc")
    preprocess_data.main(["--input", inp, "--output-prefix", out, "--vocab-size", "300",
                          "--append-eod", "--cache-dir", str(tmp_path / "cache")])
    ours, theirs = IndexedDataset(out + "_text_document"), McIndexed(out + "_text_document")
    assert len(theirs) == len(DOCS)
    assert all(theirs[i].tolist() == ours[i].tolist() for i in range(len(DOCS)))


def test_cli_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--input"):
        preprocess_data.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix",
                              str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer"])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                        "--input", str(tmp_path / "missing.jsonl"), "--output-prefix",
                        str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and "--input" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(str(tmp_path / "o_text_document.bin"))
    inp = write_jsonl(tmp_path / "in.jsonl")
    with pytest.raises(ConfigError, match="--json-keys: column 'body' not found"):
        preprocess_data.main(["--input", inp, "--json-keys", "body", "--output-prefix",
                              str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer"])
