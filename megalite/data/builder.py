"""``build_pretraining_datasets``: data config -> (train, valid, test) sample datasets."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from megalite.config import ConfigError, DataConfig
from megalite.data import sources
from megalite.data.gpt_dataset import (BlendedDataset, GPTDataset, MockGPTDataset,
                                       blended_component_samples, parse_blend,
                                       split_document_ranges, split_weights)

SPLIT_NAMES = ("train", "valid", "test")


def build_pretraining_datasets(data_cfg: DataConfig, tokenizer, seq_length: int, seed: int,
                               num_samples: Sequence[int], cache_dir: Optional[str] = None
                               ) -> Tuple[Optional[object], Optional[object], Optional[object]]:
    """(train, valid, test), each None or a dataset of at least its ``num_samples`` (0: one
    epoch) samples ``{"tokens": int64[seq_length + 1]}`` (docs/data.md, "Splits", "Blending")."""
    data_cfg.validate()
    if seq_length <= 0:
        raise ConfigError(f"--seq-length must be positive, got {seq_length}")
    num_samples = tuple(int(n) for n in num_samples)
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three non-negative counts, got {num_samples}")
    split_w = split_weights(data_cfg.split)

    if data_cfg.mock_data:
        return tuple(MockGPTDataset(tokenizer.vocab_size, seq_length, num_samples[k], seed, k)
                     if split_w[k] > 0 else None for k in range(3))

    paths, weights = [None], [1.0]  # the built-in corpus
    if data_cfg.data_path is not None:
        paths, weights = parse_blend(data_cfg.data_path)
    stores = [sources.load_document_store(p, data_cfg, tokenizer, cache_dir) for p in paths]
    for p, store in zip(paths, stores):
        if int(store.document_lengths.sum()) == 0:
            raise ConfigError(f"--data-path: {p or 'the built-in corpus'} has 0 tokens (empty "
                              f"dataset or only empty documents); give data with text")
    if data_cfg.reset_attention_mask:
        for p, store in zip(paths, stores):
            _check_document_ends(store, tokenizer.eod, p or "the built-in corpus")
    if weights is None:  # plain concatenation: each entry weighs what it holds
        weights = [float(s.document_lengths.sum()) for s in stores]
    ranges = [split_document_ranges(s.num_documents, data_cfg.split) for s in stores]

    out = []
    for k, name in enumerate(SPLIT_NAMES):
        if split_w[k] <= 0:
            out.append(None)
            continue
        parts = [(i, ranges[i][k]) for i in range(len(stores))
                 if weights[i] > 0 and int(stores[i].document_lengths[ranges[i][k]].sum()) >= 2]
        if not parts:
            if k == 0:
                raise ConfigError(f"--split {data_cfg.split}: the train split holds no tokens "
                                  f"(too few documents in --data-path for this split)")
            out.append(None)
            continue
        label = lambda i: f"{name} split of {paths[i] or 'the built-in corpus'}"  # noqa: E731
        if len(parts) == 1:
            i, r = parts[0]
            out.append(GPTDataset(stores[i], r, seq_length, num_samples[k], seed, label(i)))
            continue
        w = [weights[i] for i, _ in parts]
        w = [x / sum(w) for x in w]
        comps = [GPTDataset(stores[i], r, seq_length,
                            blended_component_samples(wi, num_samples[k]) if num_samples[k] else 0,
                            seed, label(i)) for (i, r), wi in zip(parts, w)]
        # num_samples 0: one pass over the largest share, the others wrapping as weights demand.
        size = num_samples[k] or max(int(len(c) / wi) for c, wi in zip(comps, w))
        out.append(BlendedDataset(comps, w, size))
    return tuple(out)


def _check_document_ends(store, eod: int, where: str) -> None:
    """--reset-attention-mask finds documents by their EOD: data without one at the end of its
    documents would be one long document (looks at the first 64 non-empty ones)."""
    lengths = store.document_lengths[:64]
    docs = [d for d in range(len(lengths)) if lengths[d] > 0]
    if docs and not any(int(store.get_document(d)[-1]) == eod for d in docs):
        raise ConfigError(f"--reset-attention-mask: the documents of {where} do not end with the "
                          f"EOD token ({eod}), so no document boundary can be found; preprocess "
                          f"it with --append-eod or drop the flag")
