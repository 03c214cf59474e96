"""The collective record and its verdict (docs/clusters.md, "When a run hangs"): a rank asleep in
its data loader, a rank that skipped a collective, a killed rank; each a real gloo run of
pretrain.main, the verdict read back by tools/hang_report.py."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import run_distributed
from pretrain_utils import ROOT, flags

from megalite import collective_record as R

TIMEOUT_MIN = 0.1  # --distributed-timeout-minutes: 6 s
HANG = ["--global-batch-size", "2", "--log-interval", "100", "--train-iters", "4",
        "--distributed-timeout-minutes", str(TIMEOUT_MIN)]


def _report(directory) -> str:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "hang_report.py"),
                          str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _main(rank, world, argv, at_sample=None, fault=None):
    """pretrain.main; ``fault(rank)`` runs on reading the data loader's ``at_sample``-th micro-
    batch (the start of iteration ``at_sample + 1``: one micro-batch per iteration)."""
    import megalite.data
    import pretrain

    real = megalite.data.build_data_loader

    def loader(*args, **kwargs):
        for i, sample in enumerate(real(*args, **kwargs)):
            if i == at_sample:
                fault(rank)
            yield sample

    megalite.data.build_data_loader = loader
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = pretrain.main(argv)
    return rc, out.getvalue(), err.getvalue(), time.time(), getattr(fault, "at", None)


def _sleep_on_rank_1(rank):
    _sleep_on_rank_1.at = time.time()  # when the ranks part
    if rank == 1:
        time.sleep(10)


def test_rank_asleep_in_its_data_loader_is_named(tmp_path):
    """TP2: rank 1 sleeps reading iteration 3's batch while rank 0 waits in the embedding's TP
    all-reduce: both exit within the timeout + 60 s, and the verdict names rank 1, the last
    collective it completed, and where rank 0 waits."""
    d = tmp_path / "rec"
    argv = flags(*HANG, tensor_model_parallel_size=2, collective_record_dir=d,
                 metrics_file=tmp_path / "m.jsonl")
    out = run_distributed(_main, 2, argv, 2, _sleep_on_rank_1, timeout=180)
    assert [o[0] for o in out] == [1, 1], out
    assert max(o[3] for o in out) - min(o[4] for o in out) < 60 * TIMEOUT_MIN + 60
    line = _report(d)
    recs = {r["rank"]: r for r in R.read(str(d))}
    waits = recs[0]["entries"][-1]
    assert waits["tag"] == "tp_all_reduce" and not waits["completed_at"], waits
    assert f"rank 0 waits in tp_all_reduce #{waits['seq']} (iteration 3, forward " in line, line
    done = [e for e in recs[1]["entries"] if e["seq"] < waits["seq"]][-1]
    assert f"rank 1 last completed {done['tag']}" in line and "issued nothing since" in line, line
    assert f"#{waits['seq'] - 1} (iteration 2" in line, line  # the step before, on both ranks
    assert "collective record: " in out[0][1] and "another rank died" in out[0][2]


def _skip_grad_norm(rank, world, argv):
    """Rank 3 leaves out iteration 2's grad-norm all-reduce over the model-parallel group."""
    from megalite import collectives as C

    real, calls = C.all_reduce, []

    def all_reduce(tensor, *args, tag="all_reduce", **kwargs):
        if tag == "grad_norm_all_reduce" and C.group_size(kwargs["group"]) == 4:
            calls.append(1)
            if rank == 3 and len(calls) == 2:
                return None
        return real(tensor, *args, tag=tag, **kwargs)

    C.all_reduce = all_reduce
    return _main(rank, world, argv)


def test_skipped_collective_names_first_difference(tmp_path):
    """PP2 x TP2: rank 3 skips iteration 2's grad-norm all-reduce and goes on to iteration 3's
    first receive; every rank times out, and the verdict names the sequence number where rank 3
    first differs from rank 2 (its stage's other rank) and both collectives."""
    d = tmp_path / "rec"
    argv = flags(*HANG, "--global-batch-size", "4", tensor_model_parallel_size=2,
                 pipeline_model_parallel_size=2, collective_record_dir=d,
                 metrics_file=tmp_path / "m.jsonl")
    out = run_distributed(_skip_grad_norm, 4, argv, timeout=180)
    assert [o[0] for o in out] == [1] * 4, out
    recs = {r["rank"]: r for r in R.read(str(d))}
    skipped = next(e for e in reversed(recs[2]["entries"]) if e["tag"] == "grad_norm_all_reduce")
    n = skipped["seq"]
    line = _report(d)
    assert line.startswith(f"ranks differ first at #{n}: rank 2 issued grad_norm_all_reduce "
                           f"#{n} (iteration 2, optimizer step) on ranks 0-3, rank 3 issued "
                           f"pp_p2p #{n} (iteration 3, p2p of F1.0) on ranks 1,3"), line
    assert line in out[0][1], out[0][1]  # rank 0 printed the same line


def _kill_rank_1(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def test_killed_rank_peers_write_records(tmp_path):
    """TP2: rank 1 is killed between steps; rank 0's next collective fails at once, it writes
    its record, and the report names rank 1 as the one that wrote none."""
    d = tmp_path / "rec"
    argv = flags(*HANG, tensor_model_parallel_size=2, collective_record_dir=d,
                 metrics_file=tmp_path / "m.jsonl")
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died"):
        run_distributed(_main, 2, argv, 2, _kill_rank_1, timeout=120)
    line = _report(d)
    assert line.startswith("rank 0 waits in tp_all_reduce #") and "(iteration 3, forward " in line
    assert "rank 1 wrote no record" in line and "the last collective it joined: " in line, line


# ----------------------------------------------------------------- the verdict, by hand
def _entry(seq, tag="tp_all_reduce", label="layer 1 forward", done=True, group=(0, 1, 2, 3)):
    return {"seq": seq, "kind": "all_reduce", "tag": tag, "group": list(group), "shape": [4],
            "dtype": "float32", "label": label, "issued_at": seq, "completed_at": seq + 0.5
            if done else 0.0}


def _rec(rank, entries, written_at=100.0, program="pipeline stage 0"):
    return {"rank": rank, "world_size": 4, "program": program, "written_at": written_at,
            "entries": entries}


def test_verdict_by_hand():
    late = _entry(8, done=False)
    late["issued_at"] = 150.0  # after the first rank gave up: left out
    recs = [_rec(r, [_entry(6), _entry(7, label="layer 2 forward", done=False)]) for r in (0, 2)]
    recs.append(_rec(1, [_entry(6), late], written_at=160.0))
    assert R.verdict(recs) == (
        "ranks 0,2 wait in tp_all_reduce #7 (layer 2 forward); rank 1 last completed "
        "tp_all_reduce #6 (layer 1 forward) and issued nothing since; rank 3 wrote no record "
        "(killed, or stuck where no signal reached it); the last collective it joined: "
        "tp_all_reduce #6 (layer 1 forward)")
    recs[2]["entries"] = [_entry(6), _entry(7, tag="dp_grad_all_reduce", done=False)]
    assert R.verdict(recs).startswith(
        "ranks differ first at #7: rank 0 issued tp_all_reduce #7 (layer 2 forward) on ranks "
        "0-3, rank 1 issued dp_grad_all_reduce #7 (layer 1 forward) on ranks 0-3")


def test_entries_carry_their_thread_s_labels(tmp_path):
    """An entry keeps the label stack of the thread that issued it (an F&B pair's two sides run
    on two threads); a synchronous call is completed when it returns, an async one never."""
    import threading

    import torch

    with R.label("iteration 1"):
        with R.label("layer 0"):
            slot = R.issue("all_reduce", "tp_all_reduce", (0, 1), torch.Size([4]), torch.float32)
        side = threading.Thread(target=lambda: R.complete(R.issue("p2p", "pp_p2p", (0, 1),
                                                                  async_op=True)))
        side.start()
        side.join()
    R.complete(slot)
    R.dump(str(tmp_path), 0, 2, "pipeline stage 0", "test")
    mine, theirs = R.read(str(tmp_path))[0]["entries"][-2:]
    assert (mine["label"], mine["shape"], mine["dtype"]) == ("iteration 1, layer 0", [4], "float32")
    assert mine["completed_at"] >= mine["issued_at"] > 0
    assert theirs["label"] == "" and theirs["completed_at"] is None
