"""Tokenizers: built-in corpus + trained BPE (cached), HF / GPT-2 / null kinds, save_pretrained."""

import json
import os

import numpy as np
import pytest

from megalite.config import DataConfig
from megalite.data import build_pretraining_datasets, build_tokenizer
from megalite.data import sources
from megalite.data import tokenizer as tokenizer_module
from megalite.data.tokenizer import BPE_TRAIN_MAX_CHARS, EOD_TOKEN, null_tokenizer, train_bpe

TEXT = 'def f(x):\n    """ünïcode ✓ and tabs\t"""\n    return x ** 2  # 日本語\n'


def _build_recording_work(cfg, cache, vocab_size=1024):
    """Build the tokenizer and datasets, recording the work done: the texts BPE training read
    and the number of document batches tokenized (hooks around the two expensive steps)."""
    work = {"bpe_texts": [], "bpe_trainings": 0, "tokenized_batches": 0}

    def recording_train_bpe(texts, vocab_size):
        work["bpe_trainings"] += 1
        return train_bpe((work["bpe_texts"].append(t) or t for t in texts), vocab_size)

    def recording_tokenize(batch, **kwargs):
        work["tokenized_batches"] += 1
        return tokenize_batch(batch, **kwargs)

    tokenize_batch = sources._tokenize_batch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer_module, "train_bpe", recording_train_bpe)
        mp.setattr(sources, "_tokenize_batch", recording_tokenize)
        tok = build_tokenizer(cfg, cache_dir=cache, vocab_size=vocab_size)
        ds = build_pretraining_datasets(cfg, tok, 64, 1234, (100, 10, 1), cache_dir=cache)
    return tok, ds, work


def _files(root):
    """Every file under root with its inode, size and modification time."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            st = os.stat(os.path.join(d, n))
            out[os.path.join(d, n)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """The built-in corpus with a 1024-id BPE, built once for this module."""
    cache = str(tmp_path_factory.mktemp("builtin_cache"))
    cfg = DataConfig()
    tok, ds, work = _build_recording_work(cfg, cache)
    return cfg, cache, tok, ds, work


def test_builtin_corpus_is_the_stdlib_sources():
    files = sources.stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any(os.sep + "site-packages" + os.sep in f or os.sep + "test" + os.sep in f
                   for f in files)
    assert any(f.endswith(os.sep + "json" + os.sep + "decoder.py") for f in files)


def test_builtin_corpus_builds_and_round_trips(builtin):
    cfg, cache, tok, (tr, va, te), work = builtin
    assert tok.vocab_size == 1024 and tok.hf.convert_ids_to_tokens(tok.eod) == EOD_TOKEN
    assert tok.decode(tok.encode(TEXT)) == TEXT  # byte-level: any text round-trips
    assert tok.encode(EOD_TOKEN) == [tok.eod]
    assert len(tr) >= 100 and len(va) >= 10 and len(te) >= 1
    sample = tr[0]["tokens"]
    assert sample.shape == (65,) and sample.max() < 1024
    # what keeps the first build short: BPE training reads a bounded sample of the corpus (it
    # stops at the first text that reaches the budget), not all of it
    texts = work["bpe_texts"]
    assert work["bpe_trainings"] == 1 and work["tokenized_batches"] > 0
    assert sum(len(t) for t in texts[:-1]) < BPE_TRAIN_MAX_CHARS <= sum(len(t) for t in texts)
    assert len(texts) < len(sources.stdlib_files())


def test_second_build_hits_the_cache(builtin):
    cfg, cache, tok, (tr, _, _), _ = builtin
    before = _files(cache)
    tok2, (tr2, _, _), work = _build_recording_work(cfg, cache)
    # no BPE training, no tokenization, and not one cache file written or replaced
    assert work == {"bpe_texts": [], "bpe_trainings": 0, "tokenized_batches": 0}
    assert _files(cache) == before
    assert tok2.fingerprint == tok.fingerprint
    assert np.array_equal(tr2[5]["tokens"], tr[5]["tokens"])
    tok_dirs = os.listdir(os.path.join(cache, "tokenizers"))
    assert len(tok_dirs) == 1 and tok_dirs[0].startswith("bpe-1024-")


def test_save_pretrained_loads_with_auto_tokenizer(builtin, tmp_path):
    from transformers import AutoTokenizer

    tok = builtin[2]
    tok.save_pretrained(str(tmp_path / "tok"))
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert hf.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT)
    assert hf.eos_token_id == tok.eod and len(hf) == tok.vocab_size
    # and it comes back through --tokenizer-type HuggingFaceTokenizer
    again = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer",
                                       tokenizer_model=str(tmp_path / "tok")))
    assert again.encode(TEXT) == tok.encode(TEXT) and again.eod == tok.eod


def test_gpt2_bpe_from_vocab_and_merges(tmp_path):
    tok = train_bpe(["hello world, hello there"] * 50, 300)
    d = tmp_path / "gpt2"
    d.mkdir()
    model = json.loads(tok.hf.backend_tokenizer.to_str())["model"]
    (d / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    g = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", tokenizer_model=str(d)))
    assert g.encode("hello there") == tok.encode("hello there")
    assert g.eod == tok.eod and g.decode(g.encode("hello world")) == "hello world"


def test_null_tokenizer():
    t = null_tokenizer(300)
    assert t.vocab_size == 300 and t.eod == 299
    assert t.encode("5 17 0") == [5, 17, 0] and t.decode([5, 17, 299]) == f"5 17 {EOD_TOKEN}"
    mock = build_tokenizer(DataConfig(mock_data=True), vocab_size=1000)
    assert mock.kind == "NullTokenizer" and mock.vocab_size == 1000
