"""benchmarks/moe.py stays runnable: a tiny shape, both tables, the JSON it writes."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import moe as bench  # noqa: E402


def test_tiny_moe_benchmark_runs_both_tables(tmp_path):
    out = tmp_path / "moe.json"
    bench.main(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--seq-length", "16",
                "--micro-batch-size", "1", "--vocab-size", "64", "--warmup", "1", "--rounds", "1",
                "--ep", "1,2", "--json", str(out)])
    doc = json.loads(out.read_text())
    t = doc["throughput"]
    names = ["megalite grouped", "megalite loop", "HF grouped_mm", "HF batched_mm", "HF eager"]
    assert list(t["median_ms"]) == names and all(v > 0 for v in t["median_ms"].values())
    assert len(set(t["params"].values())) == 1  # the same shape on both sides
    assert set(t["speedup_vs_hf_fastest"]) == {"megalite grouped", "megalite loop"}
    ep1, ep2 = doc["memory"]
    assert (ep1["ep"], ep2["ep"]) == (1, 2) and ep2["expert_numel"] * 2 == ep1["expert_numel"]
    # fp32 AdamW: two moments per expert parameter, both measured
    assert ep1["optimizer_state_bytes"] == 2 * ep1["params_bytes"] > 0
    assert ep2["target_met"] and ep2["fraction_of_base"] <= 0.525
