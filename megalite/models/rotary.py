"""Rotary position embeddings (Su et al., arXiv:2104.09864), in the "rotate half" convention that
Hugging Face's Llama uses, so converted checkpoints give identical logits. The sign of rotate-half
is folded into the cached sine table (sin_signed = [-sin, sin]) and the halves are swapped by one
``flip`` (docs/performance.md, "Fast paths").
"""

from __future__ import annotations

import math

import torch


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                  high_freq_factor: float, original_max_positions: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling of RoPE's inverse frequencies (docs/models.md)."""
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original_max_positions / wavelen - low_freq_factor)
              / (high_freq_factor - low_freq_factor))
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original_max_positions / low_freq_factor, inv_freq / factor, mid)
    return torch.where(wavelen < original_max_positions / high_freq_factor, inv_freq, out)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1·m·ln(s) + 1 for a context stretched s times (1 for s <= 1;
    Peng et al., arXiv:2309.00071, eq. 22 with DeepSeek's m)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(head_dim: int, base: float, factor: float, original_max_positions: int,
                  beta_fast: float, beta_slow: float, truncate: bool = True) -> torch.Tensor:
    """YaRN's "NTK-by-parts" inverse frequencies: kept, interpolated (f / s) or ramped between, by
    how often each dim pair turns over the original context (docs/models.md, "YaRN RoPE");
    ``truncate``: the ramp's ends rounded out to whole pairs (GPT-OSS keeps them fractional)."""
    def dim_turning(turns: float) -> float:  # the pair index 2i / 2 whose wavelength fits L/turns
        return (head_dim * math.log(original_max_positions / (turns * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low)
            / ((high - low) or 0.001)).clamp(0, 1)  # 0: extrapolate (keep), 1: interpolate
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return 1.0 / (factor * pos_freqs) * ramp + 1.0 / pos_freqs * (1 - ramp)


def rotary_embedding(config, head_dim: int) -> "RotaryEmbedding":
    """``config``'s rotary embedding (plain, llama3 or YaRN) for a RoPE part ``head_dim`` wide."""
    if config.rope_type == "yarn":
        return RotaryEmbedding(head_dim, config.rotary_base, yarn=(
            config.rotary_scaling_factor, config.rope_original_max_position_embeddings,
            config.beta_fast, config.beta_slow, config.mscale, config.mscale_all_dim,
            config.rope_yarn_truncate))
    scaling = None if config.rope_scaling_factor is None else (
        config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
        config.rope_original_max_position_embeddings)
    return RotaryEmbedding(head_dim, config.rotary_base, scaling)


class RotaryEmbedding(torch.nn.Module):
    # (head_dim, base, scaling, device, dtype) -> (cos, sin_signed) for the longest length asked
    # so far, shared by every layer's instance: one copy per model, not one per layer
    _tables_cache: dict = {}

    def __init__(self, head_dim: int, base: float = 10000.0, llama3_scaling=None, yarn=None):
        # llama3_scaling: None or llama3_scaled's arguments after inv_freq; yarn: None or
        # (factor, original max positions, beta fast and slow, mscale, mscale_all_dim, truncate)
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if llama3_scaling is not None:
            inv_freq = llama3_scaled(inv_freq, *llama3_scaling)
        self.attention_factor = 1.0  # YaRN multiplies cos and sin by its temperature ratio
        if yarn is not None:
            factor, original, fast, slow, mscale, mscale_all_dim, truncate = yarn
            inv_freq = yarn_inv_freq(head_dim, base, factor, original, fast, slow, truncate)
            self.attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor,
                                                                               mscale_all_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._key = (head_dim, float(base), tuple(llama3_scaling or ()), tuple(yarn or ()))

    def forward(self, seq_len: int, device, dtype):
        """cos, sin_signed of shape [s, 1, 1, d] for positions 0..seq_len-1."""
        if torch.compiler.is_compiling():
            # --torch-compile: built inside the graph, since reading the cache there would guard
            # on its contents (a recompile once it fills; docs/performance.md)
            return self._tables(seq_len, device, dtype)
        key = (*self._key, torch.device(device), dtype)
        hit = self._tables_cache.get(key)
        if hit is None or hit[0].shape[0] < seq_len:
            hit = self._tables_cache[key] = self._tables(seq_len, device, dtype)
        return hit[0][:seq_len], hit[1][:seq_len]

    def at(self, positions: torch.Tensor, seq_len: int, device, dtype):
        """cos, sin_signed [s, 1 or b, 1, d] at ``positions`` [s] (or [s, b]: per sample), all
        below ``seq_len`` (context parallelism: a rank's tokens are not 0..s-1; packed
        documents: positions restart)."""
        cos, sin = self(seq_len, device, dtype)
        index = positions if positions.dim() == 2 else positions[:, None]
        return cos[:, 0][index], sin[:, 0][index]

    def _tables(self, seq_len: int, device, dtype):
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.to(device))
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return (torch.cat([cos, cos], -1)[:, None, None, :].to(dtype),
                torch.cat([-sin, sin], -1)[:, None, None, :].to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [s, b, n, d] -> x * cos + rotate_half(x) * sin. Tables narrower than d (partial RoPE,
    --rotary-percent) rotate the first dims of each head; the rest pass through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :r], cos, sin_signed), x[..., r:]], dim=-1)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin_signed)
