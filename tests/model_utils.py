"""Tiny model configurations and helpers shared by the parity tests."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from megalite import collectives as C
from megalite.config import ModelConfig
from megalite.param_meta import param_meta
from megalite.tensor_parallel.utils import unshard_tensors

VOCAB = 100  # deliberately not a multiple of tp * divisible_by, so padding is exercised


def tiny_config(family: str = "gpt2", **overrides) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                vocab_size=VOCAB, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                attention_dropout=0.0)
    if family == "llama":
        base.update(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                    add_bias_linear=False, untie_embeddings_and_output_weights=True,
                    num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48, norm_epsilon=1e-6)
    elif family != "gpt2":
        raise ValueError(family)
    base.update(overrides)
    return ModelConfig(**base)


def gather_full_tensor(t: torch.Tensor, param, tp_group) -> torch.Tensor:
    """All-gather a TP-sharded tensor (a parameter or its grad) to its full shape."""
    n, meta = C.group_size(tp_group), param_meta(param)
    if n == 1 or not meta.tp_split:
        return t.detach().clone()
    shards = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(shards, t.detach().contiguous(), group=tp_group)
    return unshard_tensors(shards, meta.partition_dim, meta.partition_stride)


def full_grads(model, tp_group, vocab_size: int = VOCAB) -> Dict[str, torch.Tensor]:
    """name -> full gradient; vocab-sized tensors trimmed to the real vocab."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        full = gather_full_tensor(g, p, tp_group)
        if "word_embeddings" in name or "output_layer" in name:
            full = full[:vocab_size]
        out[name] = full
    return out


def full_params(model, tp_group, vocab_size: int = VOCAB) -> Dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = gather_full_tensor(p.data, p, tp_group)
        if "word_embeddings" in name or "output_layer" in name:
            full = full[:vocab_size]
        out[name] = full
    return out


def assert_grads_close(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor],
                       rel: float = 1e-5, where: str = "") -> None:
    assert set(got) == set(ref), f"{where}: parameter names differ: {set(got) ^ set(ref)}"
    for name, g in got.items():
        r = ref[name]
        assert g.shape == r.shape, f"{where}: {name} shape {tuple(g.shape)} != {tuple(r.shape)}"
        scale = max(r.norm().item(), 1e-8)
        err = (g - r).abs().max().item()
        assert err <= rel * scale, f"{where}: grad {name} max-abs err {err:.3e} > {rel} x norm {scale:.3e}"
