"""Loads that prove themselves (docs/checkpoints.md): a save records the probe loss and the
optimizer state's norms; a load recomputes them at its own layout and refuses, in one line, a
state that is not the one saved. Real pretrain.py runs on 2 gloo ranks, in strict mode."""

import shutil

import torch

from megalite.checkpoint.convert import reshard
from megalite.checkpoint.layout import Layout
from pretrain_utils import flags, run_cli, train_losses

ZERO1 = ("--zero-stage", "1")


def _error_lines(proc):
    return [line for line in proc.stderr.splitlines() if "error:" in line]


def _refusal(proc) -> str:
    """The one line a refused load prints (each rank prints the same one)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = set(_error_lines(proc))
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines.pop()


def test_a_stale_zero1_shard_is_refused(tmp_path):
    """DP 2 ZeRO 1, saved in the background at iterations 2 and 4. A resume at TP 2 (resharded
    on load) passes the check; once rank 0's optimizer file of iteration 4 is its file of
    iteration 2, the load is refused, naming a parameter's master. Without the check the same
    checkpoint loads without a word and trains on with other losses."""
    ck = tmp_path / "ck"
    proc = run_cli(flags(*ZERO1, "--async-save", train_iters=4, save_interval=2, save=ck), 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = torch.load(ck / "iter_0000004" / "verify.pt", weights_only=True)
    assert record["iteration"] == 4 and record["optimizer"] and record["probe_loss"] > 0
    assert record["layout"] == "tp=1 pp=1 cp=1 dp=2 ep=1 etp=1 zero=1 float32"

    good = tmp_path / "good.jsonl"
    proc = run_cli(flags("--tensor-model-parallel-size", 2, *ZERO1, train_iters=5, load=ck,
                         metrics_file=good), 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resharded on load" in proc.stdout and "verified the load" in proc.stdout

    shard = ck / "iter_0000004" / "mp_rank_00_000"
    shutil.copyfile(ck / "iter_0000002" / "mp_rank_00_000" / "distrib_optim_dp000.pt",
                    shard / "distrib_optim_dp000.pt")
    line = _refusal(run_cli(flags(*ZERO1, train_iters=5, load=ck), 2))
    assert f"--load {ck}: iteration 4 does not load as saved: the norm of " in line, line
    assert "'s master is " in line and ", saved " in line, line
    assert "(saved at tp=1 pp=1 cp=1 dp=2 ep=1 etp=1 zero=1 float32; this run: tp=1 pp=1 cp=1 " \
        "dp=2 ep=1 etp=1 zero=1 float32); pass --no-verify-load" in line, line

    stale = tmp_path / "stale.jsonl"
    proc = run_cli(flags(*ZERO1, "--no-verify-load", train_iters=5, load=ck,
                         metrics_file=stale), 2)
    assert proc.returncode == 0 and not _error_lines(proc), proc.stderr[-3000:]
    assert "verified" not in proc.stdout
    ok, bad = train_losses(good)[5], train_losses(stale)[5]
    assert abs(bad - ok) > 1e-4 * abs(ok), (bad, ok)  # what the check keeps from happening


def test_a_perturbed_model_file_is_refused_at_zero0(tmp_path):
    """TP 2, ZeRO 0: a clean resume passes; one tensor of the model file scaled by 1 + 1e-3 is
    refused naming it (an fp32 model's weights are its masters); --no-verify-load loads it."""
    ck = tmp_path / "ck"
    tp2 = ("--tensor-model-parallel-size", 2, "--max-position-embeddings", 16)
    proc = run_cli(flags(*tp2, train_iters=3, exit_interval=2, save=ck), 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(flags(*tp2, train_iters=3, load=ck), 2)
    assert proc.returncode == 0 and "verified the load" in proc.stdout, proc.stderr[-3000:]
    # another sequence length makes another probe: the norms are still compared, the loss not
    proc = run_cli(flags(*tp2, "--seq-length", 8, train_iters=3, load=ck), 2)
    assert proc.returncode == 0 and "verified the load" in proc.stdout, proc.stderr[-3000:]
    # the offline resharder carries the record as it is (test_reshard_load.py loads such copies)
    reshard(str(ck), str(tmp_path / "tp1"), Layout(1, 1))
    record = "iter_0000002/verify.pt"
    assert (tmp_path / "tp1" / record).read_bytes() == (ck / record).read_bytes()

    path = ck / "iter_0000002" / "mp_rank_01_000" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    name = "layers.1.mlp.linear_fc1.weight"
    state["model"][name].mul_(1 + 1e-3)
    torch.save(state, path)
    line = _refusal(run_cli(flags(*tp2, train_iters=3, load=ck), 2))
    assert f"the norm of {name}'s master is " in line, line

    proc = run_cli(flags(*tp2, "--no-verify-load", train_iters=3, load=ck), 2)
    assert proc.returncode == 0 and "loaded checkpoint" in proc.stdout, proc.stderr[-3000:]
    assert "verified" not in proc.stdout
