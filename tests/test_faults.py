"""Faults a cluster run meets (docs/clusters.md, "Faults"): a failing save, durable saves,
preemption signals, a killed rank, a time limit, a diverging run."""

import contextlib
import errno
import io
import os
import signal
import subprocess
import sys
import time

from dist_utils import free_port, run_distributed
from pretrain_utils import PRETRAIN, ROOT, flags, read_metrics, run_main, train_losses

from megalite.checkpoint import format as ckpt_format
from megalite.checkpoint import save as ckpt_save


def _main_on_rank(rank, world, argv):
    import pretrain

    return pretrain.main(argv)


def _save_fails_on_rank(rank, world, argv, bad_rank, iteration):
    """pretrain.main on every rank; ``bad_rank``'s disk is full when it writes ``iteration``."""
    import pretrain

    fired = {}

    def hook(stage, path):
        if stage == "shard_written" and rank == bad_rank and f"iter_{iteration:07d}" in path:
            fired["t"] = time.time()
            raise OSError(errno.ENOSPC, "No space left on device", path)

    ckpt_save.fault_hook = hook
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = pretrain.main(argv)
    return rc, err.getvalue(), time.time()


def test_save_failing_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1 (of DP2) runs out of space saving iteration 4: both ranks exit at once with its
    error, no iter_4 is left, the tracker still names iteration 2, and a resume from it works."""
    ck = tmp_path / "ck"
    argv = [str(a) for a in flags(train_iters=4, save=ck, save_interval=2,
                                  distributed_timeout_minutes=1)]
    out = run_distributed(_save_fails_on_rank, 2, argv, 1, 4, timeout=240)
    for rank, (rc, err, t_end) in enumerate(out):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc != 0 and len(lines) == 1, (rank, err)
        assert "iteration 4 failed on rank 1" in lines[0] and "No space left" in lines[0], lines
    assert abs(out[0][2] - out[1][2]) < 20  # together, not rank 0 at the 60 s timeout
    assert not [n for n in os.listdir(ck) if n.startswith("iter_0000004")], os.listdir(ck)
    assert (ck / ckpt_format.TRACKER_FILE).read_text().strip() == "2"
    resumed = tmp_path / "resumed.jsonl"  # (the data-parallel size may change on a resume)
    assert run_main(flags(train_iters=4, save=ck, load=ck, metrics_file=resumed)) == 0
    assert sorted(train_losses(resumed)) == [3, 4]
    assert (ck / ckpt_format.TRACKER_FILE).read_text().strip() == "4"


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
            seen.append(ckpt_format.read_checkpoint_config(str(ck)).training.eval_iters)

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


TRACKER = ckpt_format.TRACKER_FILE


# ------------------------------------------------------------------ signals, SIGKILL, NaN, time
class Job:
    """pretrain.py as ``nproc`` ranks started directly (as srun would), output in files."""

    def __init__(self, tmp_path, name, argv, nproc=2):
        self.tag = f"megalite-fault-test-{os.getpid()}-{name}"
        self.out = [tmp_path / f"{name}.{r}.out" for r in range(nproc)]
        self.err = [tmp_path / f"{name}.{r}.err" for r in range(nproc)]
        port = free_port()
        self.procs = []
        for r in range(nproc):
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, RANK=str(r),
                       WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), MEGALITE_FAULT_TEST_TAG=self.tag)
            self.procs.append(subprocess.Popen(
                [sys.executable, PRETRAIN] + [str(a) for a in argv], cwd=ROOT, env=env,
                stdout=open(self.out[r], "w"), stderr=open(self.err[r], "w")))

    def wait_for(self, text, timeout=180):
        t0 = time.time()
        while text not in self.out[0].read_text():
            assert time.time() - t0 < timeout and self.procs[0].poll() is None, \
                f"never saw {text!r}: {self.err[0].read_text()[-2000:]}"
            time.sleep(0.05)

    def finish(self, timeout=180):
        try:
            for p in self.procs:
                p.wait(timeout=timeout)
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [p.returncode for p in self.procs]

    def alive(self):
        """Processes still carrying this job's tag (children included)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if self.tag.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
        return found


def _lines(path):
    return [ln for ln in path.read_text().splitlines() if ln.strip()]


FAULT_FLAGS = ("--hidden-dropout", "0.1", "--train-iters", "12", "--distributed-timeout-minutes",
               "0.2")


def test_sigterm_then_sigkill_then_resume_is_bit_identical(tmp_path):
    """Preempted (SIGTERM to rank 1, SIGINT to rank 0): both finish the iteration, save, exit 0.
    Resumed, then rank 1 SIGKILLed: rank 0 exits non-zero within the timeout, in one line, no
    process left. Resumed again from the last complete checkpoint: every iteration equals an
    uninterrupted run's, bit for bit."""
    ck = tmp_path / "ck"
    # the uninterrupted reference: the same pretrain.main on 2 ranks, in run_distributed's workers
    ref_argv = [str(a) for a in flags(*FAULT_FLAGS, metrics_file=tmp_path / "ref.jsonl")]
    assert run_distributed(_main_on_rank, 2, ref_argv, timeout=240) == [0, 0]
    ref_losses = train_losses(tmp_path / "ref.jsonl")

    a = Job(tmp_path, "a", flags(*FAULT_FLAGS, "--exit-signal-handler", save=ck,
                                 save_interval=100, metrics_file=tmp_path / "a.jsonl"))
    a.wait_for("iteration        2/")
    a.procs[1].send_signal(signal.SIGTERM)
    a.procs[0].send_signal(signal.SIGINT)
    assert a.finish() == [0, 0], a.err[0].read_text()[-2000:] + a.err[1].read_text()[-2000:]
    k = int((ck / ckpt_format.TRACKER_FILE).read_text())
    # the two signals may land on either side of an iteration's agreement: whichever the ranks
    # agreed on first is named
    out = a.out[0].read_text()
    assert 2 <= k < 8 and ("SIGTERM received" in out or "SIGINT received" in out), out[-1500:]
    assert max(train_losses(tmp_path / "a.jsonl")) == k  # stopped right after the iteration

    b = Job(tmp_path, "b", flags(*FAULT_FLAGS, save=ck, load=ck, save_interval=1,
                                 metrics_file=tmp_path / "b.jsonl"))
    b.wait_for(f"saved checkpoint {ck}/iter_{k + 2:07d}")
    b.procs[1].kill()
    # rank 0 notices on its own, by the 12 s distributed timeout (about 15 s on a quiet
    # machine); finish fails the test (TimeoutExpired) if it has not ended in 10x that
    rcs = b.finish(timeout=150)
    assert rcs[0] not in (0, None)
    err = _lines(b.err[0])
    assert len(err) == 1 and "another rank died or stopped responding" in err[0], err
    assert not b.alive() and not a.alive()
    j = int((ck / ckpt_format.TRACKER_FILE).read_text())
    assert j >= k + 2 and (ck / f"iter_{j:07d}" / "args.json").exists()

    c = Job(tmp_path, "c", flags(*FAULT_FLAGS, save=ck, load=ck, metrics_file=tmp_path / "c.jsonl"))
    assert c.finish() == [0, 0], c.err[0].read_text()[-2000:]
    got = {**train_losses(tmp_path / "b.jsonl"), **train_losses(tmp_path / "c.jsonl")}
    assert sorted(got) == list(range(k + 1, 13))
    for it in got:
        assert got[it] == ref_losses[it], (it, got[it], ref_losses[it])


def test_exit_duration_saves_and_exits_zero(tmp_path):
    ck = tmp_path / "ck"
    assert run_main(flags("--exit-duration-in-mins", "0.0001", train_iters=50, save=ck)) == 0
    assert (ck / ckpt_format.TRACKER_FILE).read_text().strip() == "1"


def test_nan_stops_before_the_step_and_any_save_fp16_skips(tmp_path, capsys):
    """fp32 diverging (lr 1e30) on 2 ranks, saving every iteration: every rank names the
    iteration and exits non-zero before its save, so the last checkpoint is the one before. bf16,
    logging every 3rd iteration and saving every 4th: the step that went NaN is skipped on the
    device and the host learns of it at the next log line, which names it and stops the run
    there, before any save. fp16 instead keeps skipping steps and lowering the loss scale."""
    ck = tmp_path / "ck"
    boom = ("--lr", "1e30", "--min-lr", "0", "--lr-warmup-iters", "0", "--clip-grad", "0",
            "--train-iters", "6")
    job = Job(tmp_path, "fp32", flags(*boom, save=ck, save_interval=1))
    rcs = job.finish()
    errs = [_lines(e) for e in job.err]
    assert all(rc == 1 for rc in rcs) and all(len(e) == 1 for e in errs), errs
    bad = int(errs[0][0].split("at iteration ")[1].split()[0])
    assert "optimizer step skipped" in errs[0][0] and errs[0] == errs[1]
    assert (ck / ckpt_format.TRACKER_FILE).read_text().strip() == str(bad - 1)
    assert not [n for n in os.listdir(ck) if n.startswith(f"iter_{bad:07d}")]
    # bf16, one process: iteration 2 is the first NaN; 3 still runs (its memory line, printed
    # during the step), its log line reads the records and stops; the save at 4 never comes
    ck16 = tmp_path / "ck_bf16"
    capsys.readouterr()
    assert run_main(flags(*boom, "--bf16", "--log-memory-peak", log_interval=3, save=ck16,
                          save_interval=4,
                          metrics_file=tmp_path / "bf16.jsonl")) == 1
    out, err = capsys.readouterr()
    assert "loss nan at iteration 2 in bfloat16, its optimizer step skipped" in err, err
    assert "memory at iteration 3" in out and "iteration        3/" not in out, out
    assert not [n for n in os.listdir(ck16) if n.startswith("iter_")]
    assert not (ck16 / ckpt_format.TRACKER_FILE).exists()
    # --async-save, the save (iteration 3) before any log line: the pending NaN of iteration 2 is
    # read before the snapshot is taken, so nothing is snapshotted, written or published
    cka = tmp_path / "ck_async"
    assert run_main(flags(*boom, "--bf16", "--async-save", log_interval=5, save=cka,
                          save_interval=3)) == 1
    out, err = capsys.readouterr()
    assert "loss nan at iteration 2 in bfloat16, its optimizer step skipped" in err, err
    assert not [n for n in os.listdir(cka) if n.startswith("iter_")]
    assert not (cka / ckpt_format.TRACKER_FILE).exists()
    # fp16 (one process: the overflow flag's agreement over ranks is the fp32 path's reduction)
    assert run_main(flags(*boom, "--fp16", metrics_file=tmp_path / "fp16.jsonl")) == 0
    recs = read_metrics(tmp_path / "fp16.jsonl")
    assert sum(r["skipped_iterations"] for r in recs) >= 3
    assert recs[-1]["loss_scale"] < recs[0]["loss_scale"]
