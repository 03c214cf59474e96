"""GPT samples: documents packed into fixed-length samples, split, shuffled and blended
(docs/data.md, "Packing", "Splits", "Blending"). No process count or rank enters, which makes
the data layout-independent (docs/design.md, contract 4).

A *document store* is anything with ``num_documents``, ``document_lengths`` (int64 tokens per
document), ``get_document(d)`` and ``name``: ``IndexedDataset`` and ``ArrayDocumentStore``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import numpy as np

from megalite.config import ConfigError


class ArrayDocumentStore:
    """Document d is ``tokens[offsets[d]:offsets[d+1]]``."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, name: str = "") -> None:
        self.tokens = tokens
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.name = name

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def document_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def get_document(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d]:self.offsets[d + 1]]


def split_weights(split: str) -> List[float]:
    """``--split`` as three weights, padded with zeros (``--split 100`` is train only)."""
    w = [float(x) for x in split.replace("/", ",").split(",") if x.strip() != ""]
    return (w + [0.0, 0.0, 0.0])[:3]


def split_document_ranges(num_documents: int, split: str) -> List[range]:
    """``--split 969,30,1`` -> three contiguous document ranges (train, valid, test)."""
    weights = split_weights(split)
    cum = np.cumsum(weights) / sum(weights)
    bounds = [0] + [int(round(c * num_documents)) for c in cum]
    bounds[-1] = num_documents  # guard against float round-off in the last boundary
    return [range(bounds[i], bounds[i + 1]) for i in range(3)]


class GPTDataset:
    """Packed, shuffled samples of ``seq_length + 1`` tokens from a range of documents."""

    def __init__(self, store, documents: Sequence[int], seq_length: int, num_samples: int,
                 seed: int, name: str = "") -> None:
        self.store, self.seq_length, self.name = store, int(seq_length), name
        lengths_all = np.asarray(store.document_lengths, dtype=np.int64)
        docs = np.asarray(documents, dtype=np.int64)
        docs = docs[lengths_all[docs] > 0]  # empty documents carry nothing to pack
        tokens_per_epoch = int(lengths_all[docs].sum()) if len(docs) else 0
        s = self.seq_length
        if tokens_per_epoch < 2:
            raise ConfigError(f"--data-path: {store.name or 'dataset'} ({name}) has "
                              f"{tokens_per_epoch} tokens in its split; need at least 2 "
                              f"(check --split and that the data is not empty)")
        # Enough epochs that the stream holds num_samples samples (each needs s new tokens + 1).
        num_samples = max(int(num_samples), 1)
        self.num_epochs = max(1, math.ceil((num_samples * s + 1) / tokens_per_epoch))
        rng = np.random.RandomState(seed)
        self.doc_order = np.concatenate([rng.permutation(docs) for _ in range(self.num_epochs)])
        self.cum_tokens = np.zeros(len(self.doc_order) + 1, dtype=np.int64)
        np.cumsum(lengths_all[self.doc_order], out=self.cum_tokens[1:])
        total = int((self.cum_tokens[-1] - 1) // s)
        idx_dtype = np.int32 if total < 2 ** 31 else np.int64
        self.shuffle_idx = rng.permutation(np.arange(total, dtype=idx_dtype))

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def sample_tokens(self, j: int) -> np.ndarray:
        """Unshuffled sample j: stream tokens [j*s, j*s + s + 1)."""
        s = self.seq_length
        start, end = j * s, j * s + s + 1
        k = int(np.searchsorted(self.cum_tokens, start, side="right")) - 1
        out = np.empty(s + 1, dtype=np.int64)
        filled = 0
        while filled < s + 1:
            doc = int(self.doc_order[k])
            off = start + filled - int(self.cum_tokens[k])
            take = min(int(self.cum_tokens[k + 1]) - (start + filled), end - (start + filled))
            out[filled:filled + take] = self.store.get_document(doc)[off:off + take]
            filled += take
            k += 1
        return out

    def __getitem__(self, i: int) -> dict:
        return {"tokens": self.sample_tokens(int(self.shuffle_idx[int(i)]))}


class MockGPTDataset:
    """``--mock-data``: uniformly random tokens, a function of (seed, split, index) alone."""

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int,
                 split_id: int = 0) -> None:
        self.vocab_size, self.seq_length = int(vocab_size), int(seq_length)
        self.num_samples, self.seed, self.split_id = max(int(num_samples), 1), seed, split_id

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        rng = np.random.RandomState([self.seed % (2 ** 32), self.split_id, int(i)])
        return {"tokens": rng.randint(0, self.vocab_size, self.seq_length + 1).astype(np.int64)}


def blending_indices(weights: Sequence[float], size: int):
    """(dataset_index, index within that dataset), both int64[size]: Megatron-LM's greedy
    largest-deficit rule (docs/data.md, "Blending")."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    ds_index = np.empty(size, dtype=np.int64)
    ds_sample = np.empty(size, dtype=np.int64)
    rng_k = range(len(w))
    for n in range(size):
        best = max(rng_k, key=lambda i: (w[i] * (n + 1) - counts[i], -i))
        ds_index[n] = best
        ds_sample[n] = counts[best]
        counts[best] += 1
    return ds_index, ds_sample


class BlendedDataset:
    """``size`` samples drawn from several datasets in the proportions ``weights``."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, self.size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        d = int(self.dataset_index[i])
        ds = self.datasets[d]
        # A component built for fewer samples than it is asked for wraps (never happens when its
        # size came from blended_component_samples, but keeps hand-built blends safe).
        return ds[int(self.dataset_sample_index[i]) % len(ds)]


def blended_component_samples(weight: float, size: int) -> int:
    """Samples a dataset of weight ``weight`` provides a blend of ``size`` (a bound of the rule)."""
    return int(math.ceil(weight * size)) + 1


def parse_blend(data_path: Optional[Sequence[str]]):
    """``--data-path`` list -> (paths, weights); weights None for paths without numbers (each
    weighs its token count: plain concatenation)."""
    items = [str(x) for x in (data_path or [])]
    if not items:
        raise ConfigError("--data-path is empty; give a path or HF dataset name, or a blend like "
                          "--data-path 0.7 a 0.3 b")
    if len(items) == 1:
        return items, [1.0]

    def num(x):
        try:
            return float(x)
        except ValueError:
            return None

    numeric = [num(x) is not None for x in items]
    if not any(numeric):
        return items, None
    if len(items) % 2 != 0 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise ConfigError(f"--data-path: malformed blend {items!r}; expected alternating weight "
                          f"and path, like --data-path 0.7 a 0.3 b")
    weights = [float(x) for x in items[0::2]]
    paths = items[1::2]
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--data-path: blend weights {weights} must be non-negative with a "
                          f"positive sum, like --data-path 0.7 a 0.3 b")
    return paths, weights
