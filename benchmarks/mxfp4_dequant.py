"""MXFP4 dequantisation on import: megalite's against transformers' convert_moe_packed_tensors.

    OMP_NUM_THREADS=1 python benchmarks/mxfp4_dequant.py                 # a gpt-oss-20b layer
    python benchmarks/mxfp4_dequant.py --experts 128 --device cuda        # a gpt-oss-120b one

Dequantises one layer's random ``gate_up_proj_blocks`` / ``_scales`` (E experts, 2f = 5760 rows,
h = 2880: gpt-oss's shapes) to bf16 with each, checks that the results are equal, and prints the
time of each and megalite's packed bytes per second (docs/models.md, "GPT-OSS: conversion and
MXFP4").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megalite.convert.mxfp4 import dequantize_mxfp4  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (a.experts, 5760, 90, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 128, (a.experts, 5760, 90), generator=gen, dtype=torch.uint8)
    blocks, scales = blocks.to(a.device), scales.to(a.device)
    out = {}
    for name, fn in (("megalite", dequantize_mxfp4),
                     ("transformers", lambda b, s, d: convert_moe_packed_tensors(b, s, dtype=d))):
        if a.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out[name] = fn(blocks, scales, torch.bfloat16)
        if a.device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        print(f"{name:12s} {took:7.2f} s  {blocks.numel() / took / 2**20:8.1f} MiB/s packed")
    assert torch.equal(out["megalite"], out["transformers"])
    print(f"equal; {blocks.numel() / 2**20:.0f} MiB packed -> {tuple(out['megalite'].shape)} bf16")


if __name__ == "__main__":
    main()
