"""MXFP4 (OCP Microscaling FP4), the form GPT-OSS's hub files store the experts in, dequantised on
import (docs/models.md, "GPT-OSS"): ``NAME_blocks`` [..., n, G, 16] uint8 holds 32 E2M1 values per
block of a row, two a byte, low nibble first; ``NAME_scales`` [..., n, G] uint8 is each block's
E8M0 exponent, a factor 2^(s - 127). NAME is [..., G * 32, n], the rows' transpose."""

import torch

# the E2M1 codes 0-7 (0, then 1.x and 2^e), 8-15 the same with the sign bit set
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    lut = torch.tensor(_E2M1 + tuple(-v for v in _E2M1))
    out = torch.empty(blocks.shape[:-2] + (blocks.shape[-2] * 32,), dtype=dtype)
    # one leading index (an expert) at a time: the 64-bit indices are 16 times the packed bytes
    for o, b, s in zip(out.view((-1,) + out.shape[-2:]), blocks.reshape((-1,) + blocks.shape[-3:]),
                       scales.reshape((-1,) + scales.shape[-2:])):
        b = b.long()
        values = torch.stack([lut[b & 15], lut[b >> 4]], -1).flatten(-2)  # [n, G, 32]
        o.copy_((values * torch.exp2(s.float() - 127).unsqueeze(-1)).flatten(-2))
    return out.transpose(-1, -2).contiguous()
