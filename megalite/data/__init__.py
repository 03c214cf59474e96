"""Data for pretraining: tokenizers, HF datasets and Megatron's .bin/.idx, packed GPT samples,
blends, splits, the pretraining sampler, and get_batch. See docs/data.md."""

from megalite.data.batch import get_batch  # noqa: F401
from megalite.data.builder import build_pretraining_datasets  # noqa: F401
from megalite.data.gpt_dataset import BlendedDataset, GPTDataset, MockGPTDataset  # noqa: F401
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: F401
from megalite.data.sampler import PretrainingSampler, build_data_loader  # noqa: F401
from megalite.data.tokenizer import Tokenizer, build_tokenizer  # noqa: F401
