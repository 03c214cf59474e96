"""Data for pretraining: tokenizers, HF datasets and Megatron's .bin/.idx, packed GPT samples,
blends, splits, the pretraining sampler, and get_batch. See docs/data.md."""

from megalite.data.batch import get_batch
from megalite.data.builder import build_pretraining_datasets
from megalite.data.gpt_dataset import BlendedDataset, GPTDataset, MockGPTDataset
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.data.sampler import PretrainingSampler, build_data_loader
from megalite.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["build_tokenizer", "build_pretraining_datasets", "build_data_loader", "get_batch",
           "Tokenizer", "IndexedDataset", "IndexedDatasetBuilder", "GPTDataset",
           "BlendedDataset", "MockGPTDataset", "PretrainingSampler"]
