"""MXFP4 (OCP Microscaling FP4), the form GPT-OSS's hub files store the experts in, dequantised on
import (docs/models.md, "GPT-OSS"): ``NAME_blocks`` [..., n, G, 16] uint8 holds 32 E2M1 values per
block of a row, two a byte, low nibble first; ``NAME_scales`` [..., n, G] uint8 is each block's
E8M0 exponent, a factor 2^(s - 127). NAME is [..., G * 32, n], the rows' transpose."""

import torch

# the E2M1 codes 0-7 (0, then 1.x and 2^e), 8-15 the same with the sign bit set
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    codes = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), device=blocks.device)
    pairs = torch.stack([codes.repeat(16), codes.repeat_interleave(16)], -1)  # byte -> lo, hi
    *lead, n, g, b = blocks.shape
    out = torch.empty(tuple(lead) + (g * 32, n), dtype=dtype, device=blocks.device)
    # one leading index (an expert) at a time: its fp32 values take 8 times its packed bytes
    for o, x, s in zip(out.view((-1, g * 32, n)), blocks.reshape((-1, n, g, b)),
                       scales.reshape((-1, n, g))):
        values = pairs.index_select(0, x.flatten().int()).view(n, g, 32)
        values.mul_(torch.exp2(s.float() - 127).unsqueeze(-1))  # a power of two: exact
        o.t().copy_(values.view(n, g * 32))  # written transposed: no second copy
    return out
