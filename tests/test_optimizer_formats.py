"""Optimizer-state files of older megalite versions still load (docs/checkpoints.md, "Optimizer
state files").

tests/fixtures/optimizer_v1/ holds a ZeRO-1 and a ZeRO-3 checkpoint (2 data-parallel ranks, one
iteration) written by megalite at commit a34d593 in the v1 formats
(tests/fixtures/make_optimizer_v1.py). Decoded here by hand, they must equal what today's merge
reads from them, and a run resumed from them must continue with the saving run's loss.
"""

import json
import math
import os
import shutil

import pytest
import torch
from pretrain_utils import read_metrics, run_main

from megalite.checkpoint.optim_state import merge_shard_state_dicts

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "optimizer_v1")
V1_KINDS = {"zero1": ("master", "exp_avg", "exp_avg_sq"),
            "zero3": ("main", "exp_avg", "exp_avg_sq")}


def _files(name):
    shard = os.path.join(FIXTURES, name, "iter_0000001", "mp_rank_00_000")
    return [torch.load(os.path.join(shard, f"distrib_optim_dp{d:03d}.pt"), weights_only=True)
            for d in range(2)]


def _decode_v1(name, files):
    """{parameter: [master, exp_avg, exp_avg_sq] flattened} from the v1 files, element by element
    as their writers laid them out."""
    out = {}
    for sd in files:
        if name == "zero1":  # segments [name, lo, hi, param lo, param hi, shape] of each shard
            for shard in sd["shards"]:
                for pname, lo, hi, plo, phi, shape in shard["segments"]:
                    flat = out.setdefault(pname, [torch.full((math.prod(shape),), math.nan)
                                                  for _ in range(3)])
                    for f, key in zip(flat, V1_KINDS[name]):
                        f[plo:phi] = shard[key][lo:hi]
        else:  # each unit: the parameters end to end, DP rank r holding elements [r*S, (r+1)*S)
            for unit in sd["units"].values():
                size = unit["main"].numel()
                full = [torch.full((size * sd["dp_size"],), math.nan) for _ in range(3)]
                for f, key in zip(full, V1_KINDS[name]):
                    f[sd["dp_rank"] * size:(sd["dp_rank"] + 1) * size] = unit[key]
                off = 0
                for pname, shape in zip(unit["names"], unit["shapes"]):
                    n = math.prod(shape)
                    flat = out.setdefault(pname, [torch.full((n,), math.nan) for _ in range(3)])
                    for f, g in zip(flat, full):
                        mine = ~torch.isnan(g[off:off + n])
                        f[mine] = g[off:off + n][mine]
                    off += n
    return out


@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_v1_optimizer_files_merge_to_their_state(name):
    files = _files(name)
    expect = _decode_v1(name, files)
    full = merge_shard_state_dicts(files)
    assert full["step"] == 1 and set(full["params"]) == set(expect)
    for pname, flats in expect.items():
        got = full["params"][pname]
        for kind, want in zip(("master", "exp_avg", "exp_avg_sq"), flats):
            assert not torch.isnan(want).any(), (pname, kind)
            assert torch.equal(got[kind].reshape(-1), want), (pname, kind)
    assert any(f[1].abs().sum() > 0 for f in expect.values())  # moments were stepped


@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_v1_checkpoint_resumes_with_the_saving_runs_loss(tmp_path, name):
    ck = tmp_path / "ck"
    shutil.copytree(os.path.join(FIXTURES, name), ck)
    with open(ck / "loss.json") as f:
        saved = json.load(f)
    metrics = tmp_path / "m.jsonl"  # one data-parallel rank: every file is merged and re-split
    assert run_main(saved["flags"] + ["--load", str(ck), "--metrics-file", str(metrics)]) == 0
    (rec,) = read_metrics(str(metrics))
    assert rec["iteration"] == 2
    assert abs(rec["lm_loss"] - saved["iteration_2_loss"]) <= 1e-5 * saved["iteration_2_loss"]
