"""Tokenizers, every kind a Hugging Face fast tokenizer behind one wrapper (docs/data.md,
"Tokenizers": the ``--tokenizer-type`` kinds, the trained BPE and its cache)."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from typing import List, Optional, Sequence

from megalite.config import ConfigError, DataConfig, ModelConfig
from megalite.data import sources

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_TYPES = ("ByteLevelBPETokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "NullTokenizer")
# BPE training reads at most this much text (docs/data.md, "Tokenizers")
BPE_TRAIN_MAX_CHARS = 4_000_000


class Tokenizer:
    """The interface the rest of megalite uses: vocab_size, eod, encode, decode, save_pretrained."""

    def __init__(self, hf_tokenizer, eod: int, kind: str) -> None:
        self.hf = hf_tokenizer
        self.eod = int(eod)
        self.kind = kind
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        spec = (backend.to_str() if backend is not None
                else repr(sorted(hf_tokenizer.get_vocab().items())))
        # Keys caches of data tokenized with this tokenizer.
        self.fingerprint = hashlib.sha256(spec.encode()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added special tokens included (embedding rows before padding)."""
        return len(self.hf)

    def encode(self, text: str) -> List[int]:
        return list(self.hf.encode(text, add_special_tokens=False, verbose=False))

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.hf(list(texts), add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def save_pretrained(self, directory: str):
        return self.hf.save_pretrained(directory)

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, eod={self.eod})"


def _wrap_fast(tokenizer_object, kind: str) -> Tokenizer:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, eos_token=EOD_TOKEN,
                                 bos_token=EOD_TOKEN, clean_up_tokenization_spaces=False)
    return Tokenizer(hf, hf.convert_tokens_to_ids(EOD_TOKEN), kind)


# ------------------------------------------------------------------------------------------- kinds


def null_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer as TkTokenizer, models, pre_tokenizers

    vocab = {str(i): i for i in range(vocab_size - 1)}
    vocab[EOD_TOKEN] = vocab_size - 1
    tk = TkTokenizer(models.WordLevel(vocab, unk_token=EOD_TOKEN))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _wrap_fast(tk, "NullTokenizer")


def train_bpe(texts, vocab_size: int) -> Tokenizer:
    """Byte-level BPE with ``<|endoftext|>`` as the only special token."""
    from tokenizers import Tokenizer as TkTokenizer, decoders, models, pre_tokenizers, trainers

    tk = TkTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer)
    return _wrap_fast(tk, "ByteLevelBPETokenizer")


def load_gpt2_bpe(vocab_file: str, merge_file: str) -> Tokenizer:
    from transformers import GPT2TokenizerFast

    for flag, f in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not os.path.isfile(f):
            raise ConfigError(f"{flag}: {f} does not exist; GPT2BPETokenizer needs GPT-2's "
                              f"vocab.json and merges.txt")
    # transformers 5 names the files vocab/merges; 4.x named them vocab_file/merges_file.
    v5 = "merges" in inspect.signature(GPT2TokenizerFast.__init__).parameters
    files = {"vocab": vocab_file, "merges": merge_file} if v5 else {
        "vocab_file": vocab_file, "merges_file": merge_file}
    hf = GPT2TokenizerFast(**files, eos_token=EOD_TOKEN, bos_token=EOD_TOKEN, unk_token=EOD_TOKEN)
    eod = hf.convert_tokens_to_ids(EOD_TOKEN)
    if eod is None or eod == hf.unk_token_id and EOD_TOKEN not in hf.get_vocab():
        raise ConfigError(f"--vocab-file: {vocab_file} has no {EOD_TOKEN} entry for EOD")
    return Tokenizer(hf, eod, "GPT2BPETokenizer")


def load_hf_tokenizer(name_or_dir: Optional[str], cache_dir: Optional[str] = None) -> Tokenizer:
    if not name_or_dir:
        raise ConfigError("--tokenizer-model is required with --tokenizer-type "
                          "HuggingFaceTokenizer (a local folder or a Hugging Face model name)")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(name_or_dir, cache_dir=cache_dir)
    except Exception as e:
        msg = " ".join(str(e).split())[:300]
        raise ConfigError(f"--tokenizer-model: cannot load Hugging Face tokenizer {name_or_dir!r} "
                          f"(not a local tokenizer folder, and the hub is offline or has no such "
                          f"model): {type(e).__name__}: {msg}") from e
    eod = hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id
    if eod is None:
        raise ConfigError(f"--tokenizer-model: {name_or_dir} defines no eos (or sep) token to use "
                          f"as the end-of-document token")
    return Tokenizer(hf, eod, "HuggingFaceTokenizer")


# ------------------------------------------------------------------------- the trained BPE, cached


def _bpe_cache_key(data_cfg: DataConfig, sets, vocab_size: int) -> str:
    if data_cfg.data_path is None:
        corpus = ("builtin", sources.builtin_corpus_fingerprint())
    else:
        # Keyed by the datasets' own fingerprints: they change when the files do.
        corpus = tuple((name, ds._fingerprint, data_cfg.dataset_text_field) for name, ds in sets)
    return sources._fingerprint("bpe", sources.CACHE_VERSION, corpus, vocab_size,
                                BPE_TRAIN_MAX_CHARS)


def trained_bpe(data_cfg: DataConfig, cache_dir: Optional[str] = None,
                vocab_size: int = ModelConfig.vocab_size) -> Tokenizer:
    """Load the cached BPE for this corpus and vocab size, or train and cache it."""
    from transformers import AutoTokenizer

    root = sources.cache_root(data_cfg, cache_dir)
    # The built-in corpus is keyed by its files alone, so a cache hit skips loading it.
    sets = None if data_cfg.data_path is None else sources.text_datasets(data_cfg, cache_dir)
    key = _bpe_cache_key(data_cfg, sets, vocab_size)
    target = os.path.join(root, "tokenizers", f"bpe-{vocab_size}-{key}")
    meta_file = os.path.join(target, "megalite_tokenizer.json")
    if os.path.isfile(meta_file):
        with open(meta_file) as f:
            meta = json.load(f)
        if meta.get("key") == key:
            hf = AutoTokenizer.from_pretrained(target)
            return Tokenizer(hf, hf.convert_tokens_to_ids(EOD_TOKEN), "ByteLevelBPETokenizer")

    field = data_cfg.dataset_text_field if data_cfg.data_path is not None else "text"
    sets = sets or sources.text_datasets(data_cfg, cache_dir)
    for name, ds in sets:
        sources.text_column(ds, field, name)
    budget = BPE_TRAIN_MAX_CHARS // len(sets)

    def texts():
        for name, ds in sets:
            yield from sources.iter_texts(ds, field, budget)

    tok = train_bpe(texts(), vocab_size)
    # Write to a temporary folder and rename: concurrent ranks never read a half-written tokenizer.
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-bpe-", dir=os.path.dirname(target) or ".")
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "megalite_tokenizer.json"), "w") as f:
        json.dump({"key": key, "vocab_size": vocab_size, "eod_token": EOD_TOKEN}, f)
    if os.path.isdir(target) and not os.path.isfile(meta_file):
        shutil.rmtree(target, ignore_errors=True)  # a stale, incomplete folder
    try:
        os.replace(tmp, target)
    except OSError:
        # Another rank trained the same tokenizer first (same key, same result): keep its copy
        # rather than replacing a folder someone may be reading.
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def build_tokenizer(data_cfg: DataConfig, cache_dir: Optional[str] = None,
                    vocab_size: int = ModelConfig.vocab_size) -> Tokenizer:
    """``vocab_size``: the size of a trained BPE or the mock tokenizer (--vocab-size)."""
    kind = data_cfg.tokenizer_type
    if kind is None:
        kind = "NullTokenizer" if data_cfg.mock_data else "ByteLevelBPETokenizer"
    if kind == "ByteLevelBPETokenizer":
        return trained_bpe(data_cfg, cache_dir, vocab_size)
    if kind == "HuggingFaceTokenizer":
        return load_hf_tokenizer(data_cfg.tokenizer_model)
    if kind == "GPT2BPETokenizer":
        d = data_cfg.tokenizer_model
        if not d or not os.path.isdir(d):
            raise ConfigError(f"--tokenizer-model: GPT2BPETokenizer needs a folder holding "
                              f"vocab.json and merges.txt, got {d!r}")
        return load_gpt2_bpe(os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt"))
    if kind == "NullTokenizer":
        return null_tokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type: unknown {kind!r}; valid: {', '.join(TOKENIZER_TYPES)} "
                      f"(or none for a BPE trained on the data)")
