"""--async-save is as safe as a synchronous save, and every save writes the same bytes
(docs/checkpoints.md, "Asynchronous saves" and "Same seed, same bytes").

Real pretrain.py runs on DP 2 with ZeRO 1 (both ranks write a file). Not in strict mode: its GPU
emulation marks host tensors with an attribute, which torch.save would write into the files
compared here (the SIGKILLed run, whose files are only loaded, runs under it). Faults
come through ``megalite.checkpoint.save.fault_hook``, called by the background writer before each file
(``write_file``) and after a rank's files (``shard_written``), and by rank 0 before publishing
(``before_rename``). One process group runs the runs that leave it intact; a rank SIGKILLed in
the middle of a background write takes its own group down with it.
"""

import contextlib
import errno
import io
import os
import signal
import threading
import time

import pytest
import torch
from dist_utils import run_distributed
from pretrain_utils import flags, read_metrics, run_main, train_losses

from megalite.checkpoint import format as ckpt_format
from megalite.checkpoint import save as ckpt_save
from megalite.checkpoint.snapshot import HostBuffers, snapshot
from megalite.exit_conditions import ExitConditions

COMMON = ["--use-distributed-optimizer", "--distributed-timeout-minutes", "1"]
ITERS = 4


def _pt_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
                  for f in fs if f.endswith(".pt"))


def _same_files(a, b, names):
    for n in names:
        with open(os.path.join(a, n), "rb") as fa, open(os.path.join(b, n), "rb") as fb:
            assert fa.read() == fb.read(), f"{n} differs between {a} and {b}"


def _argv(ck, metrics, *extra, **kw):
    """``metrics`` None: metrics.jsonl in ``ck`` (args.json records the flag)."""
    kw.setdefault("train_iters", ITERS)
    if metrics is not None:
        kw["metrics_file"] = metrics
    return [str(a) for a in flags(*COMMON, *extra, save=ck, **kw)]


def _main(argv, hook=None):
    import pretrain

    ckpt_save.fault_hook = hook
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = pretrain.main(argv)
    finally:
        ckpt_save.fault_hook = None
    return rc, err.getvalue()


def _killed_while_writing(rank, world, root):
    """Rank 1 is SIGKILLed by its background writer as it begins iteration 4's files. In strict
    mode (GPU emulation: the agreements are host-path messages); its files are loaded, not
    compared."""
    import strict_collectives

    strict_collectives.enable()

    def hook(stage, path):
        if stage == "write_file" and rank == 1 and "iter_0000004" in path:
            os.kill(os.getpid(), signal.SIGKILL)

    _main(_argv(f"{root}/killed", f"{root}/killed.jsonl", "--async-save", save_interval=2),
          hook)


def _session(rank, world, root):
    """Every run that keeps the process group, one after another in the same two processes."""
    import megalite.parallel_state as mp_state
    import torch.distributed as dist

    # keep run_distributed's group across the runs instead of a new rendezvous each
    mp_state.destroy_model_parallel = lambda: mp_state.set_parallel_state(mp_state.ParallelState())
    out = {}

    def run(name, argv, hook=None):
        out[name] = _main(argv, hook)
        dist.barrier()

    # the reference, twice with the same flags (the first copy moved aside by rank 0)
    run("sync", _argv(f"{root}/sync", None, save_interval=2))
    if rank == 0:
        os.rename(f"{root}/sync", f"{root}/sync_first")
    dist.barrier()
    run("sync_again", _argv(f"{root}/sync", None, save_interval=2))

    # back to back: a save every iteration; every write and publish stamped
    events = []
    run("back_to_back", _argv(f"{root}/b2b", f"{root}/b2b.jsonl", "--async-save",
                              save_interval=1),
        lambda stage, path: events.append((stage, path, time.time())))
    out["events"] = events

    # the SIGKILLed run's previous checkpoint resumes
    run("after_kill", _argv(f"{root}/killed", f"{root}/after_kill.jsonl", save_interval=2,
                            load=f"{root}/killed"))

    # rank 1's disk is full as it writes its ZeRO shard of iteration 2
    def full_disk(stage, path):
        if stage == "write_file" and rank == 1 and "iter_0000002" in path \
                and path.endswith(ckpt_format.distrib_optim_name(1)):
            raise OSError(errno.ENOSPC, "No space left on device")

    run("full_disk", _argv(f"{root}/full", f"{root}/full.jsonl", "--async-save",
                           save_interval=1), full_disk)

    # SIGTERM while iteration 2 is being written in the background; then resume. The writer
    # holds its write until the training thread has run the signal handler (an event set by the
    # handler, wrapped here), so the signal is seen while the write is going on.
    handled = threading.Event()
    on_signal = ExitConditions._on_signal

    def on_signal_seen(self, signum, frame):
        on_signal(self, signum, frame)
        handled.set()

    def sigterm(stage, path):
        if stage == "write_file" and rank == 0 and "iter_0000002" in path:
            os.kill(os.getpid(), signal.SIGTERM)
            assert handled.wait(timeout=120), "the training thread never ran the handler"

    ExitConditions._on_signal = on_signal_seen
    try:
        run("sigterm", _argv(f"{root}/term", f"{root}/term.jsonl", "--async-save",
                             "--exit-signal-handler", save_interval=2), sigterm)
    finally:
        ExitConditions._on_signal = on_signal
    out["term_tracker"] = open(f"{root}/term/{ckpt_format.TRACKER_FILE}").read()
    dist.barrier()
    run("after_term", _argv(f"{root}/term", f"{root}/after_term.jsonl", "--async-save",
                            save_interval=2, load=f"{root}/term"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("async_save"))
    with pytest.raises((AssertionError, RuntimeError)):  # a rank died: its peer cannot go on
        run_distributed(_killed_while_writing, 2, root, timeout=240)
    killed = {"tracker": open(f"{root}/killed/{ckpt_format.TRACKER_FILE}").read(),
              "dirs": sorted(os.listdir(f"{root}/killed"))}
    return root, killed, run_distributed(_session, 2, root, timeout=300)


def test_same_flags_same_bytes_and_async_writes_sync_bytes(runs):
    root, _, out = runs
    assert all(o["sync"] == (0, "") and o["sync_again"] == (0, "") for o in out)
    first, again = f"{root}/sync_first", f"{root}/sync"
    names = _pt_files(first)
    assert len(names) == 2 * 4, names  # 2 saves x (model file + 2 ZeRO shards + verify.pt)
    assert _pt_files(again) == names
    _same_files(first, again, names + ["iter_0000002/args.json", "iter_0000004/args.json"])
    assert all(o["back_to_back"] == (0, "") for o in out)
    _same_files(first, f"{root}/b2b", names)  # async at iterations 2 and 4 = sync's bytes
    assert train_losses(f"{root}/b2b.jsonl") == train_losses(f"{root}/sync/metrics.jsonl")


def test_back_to_back_saves_never_overlap(runs):
    """--save-interval 1: iteration k's files are all written on both ranks and published by
    rank 0 before any rank starts writing iteration k + 1's."""
    root, _, out = runs
    spans = {}  # iteration -> [first write, last write done, publish]
    for stage, path, t in (e for o in out for e in o["events"]):
        it = int(path.split("iter_")[1][:7])
        s = spans.setdefault(it, [float("inf"), 0.0, None])
        if stage == "write_file":
            s[0] = min(s[0], t)
        elif stage == "shard_written":
            s[1] = max(s[1], t)
        elif stage == "before_rename":
            s[2] = t
    assert sorted(spans) == list(range(1, ITERS + 1)), spans
    for k in range(1, ITERS + 1):
        start, written, published = spans[k]
        assert start <= written <= published, (k, spans[k])
        if k < ITERS:
            assert published <= spans[k + 1][0], (k, spans)
    assert open(f"{root}/b2b/{ckpt_format.TRACKER_FILE}").read() == str(ITERS)
    checkpoints = [r for r in read_metrics(f"{root}/b2b.jsonl", "checkpoint")]
    assert [r["iteration"] for r in checkpoints] == list(range(1, ITERS + 1))
    assert all(r["published_iteration"] >= r["iteration"] for r in checkpoints)


def test_sigkill_during_background_write_keeps_previous_checkpoint(runs):
    root, killed, out = runs
    assert killed["tracker"] == "2"
    assert "iter_0000004" not in killed["dirs"], killed["dirs"]  # (only its .tmp- directory)
    assert all(o["after_kill"] == (0, "") for o in out)
    losses = train_losses(f"{root}/after_kill.jsonl")
    ref = train_losses(f"{root}/sync/metrics.jsonl")
    assert sorted(losses) == [3, 4] and all(losses[i] == ref[i] for i in (3, 4)), (losses, ref)
    names = [n for n in _pt_files(f"{root}/sync") if n.startswith("iter_0000004")]
    _same_files(f"{root}/sync", f"{root}/killed", names)  # bit for bit the uninterrupted state


def test_write_failure_on_one_rank_stops_every_rank_at_the_next_log_line(runs):
    root, _, out = runs
    path = os.path.join(root, "full", "iter_0000002.tmp-")
    for rank, (rc, err) in enumerate(out_rank["full_disk"] for out_rank in out):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc != 0 and len(lines) == 1, (rank, err)
        assert "iteration 2 failed on rank 1: writing " in lines[0], lines
        assert path in lines[0] and "distrib_optim_dp001.pt" in lines[0], lines
        assert "No space left" in lines[0], lines
    # the log line of iteration 3 agreed on it: no iteration after 2 was logged, none saved
    assert sorted(train_losses(f"{root}/full.jsonl")) == [1, 2]
    assert open(f"{root}/full/{ckpt_format.TRACKER_FILE}").read() == "1"
    assert [n for n in os.listdir(f"{root}/full") if n.startswith("iter_")] == ["iter_0000001"]


def test_sigterm_during_async_save_finishes_it_and_resumes_exactly(runs):
    root, _, out = runs
    assert all(o["sigterm"] == (0, "") for o in out)
    stopped = max(train_losses(f"{root}/term.jsonl"))
    assert stopped < ITERS and out[0]["term_tracker"] == str(stopped)
    assert os.path.isdir(f"{root}/term/iter_0000002")  # the save under way was finished
    assert all(o["after_term"] == (0, "") for o in out)
    ref = train_losses(f"{root}/sync/metrics.jsonl")
    resumed = train_losses(f"{root}/after_term.jsonl")
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    assert all(resumed[i] == ref[i] for i in resumed), (resumed, ref)
    names = [n for n in _pt_files(f"{root}/sync") if n.startswith("iter_0000004")]
    _same_files(f"{root}/sync", f"{root}/term", names)


def test_snapshot_reuses_host_buffers_and_keeps_the_bytes():
    """The CPU side of the pinned-buffer seam: storages reused across saves, views stay views of
    one copy, Parameters stay Parameters, attributes are kept, and torch.save writes the
    original's bytes."""
    flat = torch.arange(12, dtype=torch.float32)
    p = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    obj = {"a": flat[2:6].view(2, 2), "b": flat[6:], "p": p, "n": [1, 2.5, "x", None],
           "t": (flat[:1], 3)}
    obj["again"] = obj["n"]
    tagged = torch.full((2,), 7.0)
    tagged.note = "kept"  # a tensor's Python attributes are in torch.save's bytes too
    obj["tagged"] = tagged
    buffers = HostBuffers(pinned=False)

    def saved(o):
        f = io.BytesIO()
        torch.save(o, f)
        return f.getvalue()

    ptrs = []
    for step in range(2):
        flat += 1
        buffers.begin()
        snap = snapshot(obj, buffers)
        buffers.end(torch.device("cpu"))
        assert saved(snap) == saved(obj)
        assert snap["a"].untyped_storage().data_ptr() == snap["b"].untyped_storage().data_ptr()
        assert snap["a"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        assert isinstance(snap["p"], torch.nn.Parameter) and snap["again"] is snap["n"]
        ptrs.append([s.data_ptr() for s in buffers.storages])
        flat += 1  # training goes on: the snapshot keeps what was saved
        assert torch.equal(snap["b"], flat[6:] - 1)
    assert ptrs[0] == ptrs[1] and buffers.allocations == 3  # flat buffer, Parameter, tagged


def test_async_save_refused_when_one_snapshot_cannot_fit(tmp_path, capsys):
    """A model whose host copy exceeds MemAvailable is refused in one line before it is built."""
    argv = flags("--async-save", train_iters=1, save=tmp_path / "ck", num_layers=96,
                 hidden_size=32768, num_attention_heads=64)
    assert run_main([str(a) for a in argv]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--async-save: one host copy" in lines[0], lines
    assert "MemAvailable" in lines[0], lines
