"""Rotary position embeddings (Su et al., arXiv:2104.09864), in the "rotate half" convention that
Hugging Face's Llama uses, so converted checkpoints give identical logits.
"""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache = None

    def forward(self, seq_len: int, device, dtype):
        """cos, sin of shape [s, 1, 1, d] for positions 0..seq_len-1."""
        key = (seq_len, device, dtype)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
        result = (emb.cos().to(dtype), emb.sin().to(dtype))
        self._cache = (key, result)
        return result


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [s, b, n, d]."""
    return x * cos + _rotate_half(x) * sin
