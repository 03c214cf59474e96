"""Every data error is one ConfigError line naming the flag (and file) and what would be valid."""

import json

import numpy as np
import pytest

from megalite.config import ConfigError, DataConfig
from megalite.data import build_pretraining_datasets, build_tokenizer
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.data.tokenizer import null_tokenizer

TOK = null_tokenizer(300)


def build(cfg, tmp_path, tok=TOK):
    return build_pretraining_datasets(cfg, tok, 8, 1, (4, 1, 1), cache_dir=str(tmp_path / "c"))


def check(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_missing_local_path(tmp_path):
    cfg = DataConfig(data_path=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(ConfigError) as e:
        build(cfg, tmp_path)
    check(e, "--data-path", "nope.jsonl", "does not exist")


def test_half_an_indexed_pair(tmp_path):
    (tmp_path / "p.bin").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=[str(tmp_path / "p")]), tmp_path)
    check(e, "--data-path", "p.bin", "p.idx")


def test_hub_name_offline(tmp_path):
    # conftest sets HF_DATASETS_OFFLINE=1: a hub name cannot be fetched
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=["megalite-no-such-org/no-such-dataset"]), tmp_path)
    check(e, "--data-path", "megalite-no-such-org/no-such-dataset", "Hugging Face")


def test_hf_tokenizer_name_offline():
    with pytest.raises(ConfigError) as e:
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer",
                                   tokenizer_model="megalite-no-such-org/no-such-tokenizer"))
    check(e, "--tokenizer-model", "megalite-no-such-org/no-such-tokenizer")
    with pytest.raises(ConfigError) as e:
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer"))
    check(e, "--tokenizer-model", "required")


def test_unknown_tokenizer_type():
    with pytest.raises(ConfigError) as e:
        build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizr"))
    check(e, "--tokenizer-type", "SentencePieceTokenizr", "HuggingFaceTokenizer")


@pytest.mark.parametrize("blend", [["0.5", "a", "b"], ["a", "0.5"], ["0.5", "a", "0.5"],
                                   ["-1", "a", "2", "b"], ["0", "a", "0", "b"]])
def test_malformed_blend(tmp_path, blend):
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=blend), tmp_path)
    check(e, "--data-path", "0.7 a 0.3 b")


def test_empty_text_dataset(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n".join(json.dumps({"text": ""}) for _ in range(3)) + "\n")
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=[str(p)], tokenizer_type="NullTokenizer"), tmp_path)
    check(e, "--data-path", "empty.jsonl", "0 tokens")


@pytest.mark.parametrize("name,content", [("zero.jsonl", ""), ("blank.txt", "\n\n  \n")])
def test_empty_file_says_it_is_empty(tmp_path, name, content):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=[str(p)], tokenizer_type="NullTokenizer"), tmp_path)
    check(e, "--data-path", name, "is empty")


def test_empty_indexed_dataset(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "e.bin"), dtype=np.uint16)
    b.finalize(str(tmp_path / "e.idx"))
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=[str(tmp_path / "e")], tokenizer_type="NullTokenizer"),
              tmp_path)
    check(e, "--data-path", "0 tokens")


def test_text_field_missing(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"content": "hello", "meta": 1}) + "\n")
    cfg = DataConfig(data_path=[str(p)], tokenizer_type="NullTokenizer")
    with pytest.raises(ConfigError) as e:
        build(cfg, tmp_path)
    check(e, "--dataset-text-field", "'text'", "content, meta")
    with pytest.raises(ConfigError) as e:  # also when training the BPE on that text
        build_tokenizer(DataConfig(data_path=[str(p)]), str(tmp_path / "c"), 300)
    check(e, "--dataset-text-field", "content, meta")


def test_corrupt_index_through_data_path(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x00" * 8)
    (tmp_path / "x.idx").write_bytes(b"garbage-not-an-index")
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=[str(tmp_path / "x")], tokenizer_type="NullTokenizer"),
              tmp_path)
    check(e, "--data-path", "x.idx", "bad magic")


def test_indexed_data_needs_its_tokenizer(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "t.bin"), dtype=np.uint16)
    b.add_document([1, 2, 3000])
    b.finalize(str(tmp_path / "t.idx"))
    with pytest.raises(ConfigError) as e:
        build_tokenizer(DataConfig(data_path=[str(tmp_path / "t")]))
    check(e, "--tokenizer-type", "t")
    with pytest.raises(ConfigError) as e:  # ids beyond the tokenizer's vocabulary
        build(DataConfig(data_path=[str(tmp_path / "t")], tokenizer_type="NullTokenizer"),
              tmp_path)
    check(e, "--data-path", "3000", "300")


def test_unsupported_extension(tmp_path):
    p = tmp_path / "data.xlsx"
    p.write_bytes(b"x")
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=[str(p)]), tmp_path)
    check(e, "--data-path", "data.xlsx", ".jsonl")


def test_split_too_small_for_train(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=np.uint16)
    b.add_document([1, 2, 3])
    b.finalize(str(tmp_path / "s.idx"))
    with pytest.raises(ConfigError) as e:
        build(DataConfig(data_path=[str(tmp_path / "s")], split="1,100,0",
                         tokenizer_type="NullTokenizer"), tmp_path)
    check(e, "--split", "train split")


def test_reset_attention_mask_needs_document_ends(tmp_path):
    """--reset-attention-mask finds documents by their EOD: a .bin preprocessed without
    --append-eod, or --mock-data, is refused in one line; with the EODs it builds."""
    for name, ends in (("noeod", []), ("eod", [TOK.eod])):
        with IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=np.uint16) as b:
            for i in range(20):
                b.add_document([1 + i % 7, 2, 3] + ends)
            b.finalize(str(tmp_path / f"{name}.idx"))
    cfg = DataConfig(data_path=[str(tmp_path / "noeod")], tokenizer_type="NullTokenizer",
                     reset_attention_mask=True)
    with pytest.raises(ConfigError) as e:
        build(cfg, tmp_path)
    check(e, "--reset-attention-mask", "noeod", "--append-eod")
    cfg.data_path = [str(tmp_path / "eod")]
    assert build(cfg, tmp_path)[0] is not None
    with pytest.raises(ConfigError) as e:
        DataConfig(mock_data=True, reset_attention_mask=True).validate()
    check(e, "--reset-attention-mask", "--mock-data")
