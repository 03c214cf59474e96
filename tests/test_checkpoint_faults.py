"""A damaged or missing checkpoint file on one rank stops every rank at once, naming the file
(docs/checkpoints.md, "Loading and saving agree before any collective").

For every optimizer path (ZeRO 0, 1, 2, 3) and layout (DP 2, TP 2 x DP 2, PP 2 x DP 2) one run
saves a checkpoint; then the file only the last rank reads (its ZeRO shard, or at ZeRO 0 its
model file) is truncated, and in a second resume deleted. Each resume runs with a 30-minute
collective timeout: every rank must exit non-zero within seconds, and a rank's line names the
file. The ranks stay up between the three runs (one process group), so a case costs one start-up.
"""

import contextlib
import io
import os
import shutil
import time

import pytest
import torch.distributed as dist
from dist_utils import run_distributed
from pretrain_utils import flags

from megalite.checkpoint import format as ckpt_format
from megalite.checkpoint import save as ckpt_save

LAYOUTS = {"dp2": (2, []), "tp2dp2": (4, ["--tensor-model-parallel-size", "2"]),
           "pp2dp2": (4, ["--pipeline-model-parallel-size", "2"])}
ZERO = {0: [], 1: ["--use-distributed-optimizer"], 2: ["--zero-stage", "2"],
        3: ["--zero-stage", "3"]}
PROMPT_S = 60  # quiet machine: ~3 s; the collective timeout is 30 minutes


def _resume_twice(rank, world, save_argv, load_argv, victim):
    """Save once, then resume with ``victim`` truncated, then with it deleted (rank 0 edits)."""
    import megalite.parallel_state as mp_state
    import pretrain

    # keep the group of run_distributed across the three runs instead of a new rendezvous each
    mp_state.destroy_model_parallel = lambda: mp_state.set_parallel_state(mp_state.ParallelState())
    assert pretrain.main(save_argv) == 0
    out = []
    for damage in ("truncated", "missing"):
        if rank == 0:
            if damage == "truncated":
                shutil.copy(victim, victim + ".orig")
                with open(victim, "r+b") as f:
                    f.truncate(os.path.getsize(victim) // 2)
            else:
                os.replace(victim + ".orig", victim)
                os.remove(victim)
        dist.barrier()
        err = io.StringIO()
        t0 = time.time()
        with contextlib.redirect_stderr(err):
            rc = pretrain.main(load_argv)
        out.append((damage, rc, err.getvalue(), time.time() - t0))
        dist.barrier()
    return out


@pytest.mark.parametrize("zero", sorted(ZERO))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_damaged_or_missing_file_stops_every_rank_promptly(tmp_path, layout, zero):
    nproc, par = LAYOUTS[layout]
    ck = tmp_path / "ck"
    common = par + ZERO[zero] + ["--distributed-timeout-minutes", "30"]
    save = flags(*common, train_iters=1, save=ck, save_interval=1)
    load = flags(*common, train_iters=2, load=ck)
    last = ckpt_format.shard_dir_name(1 if "tp2" in layout else 0, 1 if "pp2" in layout else 0)
    name = ckpt_format.MODEL_FILE if zero == 0 else ckpt_format.distrib_optim_name(1)
    victim = str(ck / "iter_0000001" / last / name)
    results = run_distributed(_resume_twice, nproc, save, load, victim, timeout=240)
    for damage in ("truncated", "missing"):
        runs = [r for per_rank in results for r in per_rank if r[0] == damage]
        assert all(rc != 0 for _, rc, _, _ in runs), (damage, runs)
        assert max(t for *_, t in runs) < PROMPT_S, (damage, [t for *_, t in runs])
        lines = [ln for _, _, err, _ in runs for ln in err.splitlines()]
        assert any(victim in ln for ln in lines), (damage, lines)
        if damage == "truncated":
            assert any("corrupt or truncated" in ln for ln in lines), lines
        else:
            assert any("missing" in ln for ln in lines), lines


def _save_out_of_memory_on_rank1(rank, world, argv):
    """pretrain.main; on rank 1 every floating-point device allocation of the checkpoint save
    fails (OOM); torch's own byte buffers (all_gather_object's) are spared."""
    import torch

    import pretrain

    real_empty, real_save = torch.empty, ckpt_save.save_checkpoint
    saving = {}

    def empty(*args, **kwargs):
        if (saving.get("on") and "device" in kwargs
                and kwargs.get("dtype", torch.float32).is_floating_point):
            raise torch.OutOfMemoryError("out of memory (injected)")
        return real_empty(*args, **kwargs)

    def save(*args, **kwargs):
        saving["on"] = rank == 1
        try:
            return real_save(*args, **kwargs)
        finally:
            saving.clear()

    torch.empty, ckpt_save.save_checkpoint = empty, save
    err = io.StringIO()
    t0 = time.time()
    try:
        with contextlib.redirect_stderr(err):
            rc = pretrain.main(argv)
    finally:
        torch.empty, ckpt_save.save_checkpoint = real_empty, real_save
    return rc, err.getvalue(), time.time() - t0


def test_zero3_gather_out_of_memory_on_one_rank_stops_every_rank(tmp_path):
    """The ZeRO-3 save gathers the model unit by unit; a rank that cannot allocate stops every
    rank with its own error, not the peers at the collective timeout."""
    argv = flags("--zero-stage", "3", "--distributed-timeout-minutes", "30", train_iters=1,
                 save=tmp_path / "ck", save_interval=1)
    out = run_distributed(_save_out_of_memory_on_rank1, 2, argv, timeout=240)
    for rc, err, t in out:
        assert rc != 0 and t < PROMPT_S, (rc, t, err)
    lines = [ln for _, err, _ in out for ln in err.splitlines()]
    assert any("failed on rank 1" in ln and "out of memory" in ln for ln in lines), lines
    assert not os.path.exists(tmp_path / "ck" / ckpt_format.TRACKER_FILE)
