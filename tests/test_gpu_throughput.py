"""benchmarks/gpu_throughput.py stays runnable: its tiny CPU row, megalite and Hugging Face."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_throughput.py")


def _run(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, SCRIPT, *argv], env=env, capture_output=True,
                          text=True, timeout=300)


def test_tiny_row_on_cpu_prints_table_and_json(tmp_path):
    out = tmp_path / "result.json"
    proc = _run("--rows", "tiny-llama", "--systems", "megalite,hf", "--iters", "2",
                "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    res = doc["rows"]["tiny-llama"]["results"]
    for system in ("megalite", "hf"):
        assert res[system]["tokens_per_sec"] > 0 and res[system]["peak_memory_bytes"] > 0
        assert 0 < res[system]["mfu"] <= 1
    assert abs(res["megalite"]["ratio_to_hf"]
               - res["megalite"]["tokens_per_sec"] / res["hf"]["tokens_per_sec"]) < 1e-9
    assert "| tiny-llama | megalite |" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == doc


def test_unknown_row_fails_in_one_line():
    proc = _run("--rows", "gpt2-7t")
    assert proc.returncode == 2
    assert "--rows: unknown gpt2-7t; valid:" in proc.stderr.strip().splitlines()[-1]
