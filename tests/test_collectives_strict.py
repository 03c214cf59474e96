"""Collectives are NCCL-safe by construction (docs/clusters.md, "Which collectives run where").

On NCCL a collective on a CPU tensor raises, and the CPU suite cannot see that by itself: on CPU
every tensor is a CPU tensor. Strict mode (strict_collectives.py, under which every multi-rank
pretrain.py run of the suite runs, see pretrain_utils.run_cli) emulates a GPU on CPU and fails a
collective handed a tensor its path does not serve; these tests check the emulation itself, the
host-path sites, a pretrain layout the other suites do not run, and that nothing bypasses the
wrappers.
"""

import os
import re

import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import ROOT, flags, run_cli, train_losses

import strict_collectives as S
from megalite import collectives as C

RAW = re.compile(r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather\w*|reduce_scatter\w*|"
                 r"broadcast\w*|barrier|monitored_barrier|send|recv|isend|irecv|batch_isend_irecv|"
                 r"reduce|gather\w*|scatter\w*|all_to_all\w*)\(")
# The one deliberate exception: a 1-rank NCCL smoke test, where the wrappers would be no-ops.
ALLOWED = {"benchmarks/gpu_check.py": "nccl 1-rank smoke test"}


def test_no_collective_bypasses_the_wrappers():
    found = []
    for top in ("megalite", "tools", "benchmarks", "pretrain.py"):
        base = os.path.join(ROOT, top)
        paths = [base] if base.endswith(".py") else [
            os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs if f.endswith(".py")]
        for path in paths:
            rel = os.path.relpath(path, ROOT)
            if rel == "megalite/collectives.py" or rel in ALLOWED:
                continue
            for n, line in enumerate(open(path), 1):
                if RAW.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "raw torch.distributed collectives (use megalite.collectives):\n" + \
        "\n".join(found)


def test_emulated_device_tracks_where_tensors_would_live(monkeypatch):
    dev = S.COMPUTE
    monkeypatch.setitem(S._STATE, "device", dev)
    monkeypatch.setattr(C, "_STRICT", S)
    with S.EmulatedDevice() as mode:
        monkeypatch.setitem(S._STATE, "emulated", mode)
        host = torch.zeros(2)
        onto = torch.zeros(2, device=dev)
        assert host.device == C.HOST and onto.device == dev
        assert (host + 1).device == C.HOST and (host + onto).device == dev
        like = torch.ones(3, device=onto.device)  # another tensor's .device is its device
        assert like.device == dev and torch.zeros_like(host).device == C.HOST
        moved = host.to(dev)
        assert moved.device == dev and host.device == C.HOST  # a copy, as on a GPU
        assert onto.cpu().device == C.HOST and onto.device == dev
        assert torch.tensor([1.0], device="cpu").device == C.HOST
        C._check("t", onto, None, host=False)
        C._check("t", host, None, host=True)
        with pytest.raises(S.CollectiveDeviceError, match="device path .* got a tensor on cpu"):
            C._check("grad_norm", host, None, host=False)
        with pytest.raises(S.CollectiveDeviceError, match="host path"):
            C._check("flag", onto, None, host=True)


def _host_sites(rank, world):
    """The control messages of a run pass strict mode; a host tensor on a device group fails."""
    S.enable()
    from megalite.checkpoint import save as ckpt_save
    from megalite.checkpoint import load as ckpt_load
    from megalite.optimizer.grad_scaler import found_inf_flag
    from megalite.parallel_state import initialize_model_parallel

    ps = initialize_model_parallel(1, 1, timeout_minutes=1)
    assert ps.device == S.COMPUTE
    run_id = ckpt_save.new_run_id(ps)
    ckpt_load.agree_on_errors(ps, None)
    # a rank with no local gradients still contributes a device flag
    assert found_inf_flag([], ps.device).item() == 0
    assert found_inf_flag([torch.full((2,), float("inf"), device=ps.device)] if rank else [],
                          ps.device).item() > 0
    try:
        C.all_reduce(torch.zeros(1), group=ps.dp_group, tag="bad")
    except S.CollectiveDeviceError as e:
        bad = str(e)
    else:
        bad = None
    return run_id, bad


def test_host_path_sites_pass_strict_mode():
    (a, bad), (b, _) = run_distributed(_host_sites, 2, timeout=120)
    assert a == b
    assert bad is not None and "bad on the device path" in bad


def test_strict_tp_pp_sp_fp16_pretrain(tmp_path):
    """TP x PP with sequence parallelism and the fp16 loss scaler (each rank's found-inf flag over
    the world), checkpoint save and load: every collective on the path its group serves.
    The other layouts run strict in their own suites (DP, ZeRO 1/2/3, PP x ZeRO-3)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    argv = flags("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--sequence-parallel", "--fp16", "--initial-loss-scale", "256", train_iters=3,
                 save=ck, load=ck, metrics_file=tmp_path / "m.jsonl")
    proc = run_cli(argv, nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(train_losses(tmp_path / "m.jsonl")) == [1, 2, 3]
    assert "device cpu:0" in proc.stdout  # the emulated GPU was on
