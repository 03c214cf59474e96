"""Optimizer state on the host (--optimizer-cpu-offload, docs/offload.md): the same training and
the same checkpoint files as without it, at ZeRO 0, 1 and 3, skipped fp16 steps included."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import ConfigError, OptimizerConfig
from megalite.distributed.ddp import wrap_chunks
from megalite.models import GPTModel
from megalite.optimizer import build_optimizer
from megalite.optimizer.offload import host_units
from megalite.parallel_state import ParallelState
from megalite.planner import (GPUS, HOST_ADAMW_ELEMENTS_PER_S, PCIE_BANDWIDTH_GBPS, Cluster,
                              Layout, Model, memory, step_time)

from dist_utils import run_distributed
from model_utils import tiny_config
from pretrain_utils import flags, pretrain_cases, read_metrics

OFFLOAD = {"none": [], "f1": ["--optimizer-cpu-offload"],
           "f05": ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]}
# fp16 from a loss scale that overflows at the first step (skipped, the scale halved, hysteresis
# 1) and not after: iterations 2-5 update
FP16 = ["--fp16", "--initial-loss-scale", str(2 ** 20), "--hysteresis", "1"]
BUCKET = ["--ddp-bucket-size", "4000"]  # ZeRO 1: several shards, so f = 0.5 splits them


def _flat(x, key=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _flat(v, f"{key}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _flat(v, f"{key}/{i}")
    else:
        yield key, x


def _files(run: str, iteration: int = 5) -> dict:
    """{file/key: value} of the checkpoint of ``iteration``."""
    out = {}
    for f in glob.glob(f"{run}/iter_{iteration:07d}/**/*.pt", recursive=True):
        rel = os.path.relpath(f, run)
        out.update({f"{rel}{k}": v for k, v in _flat(torch.load(f, weights_only=False))})
    return out


def _assert_same_files(got: dict, ref: dict, exact: bool, where: str) -> None:
    assert ref and set(got) == set(ref), (where, set(got) ^ set(ref))
    for k, b in ref.items():
        a = got[k]
        if not torch.is_tensor(b):
            # (verify.pt's norms of the masters: as close as the masters)
            assert a == b or not exact and a == pytest.approx(b, rel=1e-6), (where, k)
            continue
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (where, k)
        if exact or torch.equal(a, b):
            assert torch.equal(a, b), (where, k)
        elif a.dtype == torch.float32:
            # torch's fused CPU AdamW and megalite's ZeRO step (the roundings of torch's foreach
            # path) differ in the last bit of the update: fp32 masters agree to 1e-6
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err <= 1e-6, (where, k, err)
        else:  # a 16-bit weight: the rounding of masters that differ in the last bit
            torch.testing.assert_close(a, b, rtol=2 ** -10, atol=0, msg=f"{where} {k}")


def test_offload_equals_device_optimizer(tmp_path):
    """f = 1 and 0.5 against no offload after 5 fp16 iterations (the first skipped), DP2 at
    ZeRO 0, 1 and 3: the same losses and skips, and the same checkpoint files (bit for bit at
    ZeRO 0, where both sides are torch's fused AdamW; else the masters at 1e-6)."""
    runs, names = [], []
    for zero in (0, 1, 3):
        for name, extra in OFFLOAD.items():
            d = tmp_path / f"z{zero}{name}"
            names.append((zero, name, d))
            runs.append(flags(*FP16, *BUCKET, *extra, "--save", d, "--save-interval", 5,
                              "--metrics-file", f"{d}.jsonl", train_iters=5, zero_stage=zero))
        for name in ("none", "f05"):  # resumed from the unoffloaded files, to iteration 7
            runs.append(flags(*FP16, *BUCKET, *OFFLOAD[name], "--load", tmp_path / f"z{zero}none",
                              "--metrics-file", tmp_path / f"z{zero}{name}_resumed.jsonl",
                              train_iters=7, zero_stage=zero))
    # experts over EP 2 at ZeRO 0: the checkpoint gathers the offloaded (host) expert state on
    # the device path (strict mode refuses a host tensor there, as NCCL would)
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
           "--expert-model-parallel-size", "2"]
    for name in ("none", "f1"):
        runs.append(flags(*moe, *OFFLOAD[name], "--save", tmp_path / f"ep{name}",
                          "--save-interval", 2, train_iters=2))
    run_distributed(pretrain_cases, 2, runs)
    _assert_same_files(_files(tmp_path / "epf1", 2), _files(tmp_path / "epnone", 2), True, "EP 2")
    for zero, name, d in names:
        recs = read_metrics(f"{d}.jsonl")
        assert [r["skipped_iterations"] for r in recs] == [1, 0, 0, 0, 0], (zero, name)
        ref = read_metrics(tmp_path / f"z{zero}none.jsonl")
        assert [r["lm_loss"] for r in recs] == pytest.approx([r["lm_loss"] for r in ref],
                                                              rel=1e-6), (zero, name)
        if name == "f05":
            resumed = [read_metrics(tmp_path / f"z{zero}{n}_resumed.jsonl") for n in (name, "none")]
            assert [r["iteration"] for r in resumed[0]] == [6, 7], zero
            assert [r["lm_loss"] for r in resumed[0]] == pytest.approx(
                [r["lm_loss"] for r in resumed[1]], rel=1e-6), zero
        if name != "none":
            _assert_same_files(_files(d), _files(tmp_path / f"z{zero}none"), zero == 0,
                               f"zero {zero} {name}")


def test_offload_fraction_and_bad_input():
    """The first units holding at least f of the elements; f = 0.5 of a real model's optimizer
    puts part of it on the host, not all; a fraction outside (0, 1] and sgd are refused."""
    for f, units in ((0.5, [0, 1]), (0.3, [0, 1]), (1.0, [0, 1, 2, 3])):
        cfg = OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=f)
        assert host_units([4, 4, 4, 4], cfg) == units
    assert host_units([4, 4, 4, 4], OptimizerConfig()) == []  # no offload, whatever f
    ps = ParallelState()
    for zero in (0, 1):
        cfg = OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                              zero_stage=zero, ddp_bucket_size=4000).validate()
        chunks, _, _ = wrap_chunks([GPTModel(tiny_config(), ps, seed=1)], cfg, ps)
        opt = build_optimizer(chunks, cfg, ps)
        sizes = [m.numel() for m in opt.masters]
        held = sum(h.numel() for h, _, _ in opt.host.units)
        assert 0.5 * sum(sizes) <= held < sum(sizes), (zero, held, sizes)
        assert len(opt.host.units) < len(sizes)
        if zero:  # the memory record counts the device's state only
            counted = [t for ts in opt.model_state_tensors().values() for t in ts]
            assert len(counted) == 3 * (len(sizes) - len(opt.host.units)), zero
    for bad, what in ((["--optimizer-offload-fraction", "0"], "(0, 1]"),
                      (["--optimizer-offload-fraction", "1.5"], "(0, 1]"),
                      (["--optimizer-cpu-offload", "--optimizer", "sgd"], "sgd")):
        with pytest.raises(ConfigError, match=r"--optimizer-.*" + what.replace("(", r"\(")
                           .replace("]", r"\]")):
            parse_args(flags(*bad))


def test_planner_offload_terms():
    """The planner's offload terms (docs/offload.md): bf16 at ZeRO 1 over DP 4, f = 1 moves the
    moments and masters (12 bytes per local element) to the host, which holds 18 (master, moments,
    gradient, staging); the step pays 6 bytes per local element over PCIe and the host AdamW."""
    m = Model.from_config(tiny_config(params_dtype="bfloat16"))
    lay = Layout(data_parallel_size=4, zero_stage=1)
    off = dataclasses.replace(lay, optimizer_offload_fraction=1.0)
    cl = Cluster(4, 8, GPUS["H100-80GB"])
    before, after = memory(m, lay, 8), memory(m, off, 8)
    local = before["optimizer"] / 12  # 4 B master + 8 B moments per local element
    assert before["optimizer"] - after["optimizer"] == pytest.approx(12 * local)
    assert after["host_offload"] == pytest.approx(18 * local) and "host_offload" not in before
    want = local * (6 / (PCIE_BANDWIDTH_GBPS * 1e9) + 1 / HOST_ADAMW_ELEMENTS_PER_S)
    got = step_time(m, off, cl, 8)
    assert got["offload_s"] == pytest.approx(want)
    assert got["step_time_s"] - step_time(m, lay, cl, 8)["step_time_s"] == pytest.approx(want)


def test_offload_with_hsdp(tmp_path):
    """HSDP (DP 4 as 2 instances of 2, ZeRO 3): f = 0.5 trains as without offload, the
    overflowed first step skipped."""
    hsdp = ["--num-distributed-optimizer-instances", "2"]
    runs = [flags(*FP16, *hsdp, *OFFLOAD[name], "--metrics-file", tmp_path / f"{name}.jsonl",
                  train_iters=3, zero_stage=3) for name in ("none", "f05")]
    run_distributed(pretrain_cases, 4, runs)
    ref, got = (read_metrics(tmp_path / f"{name}.jsonl") for name in ("none", "f05"))
    assert [r["skipped_iterations"] for r in got] == [1, 0, 0]
    assert [r["lm_loss"] for r in got] == pytest.approx([r["lm_loss"] for r in ref], rel=1e-6)
