"""benchmarks/gpu_check.sh's context-parallel block, document kernel, attention sink and fla steps
without a GPU: they report that they did not run, never a pass, and their comparison harnesses
tell a good kernel from broken ones."""

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402

from megalite.context_parallel import blocks as B  # noqa: E402


def test_cuda_kernel_steps_without_cuda_report_not_run(tmp_path):
    """The CP block kernels' step, the document kernel's, the sinks' and offload's device
    memory."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run",
                           "--only", "cp_blocks,doc_attention,attention_sinks,offload", "--out",
                           str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    names = ["cp_blocks", "doc_attention", "attention_sinks", "offload"]
    for step, name in zip(summary["steps"], names, strict=True):
        assert step["step"] == name and step["status"] == "skip" and step["rc"] == 77
        assert step["result"]["ran"] is False and step["result"]["pass"] is False
    assert summary["not_run"] == names
    # nothing ran, so the whole check is no pass either
    assert proc.returncode == 1 and summary["all_pass"] is False
    text = (tmp_path / "summary.txt").read_text()
    rows = [line.split(None, 3) for line in text.splitlines()
            if line.startswith(tuple(n + " " for n in names))]
    assert [(r[0], r[1]) for r in rows] == [(n, "skip") for n in names]
    assert all(r[3].startswith("NOT RUN: no CUDA device") for r in rows), text


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


def test_doc_attention_harness_passes_the_cpu_path_and_fails_one_ignoring_documents(
        monkeypatch):
    """The harness on the CPU (SDPA per document): every case within tolerance; attention that
    ignores the documents (plain causal, within the window) fails every case."""
    from megalite import masks

    small = dict(dtypes=("float32",), head_dims=(8,), lengths=((1, 20, 11), (30, 2)), heads=4,
                 windows=(None, 5))
    good = gpu_check.doc_attention_cases("cpu", **small)
    assert len(good) == 4 and all(c["status"] == "pass" and c["max_error"] < 1e-5
                                  and c["path"] == "sdpa per document" for c in good), good
    monkeypatch.setattr(masks, "document_attention",
                        lambda q, k, v, docs, window=None, **kw: masks.causal_attention(
                            q, k, v, window, **kw))
    bad = gpu_check.doc_attention_cases("cpu", **small)
    assert all(c["status"] == "fail" and c["max_error"] > 1e-2 for c in bad), bad


def test_attention_sinks_harness_passes_the_cpu_path_and_fails_broken_sinks(monkeypatch):
    """The sinks' harness on the CPU (the CPU flash block kernel, masked under a window or
    documents): every case within tolerance and named by its kernel; a sink left out of the
    output fails every case, a sink whose gradient is dropped fails every case on dsink alone."""
    from megalite import masks

    small = dict(head_dims=(8,), lengths=((1, 20, 11), (30, 2)), heads=4)
    good = gpu_check.attention_sinks_cases("cpu", **small)
    assert len(good) == 12 and all(c["status"] == "pass" and len(c["errors"]) == 5
                                   for c in good), good
    assert all(c["max_error"] < 1e-5 for c in good if c["dtype"] == "float32"), good
    assert {c["layout"]: c["path"] for c in good} == {
        "causal": "cpu_flash", "window": "cpu_flash_masked under a mask",
        "documents + window": "cpu_flash_masked under a mask"}
    with monkeypatch.context() as m:
        m.setattr(masks, "apply_attention_sink", lambda out, lse, sink: (out.float(), lse))
        ignored = gpu_check.attention_sinks_cases("cpu", **small)
    assert all(c["status"] == "fail" and c["errors"]["out"] > 0.1 for c in ignored), ignored
    monkeypatch.setattr(masks, "attention_sink_grad", lambda dout, out, lse, sink:
                        torch.zeros_like(sink))
    dropped = gpu_check.attention_sinks_cases("cpu", **small)
    assert all(c["status"] == "fail" and c["errors"]["dsink"] == 1.0
               and c["errors"]["out"] < 2e-2 for c in dropped), dropped


def test_linear_attention_harness_passes_the_torch_rule_and_fails_a_broken_one(tmp_path):
    """The fla step's comparison (benchmarks/gpu_check.py linear_attention): the exact rule in
    16 bits passes, one without the decay fails; without CUDA the step reports not run."""
    from megalite.models.linear_attention import gated_delta_rule

    def no_decay(q, k, v, g, beta):
        return gated_delta_rule(q, k, v, torch.zeros_like(g), beta)

    small = dict(dtypes=("bfloat16",), head_dims=(8,), seq=80, heads=2)
    good = gpu_check.linear_attention_cases(gated_delta_rule, "cpu", **small)
    bad = gpu_check.linear_attention_cases(no_decay, "cpu", **small)
    assert [c["status"] for c in good] == ["pass"] and len(good[0]["errors"]) == 6
    assert [c["status"] for c in bad] == ["fail"]
    result = tmp_path / "r.json"
    assert gpu_check.main(["linear_attention", "--device", "cpu", "--result", str(result)]) \
        == gpu_check.NOT_RUN
    assert json.loads(result.read_text())["ran"] is False
