"""benchmarks/gpu_check.sh's context-parallel block step without a GPU: it reports that it did
not run, never a pass, and its comparison harness tells a good kernel from broken ones."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402

from megalite.context_parallel import blocks as B  # noqa: E402


def test_cp_blocks_step_without_cuda_reports_not_run(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run",
                           "--only", "cp_blocks", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    (step,) = summary["steps"]
    assert step["step"] == "cp_blocks" and step["status"] == "skip" and step["rc"] == 77
    assert step["result"]["ran"] is False and step["result"]["pass"] is False
    assert summary["not_run"] == ["cp_blocks"]
    # nothing ran, so the whole check is no pass either
    assert proc.returncode == 1 and summary["all_pass"] is False
    text = (tmp_path / "summary.txt").read_text()
    assert "cp_blocks              skip" in text and "NOT RUN: no CUDA device" in text


def test_cp_block_harness_passes_a_good_kernel_and_fails_broken_ones():
    def raises(*args):
        raise RuntimeError("kernel failed")

    def ignores_mask(q, k, v, causal, scale):
        return B.MATH.fwd(q, k, v, False, scale)

    kernels = (B.CPU_FLASH, B.BlockKernel("raises", B.MATH.fwd, raises),
               B.BlockKernel("ignores_mask", ignores_mask, B.MATH.bwd), B.FLASH)
    cases = gpu_check.cp_block_cases(kernels, "cpu", dtypes=("float32",), head_dims=(8,),
                                     seq=32, heads=4)
    status = {}
    for c in cases:
        status.setdefault(c["kernel"], set()).add(c["status"])
    # FLASH takes no fp32: listed as not applicable, not as a pass
    assert status == {"cpu_flash": {"pass"}, "raises": {"fail"}, "ignores_mask": {"fail"},
                      "flash": {"n/a"}}
    good = [c for c in cases if c["kernel"] == "cpu_flash"]
    assert len(good) == 2 and all(c["max_error"] < 1e-5 and len(c["errors"]) == 15
                                  for c in good)
    assert all("kernel failed" in c["error"] for c in cases if c["kernel"] == "raises")
