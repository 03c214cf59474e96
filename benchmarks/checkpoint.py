"""What a checkpoint save costs the training loop: synchronous vs --async-save, and DCP.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint.py [--hidden 1024] [--layers 4] [--save-at 15] [--iters 44]

One process on the CPU trains the same model twice (same seed, same data, ``--log-interval 1``),
saving every ``--save-at`` iterations and at the end; the save measured is the second, at
iteration 2 x ``--save-at`` (the first allocates the snapshot buffers the later ones reuse):

* **sync**: the stall is the save itself (``stall_s`` of the run's ``checkpoint`` record);
* **async**: the stall is the snapshot (the collective part and the host copy), and the write
  overlaps the following iterations. Its extra wall time is the stall, plus any wait for the
  writer at the next save or the end (``waited_s``), plus, over every iteration
  from the save until the write is published, that iteration's time minus the median time of the
  same run's iterations that overlap no write (``iteration_time_ms``; a save between log lines is
  not training time, so the snapshot is not in it; iteration 2, which carries the memory probe,
  and the last are left out of the median). On a shared machine whose load drifts, that baseline
  drifts too, so the same sum is also given against the sync run's times of the same iterations
  (``extra_wall_vs_sync_run_s``); read the two together.

The ratio ``async extra / sync stall`` is the figure (target <= 0.25). Host memory is the size of
the reused snapshot buffers (``host_bytes``) beside the start-up estimate
(``checkpoint.save.snapshot_share_bytes``), and the process's peak RSS.

Then the state the sync run saved (its ``model_optim_rng.pt``) is written and read back by
megalite's writer (``checkpoint.format.save_file``, ``torch.load``) and by
``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load`` into preallocated tensors, and
``dcp.async_save``'s stall where the installed torch offers it without a process group), for
docs/checkpoints.md's DCP evaluation. Prints one JSON line.

    python benchmarks/checkpoint.py --gpu-check

checks on a CUDA device what the CPU runs cannot (exit 77 without one): the snapshot buffers are
pinned and reused across saves, the writer sees the values of the save's iteration although the
next steps' device work overwrites the tensors right after the non-blocking copies were queued,
a tiny pretrain.py run on the GPU writes the same bytes with and without --async-save, and the
snapshot's device-to-host bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _run(args, save: str, metrics: str, async_save: bool) -> None:
    from megalite.arguments import parse_args
    from megalite.parallel_state import destroy_model_parallel
    from megalite.training import pretrain

    argv = ["--mock-data", "--num-layers", args.layers, "--hidden-size", args.hidden,
            "--num-attention-heads", args.hidden // 64, "--seq-length", args.seq,
            "--vocab-size", args.vocab, "--micro-batch-size", 1, "--global-batch-size", 1,
            "--train-iters", args.iters, "--save-interval", args.save_at, "--log-interval", 1,
            "--eval-interval", 10 ** 6, "--eval-iters", 0, "--lr", 1e-4, "--no-log-throughput",
            "--save", save, "--metrics-file", metrics] + (["--async-save"] if async_save else [])
    with open(os.devnull, "w") as quiet:
        pretrain(parse_args([str(a) for a in argv]), stream=quiet)
    destroy_model_parallel()


def _records(path: str, split: str):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r.get("split") == split]


def _timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _dcp(state: dict, work: str) -> dict:
    """torch.distributed.checkpoint against megalite's writer on the same tensors."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megalite.checkpoint import format as ckpt_format
    from megalite.checkpoint import save as ckpt_save

    tensors = {}

    def flat(x, prefix=""):  # DCP takes a flat dict of tensors (nested dicts are flattened too)
        if isinstance(x, dict):
            for k, v in x.items():
                flat(v, f"{prefix}{k}.")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                flat(v, f"{prefix}{i}.")
        elif torch.is_tensor(x):
            tensors[prefix[:-1]] = x

    flat(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out = {"state_bytes": nbytes, "tensors": len(tensors)}
    mfile = os.path.join(work, "megalite.pt")
    out["megalite_save_s"] = _timed(lambda: ckpt_format.save_file(mfile, tensors))
    out["megalite_load_s"] = _timed(lambda: torch.load(mfile, map_location="cpu",
                                                       weights_only=True))
    ddir = os.path.join(work, "dcp")
    out["dcp_save_s"] = _timed(lambda: dcp.save(tensors, checkpoint_id=ddir))
    target = {k: torch.empty_like(v) for k, v in tensors.items()}
    out["dcp_load_s"] = _timed(lambda: dcp.load(target, checkpoint_id=ddir))
    assert all(torch.equal(target[k], tensors[k]) for k in tensors)
    try:
        adir = os.path.join(work, "dcp_async")
        t0 = time.perf_counter()
        fut = dcp.async_save(tensors, checkpoint_id=adir)
        out["dcp_async_stall_s"] = time.perf_counter() - t0
        fut.result()
        out["dcp_async_total_s"] = time.perf_counter() - t0
    except Exception as e:  # (needs a process group on some versions)
        out["dcp_async"] = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
    return out


def gpu_check(args) -> int:
    import torch

    from megalite.checkpoint.snapshot import HostBuffers, snapshot

    if not torch.cuda.is_available():
        print(json.dumps({"gpu_check": "not run: no CUDA device"}))
        return 77
    dev = torch.device("cuda")
    res = {}
    flat = torch.arange(1 << 26, dtype=torch.float32, device=dev)  # 256 MiB
    obj = {"view": flat[10:1000].view(10, 99), "flat": flat,
           "p": torch.nn.Parameter(torch.ones(4, device=dev), requires_grad=False)}
    buffers, ptrs = HostBuffers(pinned=True), []
    for step in range(2):
        expect = flat[:8].cpu()
        buffers.begin()
        t0 = time.perf_counter()
        snap = snapshot(obj, buffers)
        buffers.end(dev)
        queued = time.perf_counter() - t0
        flat.mul_(3).add_(1)  # the next step overwrites the tensors on the same stream
        buffers.ready()
        res.setdefault("snapshot_s", []).append(time.perf_counter() - t0)
        res.setdefault("queue_s", []).append(queued)
        assert torch.equal(snap["flat"][:8], expect), "the snapshot saw a later step's values"
        assert all(s.is_pinned() for s in buffers.storages), "snapshot buffers are not pinned"
        ptrs.append([s.data_ptr() for s in buffers.storages])
    assert ptrs[0] == ptrs[1], "snapshot buffers were not reused"
    res["d2h_gb_per_s"] = flat.numel() * 4 / min(res["snapshot_s"]) / 1e9
    work = tempfile.mkdtemp(prefix="megalite_ckpt_gpu_", dir=args.dir)
    try:
        import subprocess

        base = [sys.executable, os.path.join(ROOT, "pretrain.py"), "--mock-data", "--device",
                "cuda", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "2",
                "--global-batch-size", "4", "--train-iters", "4", "--save-interval", "2",
                "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3"]
        for mode, extra in (("sync", []), ("async", ["--async-save"])):
            subprocess.run(base + ["--save", os.path.join(work, mode)] + extra, check=True,
                           capture_output=True)
        names = sorted(os.path.relpath(os.path.join(d, f), os.path.join(work, "sync"))
                       for d, _, fs in os.walk(os.path.join(work, "sync")) for f in fs
                       if f.endswith(".pt"))
        for n in names:
            with open(os.path.join(work, "sync", n), "rb") as a, \
                    open(os.path.join(work, "async", n), "rb") as b:
                assert a.read() == b.read(), f"{n}: --async-save wrote other bytes on CUDA"
        res["same_bytes_files"] = len(names)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["gpu_check"] = "pass"
    print(json.dumps(res))
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--save-at", type=int, default=15)
    p.add_argument("--iters", type=int, default=44)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--gpu-check", action="store_true", help="the CUDA-only checks (see above)")
    args = p.parse_args()
    if args.gpu_check:
        sys.exit(gpu_check(args))
    import torch

    from megalite.checkpoint import format as ckpt_format
    from megalite.checkpoint import save as ckpt_save

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = tempfile.mkdtemp(prefix="megalite_ckpt_bench_", dir=args.dir)
    try:
        res = {"measured_save_iteration": 2 * args.save_at,
               "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                         "seq": args.seq}}
        for mode in ("sync", "async"):
            metrics = os.path.join(work, f"{mode}.jsonl")
            _run(args, os.path.join(work, mode), metrics, mode == "async")
            saves = _records(metrics, "checkpoint")
            measured = 2 * args.save_at
            ck = next(r for r in saves if r["iteration"] == measured)
            times = {r["iteration"]: r["iteration_time_ms"] / 1000 for r in
                     _records(metrics, "train")}
            r = {"stall_s": ck["stall_s"], "iteration_s": times}
            if mode == "async":
                overlapped = range(measured + 1, ck["published_iteration"] + 1)
                busy = {i for s in saves for i in range(s["iteration"] + 1,
                                                        s["published_iteration"] + 1)}
                free = [t for i, t in times.items() if 2 < i < args.iters and i not in busy]
                base = statistics.median(free)
                extra = ck["stall_s"] + ck["waited_s"] + sum(times[i] - base for i in overlapped)
                r.update(write_s=ck["write_s"], writer_cpu_s=ck["writer_cpu_s"],
                         waited_s=ck["waited_s"], host_bytes=ck["host_bytes"],
                         published_iteration=ck["published_iteration"],
                         overlapped_iterations=len(overlapped), median_iteration_s=base,
                         overlapped_iteration_s=[times[i] for i in overlapped],
                         extra_wall_s=extra, extra_wall_vs_sync_run_s=(
                             ck["stall_s"] + ck["waited_s"] + sum(
                                 times[i] - res["sync"]["iteration_s"][i] for i in overlapped)))
            res[mode] = r
        sync_dir = os.path.join(work, "sync", f"iter_{2 * args.save_at:07d}")
        model_file = os.path.join(sync_dir, ckpt_format.shard_dir_name(0, 0),
                                  ckpt_format.MODEL_FILE)
        res["file_bytes"] = os.path.getsize(model_file)
        for k, name in (("extra_wall_s", "ratio"), ("extra_wall_vs_sync_run_s",
                                                    "ratio_vs_sync_run")):
            res["async"][name] = res["async"][k] / res["sync"]["stall_s"]
        for mode in ("sync", "async"):
            res[mode].pop("iteration_s")
        from megalite.arguments import parse_args
        from megalite.parallel_state import ParallelState

        cfg = parse_args(["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
                          "--num-attention-heads", str(args.hidden // 64), "--seq-length",
                          str(args.seq), "--vocab-size", str(args.vocab), "--mock-data"])
        cfg = cfg.resolve(1, args.vocab)
        res["async"]["host_bytes_estimate"] = ckpt_save.snapshot_share_bytes(
            cfg, ParallelState())
        res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        state = torch.load(model_file, map_location="cpu", weights_only=True)
        shutil.rmtree(os.path.join(work, "sync"))
        shutil.rmtree(os.path.join(work, "async"))
        res["dcp"] = _dcp(state, work)
        print(json.dumps(res))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
