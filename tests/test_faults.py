"""Faults a cluster run meets (docs/clusters.md, "Faults"): a failing save, durable saves."""

import contextlib
import errno
import io
import os
import time

from dist_utils import run_distributed
from pretrain_utils import flags, run_main, train_losses

from megalite import checkpointing


def _save_fails_on_rank(rank, world, argv, bad_rank, iteration):
    """pretrain.main on every rank; ``bad_rank``'s disk is full when it writes ``iteration``."""
    import pretrain

    fired = {}

    def hook(stage, path):
        if stage == "shard_written" and rank == bad_rank and f"iter_{iteration:07d}" in path:
            fired["t"] = time.time()
            raise OSError(errno.ENOSPC, "No space left on device", path)

    checkpointing.fault_hook = hook
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = pretrain.main(argv)
    return rc, err.getvalue(), time.time()


def test_save_failing_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1 (of TP2) runs out of space saving iteration 4: both ranks exit at once with its
    error, no iter_4 is left, the tracker still names iteration 2, and a resume from it works."""
    ck = tmp_path / "ck"
    argv = [str(a) for a in flags("--tensor-model-parallel-size", "2", train_iters=4, save=ck,
                                  save_interval=2, distributed_timeout_minutes=1)]
    out = run_distributed(_save_fails_on_rank, 2, argv, 1, 4, timeout=240)
    for rank, (rc, err, t_end) in enumerate(out):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc != 0 and len(lines) == 1, (rank, err)
        assert "iteration 4 failed on rank 1" in lines[0] and "No space left" in lines[0], lines
    assert abs(out[0][2] - out[1][2]) < 20  # together, not rank 0 at the 60 s timeout
    assert not [n for n in os.listdir(ck) if n.startswith("iter_0000004")], os.listdir(ck)
    assert (ck / checkpointing.TRACKER_FILE).read_text().strip() == "2"
    resumed = tmp_path / "resumed.jsonl"
    argv = [str(a) for a in flags("--tensor-model-parallel-size", "2", train_iters=4, save=ck,
                                  load=ck, metrics_file=resumed)]
    out = run_distributed(_save_fails_on_rank, 2, argv, -1, 4, timeout=240)
    assert [rc for rc, _, _ in out] == [0, 0], out
    assert sorted(train_losses(resumed)) == [3, 4]
    assert (ck / checkpointing.TRACKER_FILE).read_text().strip() == "4"


def test_saves_are_durable_and_resaves_never_unloadable(tmp_path, monkeypatch):
    """Files and directories are fsynced before the tracker is replaced; re-saving an existing
    iteration leaves a loadable copy after every rename; an identical tokenizer is kept."""
    ck = tmp_path / "ck"
    assert run_main(flags(train_iters=2, save=ck)) == 0
    events, seen = [], []
    real_rename, real_replace, real_fsync = os.rename, os.replace, os.fsync

    def rename(a, b):
        real_rename(a, b)
        if "iter_0000002" in str(a):  # after each step of the swap some copy of it loads
            seen.append(checkpointing.read_checkpoint_config(str(ck)).training.eval_iters)

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))),
                                                     real_replace(a, b))[1])
    monkeypatch.setattr(os, "fsync", fsync)
    tokenizer_inode = os.stat(ck / "tokenizer").st_ino
    # resume at iteration 2 of 2: the run ends at once and saves iteration 2 again
    assert run_main(flags(train_iters=2, save=ck, load=ck, eval_iters=2)) == 0
    monkeypatch.undo()
    assert seen == [1, 2], seen  # the old copy, then the new one
    tracker = [i for i, e in enumerate(events) if e == ("replace", str(ck / TRACKER))]
    assert len(tracker) == 1
    before = {path for kind, path in events[:tracker[0]] if kind == "fsync"}
    tmp = [p for p in before if os.path.basename(p).startswith("iter_0000002.tmp-")]
    assert tmp and str(ck) in before, before
    for name in ("mp_rank_00_000/model_optim_rng.pt", "args.json", "mp_rank_00_000"):
        assert os.path.join(tmp[0], name) in before, name
    assert events[tracker[0] + 1][0] == "fsync"  # and the directory entry of the tracker
    assert os.stat(ck / "tokenizer").st_ino == tokenizer_inode  # identical: kept in place
    assert not [n for n in os.listdir(ck) if ".old-" in n or ".tmp-" in n]


TRACKER = checkpointing.TRACKER_FILE
