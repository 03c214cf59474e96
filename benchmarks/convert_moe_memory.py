"""Peak host memory of the MoE checkpoint converter (tools/checkpoint/convert.py), measured.

A random Hugging Face MoE model (Qwen3-MoE layout by default: 8 experts x 4 layers, hidden 256,
expert width 512, untied embeddings of 8192 x 256) is saved with ``save_pretrained`` (hub form:
one tensor per expert and projection), then converted in a fresh process per operation:

* hf-to-megalite at pp = L (one layer per stage), at pp = 2 and at pp = 1;
* megalite-to-hf with output shards no larger than a layer of experts.

Each process first converts a tiny model of the same family (imports and caches are not what is
measured), resets Linux's peak RSS (``/proc/self/clear_refs``) and reports ``VmHWM`` growth over
its RSS at that point. The figures are set against the bytes of one layer's tensors (attention,
norms, router and every expert) and of the embeddings (input and output), read from the hub
file. The converter builds each target pipeline stage whole before saving it
(docs/checkpoints.md, "Streaming and memory"), so hf-to-megalite holds one stage plus the layer
being read: at pp = L that is about one layer plus an embedding.

    OMP_NUM_THREADS=1 python benchmarks/convert_moe_memory.py            # docs/models.md
    OMP_NUM_THREADS=1 python benchmarks/convert_moe_memory.py --layers 8 --experts 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MEASURE = r"""
import json, os, shutil, sys, tempfile
sys.path.insert(0, {root!r})
from megalite.checkpoint import convert as ct
from megalite.checkpoint.layout import Layout
from megalite.memory import host_rss_bytes, reset_host_peak_rss

def run(op, src, dst):
    if op == "import":
        ct.hf_to_megalite(src, dst, Layout(1, {pp}))
    else:
        ct.megalite_to_hf(src, dst, max_shard_bytes={shard})

w = tempfile.mkdtemp()
run({op!r}, {tiny!r}, os.path.join(w, "x"))  # warm-up
shutil.rmtree(w)
base = reset_host_peak_rss()
run({op!r}, {src!r}, {dst!r})
print(json.dumps({{"growth": host_rss_bytes("VmHWM") - base}}))
"""


def make_hf(out: str, layers: int, experts: int, hidden: int, ffn: int, vocab: int) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=hidden // 4, num_experts=experts,
                         num_experts_per_tok=2, moe_intermediate_size=ffn,
                         intermediate_size=2 * ffn, vocab_size=vocab, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)


def tensor_bytes(hf_dir: str):
    """(bytes of layer 0's tensors, bytes of the embeddings and LM head) in the hub file."""
    from safetensors import safe_open

    layer = emb = 0
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            n = 4
            for d in t.get_shape():
                n *= d
            if k.startswith("model.layers.0."):
                layer += n
            elif "embed_tokens" in k or k.startswith("lm_head"):
                emb += n
    return layer, emb


def peak_growth(op: str, src: str, dst: str, tiny: str, pp: int = 1, shard: int = 2 << 30):
    code = _MEASURE.format(root=ROOT, op=op, pp=pp, shard=shard, tiny=tiny, src=src, dst=dst)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["growth"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        print("needs Linux /proc (peak RSS reset)", file=sys.stderr)
        return 2
    from megalite.checkpoint import convert as ct
    from megalite.checkpoint.layout import Layout

    with tempfile.TemporaryDirectory() as d:
        src, tiny = os.path.join(d, "hf"), os.path.join(d, "tiny")
        make_hf(src, a.layers, a.experts, a.hidden, a.ffn, a.vocab)
        make_hf(tiny, a.layers, a.experts, 32, 16, 64)
        layer, emb = tensor_bytes(src)
        # the export reads a megalite checkpoint: one made here (tiny: its warm-up)
        ct.hf_to_megalite(src, os.path.join(d, "ml"), Layout(1, 1))
        ct.hf_to_megalite(tiny, os.path.join(d, "ml_tiny"), Layout(1, 1))
        rows = {}
        for pp in sorted({a.layers, 2, 1}, reverse=True):
            rows[f"hf-to-megalite pp={pp}"] = peak_growth(
                "import", src, os.path.join(d, f"out{pp}"), tiny, pp=pp)
        rows["megalite-to-hf, shards <= 1 layer"] = peak_growth(
            "export", os.path.join(d, "ml"), os.path.join(d, "back"), os.path.join(d, "ml_tiny"),
            shard=layer)
    mib = 2 ** 20
    print(f"Qwen3-MoE {a.layers} layers x {a.experts} experts, hidden {a.hidden}, expert width "
          f"{a.ffn}: one layer {layer / mib:.1f} MiB, embeddings {emb / mib:.1f} MiB, model "
          f"{(a.layers * layer + emb) / mib:.1f} MiB")
    print("| operation | peak RSS growth | in layers, after the embeddings |")
    print("| --- | --- | --- |")
    for name, g in rows.items():
        print(f"| {name} | {g / mib:.1f} MiB | {(g - emb) / layer:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"layer_bytes": layer, "embedding_bytes": emb, "growth_bytes": rows}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
