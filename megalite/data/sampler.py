"""Megatron's pretraining sampler and the data loader built on it (docs/data.md, "Sampler and
resume": why a global batch is the same samples for any DP size, and resumes exactly)."""

from __future__ import annotations

from typing import Iterator, List, Optional

import numpy as np
import torch

from megalite.config import ConfigError


class PretrainingSampler:
    """Yields, forever, this rank's micro-batches as lists of dataset indices: unlike Megatron's it
    wraps around at the end of the dataset instead of ending the run early."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        if total_samples <= 0:
            raise ConfigError(f"the dataset has no samples (len {total_samples}); check "
                              f"--data-path and --split")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} is not in "
                             f"[0, {data_parallel_size})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.rank, self.size = int(data_parallel_rank), int(data_parallel_size)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.size
        g = self.consumed_samples + self.rank * self.micro_batch_size
        while True:
            yield [(g + k) % self.total_samples for k in range(self.micro_batch_size)]
            g += step


def collate(samples) -> dict:
    return {"tokens": torch.from_numpy(np.stack([np.asarray(s["tokens"], dtype=np.int64)
                                                 for s in samples]))}


def build_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                      data_parallel_rank: int, data_parallel_size: int,
                      num_workers: int = 0) -> Optional[torch.utils.data.DataLoader]:
    """An infinite iterable of this rank's micro-batches ``{"tokens": LongTensor[b, s+1]}``; each
    ``iter(loader)`` starts again at ``consumed_samples``. None for a None dataset."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate, pin_memory=False,
                                       persistent_workers=num_workers > 0)
