#!/usr/bin/env python
"""Tokenize text into Megatron's preprocessed format: OUTPUT_PREFIX_{key}_document.bin/.idx.

Spelled as Megatron-LM's tools/preprocess_data.py, e.g.::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/my --tokenizer-type HuggingFaceTokenizer --tokenizer-model gpt2 \\
        --append-eod --workers 4

then train with ``--data-path data/my_text_document`` and the same tokenizer flags.
``--input`` is anything ``--data-path`` accepts as text (txt, json/jsonl, parquet, arrow, a folder
of them, or a Hugging Face dataset name). With ``--tokenizer-type ByteLevelBPETokenizer`` (the
default) a BPE of ``--vocab-size`` ids is trained on the input and saved to
OUTPUT_PREFIX_tokenizer/, to pass as ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import ConfigError, DataConfig  # noqa: E402


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="file, folder or Hugging Face dataset name")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="columns to tokenize, one output pair per key")
    g.add_argument("--split-sentences", action="store_true",
                   help="not supported (documents are kept whole); accepted to fail clearly")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="ByteLevelBPETokenizer",
                   choices=["ByteLevelBPETokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                            "NullTokenizer"])
    g.add_argument("--tokenizer-model", default=None,
                   help="HF tokenizer folder or name (HuggingFaceTokenizer); folder with "
                        "vocab.json + merges.txt (GPT2BPETokenizer)")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    g.add_argument("--vocab-size", type=int, default=8192,
                   help="ids of the trained BPE (ByteLevelBPETokenizer) / NullTokenizer")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--cache-dir", default=None, help="datasets / tokenizer cache")
    g.add_argument("--log-interval", type=int, default=1000, help="accepted for compatibility")
    return p.parse_args(argv)


def build_tool_tokenizer(args):
    from megalite.data import tokenizer as tk

    if args.tokenizer_type == "GPT2BPETokenizer" and args.vocab_file:
        return tk.load_gpt2_bpe(args.vocab_file, args.merge_file or "")
    cfg = DataConfig(data_path=[args.input], tokenizer_type=args.tokenizer_type,
                     tokenizer_model=args.tokenizer_model,
                     dataset_text_field=args.json_keys[0], num_workers=args.workers)
    if args.tokenizer_type == "ByteLevelBPETokenizer":
        out = args.output_prefix + "_tokenizer"
        tok = tk.trained_bpe(cfg, args.cache_dir, args.vocab_size)
        tok.save_pretrained(out)
        print(f"trained BPE tokenizer ({tok.vocab_size} ids) saved to {out}; train with "
              f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {out}")
        return tok
    return tk.build_tokenizer(cfg, args.cache_dir, args.vocab_size)


# The loaders name the training flags; here the same values came from this tool's flags.
_FLAG_NAMES = {"--data-path": "--input", "--dataset-text-field": "--json-keys"}


def main(argv=None) -> int:
    try:
        return _main(argv)
    except ConfigError as e:
        msg = str(e)
        for train_flag, tool_flag in _FLAG_NAMES.items():
            msg = msg.replace(train_flag, tool_flag)
        raise ConfigError(msg) from e


def _main(argv=None) -> int:
    args = get_args(argv)
    from tqdm import tqdm

    from megalite.data import sources
    from megalite.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype

    if args.split_sentences:
        raise ConfigError("--split-sentences is not supported; documents are kept whole "
                          "(drop the flag)")
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    start = time.time()
    tokenizer = build_tool_tokenizer(args)
    ds = sources.load_text_dataset(args.input, args.cache_dir, args.workers)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    dtype = optimal_dtype(tokenizer.vocab_size)
    for key in args.json_keys:
        tokenized = sources.tokenize_dataset(ds, tokenizer, key, args.workers,
                                             append_eod=args.append_eod, where=args.input)
        store = sources.store_from_tokenized(tokenized, args.input)
        prefix = f"{args.output_prefix}_{key}_document"
        with IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) as builder:
            for d in tqdm(range(store.num_documents), desc=f"writing {prefix}", unit="doc"):
                # Megatron keeps empty documents too (an empty sequence): indices stay aligned
                # with the input rows.
                builder.add_document(store.get_document(d))
            builder.finalize(prefix + ".idx")
        print(f"wrote {prefix}.bin/.idx: {store.num_documents} documents, {store.num_tokens} "
              f"tokens, dtype {dtype.__name__}")
    print(f"done in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
