"""pretrain.py with pipeline parallelism, end to end: pp=2 (1F1B, interleaved v=2, ZB-H1) equals
one process (docs/design.md, contract 5), logs the measured bubble (contract 10) that
tools/plot_pipeline.py can draw, and bad pipeline layouts fail in one line without hanging
(contract 8).

The parallel runs are pretrain_utils.run_cli's (ranks forked in strict mode, no interpreter to
start per rank); the one-process references run in the test's own process. The bad layouts start
pretrain.py's ranks directly (RANK/WORLD_SIZE/MASTER_* as torchrun sets them) rather than through
torchrun, so each rank's stderr is exactly pretrain.py's, without the launcher's failure report;
they start together: start-up dominates and overlaps.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dist_utils import free_port
from pretrain_utils import PRETRAIN, ROOT, flags, read_metrics, run_cli, run_main, train_losses

from megalite.checkpoint.format import TRACKER_FILE

sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
import convert as convert_cli  # noqa: E402  (tools/checkpoint/convert.py)

ITERS = 5
# 4 layers so that p=2 with 1 layer per virtual stage gives v=2; m = 8 / 2 = 4 micro-batches
BASE = dict(num_layers=4, train_iters=ITERS, global_batch_size=8)
P = 2
M = 4


def _start(argv, nproc):
    """Start pretrain.py as ``nproc`` ranks of one job; returns the Popen objects."""
    port = free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, RANK=str(r),
                   WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, PRETRAIN] + argv, cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(jobs, timeout):
    """Wait for every job's ranks; a rank still running after ``timeout`` s is a hang: kill all."""
    out = {}
    try:
        for name, procs in jobs.items():
            res = []
            for pr in procs:
                try:
                    so, se = pr.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{name}: rank {procs.index(pr)} still running after {timeout} s "
                                f"(hang)")
                res.append((pr.returncode, so, se))
            out[name] = res
    finally:
        for procs in jobs.values():
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait()
    return out


def _all_exit_0(jobs):
    """Run each job, ``name: (argv, nproc)``, one after the other; every rank must exit 0."""
    for name, (argv, nproc) in jobs.items():
        proc = run_cli(argv, nproc=nproc, timeout=300)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}:\n{proc.stderr[-3000:]}"


SCHEDULES = {
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "interleaved": ["--num-layers-per-virtual-pipeline-stage", "1"],
    "zb-h1": ["--pipeline-schedule", "zb-h1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp")
    jobs = {}
    for name, extra in SCHEDULES.items():
        (d / name).mkdir()
        # the traces go to --save if given (ZB-H1 here, with metrics.jsonl), else next to
        # --metrics-file: both ways put them in d/name
        where = (dict(save=d / name) if name == "zb-h1"
                 else dict(metrics_file=d / name / "metrics.jsonl"))
        jobs[name] = (flags("--pipeline-model-parallel-size", str(P), "--timing-log-level", "1",
                            *extra, **where, **BASE), P)
    assert run_main(flags("--timing-log-level", "1", metrics_file=d / "single.jsonl", **BASE)) == 0
    _all_exit_0(jobs)
    return d


def _metrics(d, name):
    return d / "single.jsonl" if name == "single" else d / name / "metrics.jsonl"


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pp2_matches_single_process(runs, schedule):
    ref, got = train_losses(_metrics(runs, "single")), train_losses(_metrics(runs, schedule))
    assert sorted(ref) == list(range(1, ITERS + 1)) and sorted(got) == sorted(ref)
    for it in ref:
        rel = abs(got[it] - ref[it]) / abs(ref[it])
        assert rel <= 1e-4, f"{schedule} it {it}: pp2 {got[it]} vs single {ref[it]} rel {rel:.2e}"
    assert len({round(v, 5) for v in ref.values()}) >= ITERS - 1  # the losses do move


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipeline_metrics_record_and_trace(runs, schedule):
    recs = read_metrics(_metrics(runs, schedule), split="pipeline")
    assert [r["iteration"] for r in recs] == list(range(1, ITERS + 1))  # every logged iteration
    v = 2 if schedule == "interleaved" else 1
    for r in recs:
        assert r["schedule"] == schedule and (r["pp_size"], r["num_chunks"]) == (P, v)
        assert r["num_microbatches"] == M
        assert 0.0 <= r["bubble_fraction"] < 1.0
        assert len(r["bubble_fraction_stage"]) == P
        assert all(0.0 <= b < 1.0 for b in r["bubble_fraction_stage"])
        assert r["bubble_fraction_stage1"] == r["bubble_fraction_stage"][1]
        assert abs(sum(r["bubble_fraction_stage"]) / P - r["bubble_fraction"]) < 1e-9
        assert r["step_time"] > 0 and r["t_f"] > 0 and r["t_b"] > 0
        assert (r["t_w"] > 0) == (schedule == "zb-h1")  # only ZB-H1 has separate W ops
        # docs/theory.md, "Pipeline bubbles"
        if schedule == "1f1b":
            assert r["bubble_theory"] == pytest.approx((P - 1) / (M + P - 1))
        elif schedule == "interleaved":
            assert r["bubble_theory"] == pytest.approx((P - 1) / (v * M + P - 1))
        else:
            assert r["bubble_theory"] == pytest.approx(
                (P - 1) * (r["t_f"] + r["t_b"] - r["t_w"]) / r["step_time"])
        # peak in-flight micro-batches: p on stage 0 for 1F1B and ZB-H1; interleaved counts
        # (chunk, micro-batch) pairs: its 2(p-1)+(v-1)p warm-up forwards plus one
        want = [P - g for g in range(P)] if v == 1 else [P * v + P - 1, P * v - 1]
        assert r["peak_in_flight_stage"] == want and r["peak_in_flight"] == max(want)
        # the same events as a Chrome trace in --save
        assert r["trace_file"] == str(runs / schedule / f"pipeline_trace_iter{r['iteration']}.json")
        trace = json.loads(open(r["trace_file"]).read())
        xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        per_stage = (3 if schedule == "zb-h1" else 2) * M * v
        assert len(xs) == P * per_stage and {e["pid"] for e in xs} == set(range(P))
        assert len(r["pipeline_timeline"]) == P
        n_ev = sum(len(t["events"]) for t in r["pipeline_timeline"])
        assert n_ev == len(xs)
    assert read_metrics(_metrics(runs, "single"), split="pipeline") == []  # p = 1: no pipeline


def test_plot_tool_draws_from_metrics_jsonl(runs, tmp_path):
    png = tmp_path / "schedule.png"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_pipeline.py"),
                           str(_metrics(runs, "zb-h1")), "-o", str(png)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.stat().st_size > 1000


BAD = {
    "interleaved_m_not_multiple_of_p": (
        ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
         "--global-batch-size", "6"], "multiple of --pipeline-model-parallel-size"),
    # (stage_layer_counts' other error, p > L, leaves by the same path; test_pipeline.py checks
    # its line)
    "layers_not_divisible": (["--num-layers", "3"], "--num-layers (3) must be divisible"),
    "v_schedule_zero3": (["--num-layers", "4", "--pipeline-schedule", "dualpipev",
                          "--use-distributed-optimizer", "--zero-stage", "3"],
                         "does not support --pipeline-schedule dualpipev"),
}


def test_bad_pipeline_layouts_fail_in_one_line(tmp_path):
    jobs = {}
    for name, (extra, _expect) in BAD.items():
        (tmp_path / name).mkdir()
        jobs[name] = _start(flags("--pipeline-model-parallel-size", str(P), *extra, train_iters=2,
                                  metrics_file=tmp_path / name / "metrics.jsonl"), P)
    res = _finish(jobs, timeout=120)
    for name, ranks in res.items():
        expect = BAD[name][1]
        for r, (rc, _so, se) in enumerate(ranks):
            lines = [ln for ln in se.splitlines() if ln.strip()]
            assert rc != 0, f"{name} rank {r} exited 0"
            assert len(lines) == 1 and "error:" in lines[0] and expect in lines[0], \
                f"{name} rank {r}: {se[-2000:]}"


def test_v_schedules_train_resume_and_reshard_like_one_process(tmp_path):
    """zb-v and dualpipev through pretrain.py with tied embeddings (the GPT-2 default: the V puts
    both copies on rank 0): pp2 with TP2 + SP under zb-v with full recompute, and pp2 x DP2 with
    ZeRO-2 under dualpipev, equal one process. The dualpipev checkpoint has 1F1B's tied format:
    resharded to a pp2 1F1B layout it resumes under 1F1B, and from there resharded back to the V
    (the weights bit for bit what the V run saved) it resumes under dualpipev, both to the
    uninterrupted run's losses (tools/checkpoint/convert.py)."""
    V = dict(BASE, global_batch_size=16)  # m = 16 / 2 = 8 per pipeline without DP, 4 with DP2
    ck = tmp_path / "dpv"
    dpv = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev",
           "--use-distributed-optimizer", "--zero-stage", "2"]
    jobs = {
        "zb-v tp2 sp recompute": (flags(
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v",
            "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--recompute-granularity", "full", metrics_file=tmp_path / "zbv.jsonl", **V), 4),
        "dualpipev dp2 zero2": (flags(*dpv, "--save-interval", "3", save=ck,
                                      metrics_file=tmp_path / "dpv.jsonl", **V), 4),
    }
    assert run_main(flags(metrics_file=tmp_path / "single.jsonl", **V)) == 0
    _all_exit_0(jobs)
    ref = train_losses(tmp_path / "single.jsonl")
    for name in ("zbv", "dpv"):
        got = train_losses(tmp_path / f"{name}.jsonl")
        assert sorted(got) == sorted(ref) == list(range(1, ITERS + 1))
        for it in ref:
            assert abs(got[it] - ref[it]) <= 1e-5 * abs(ref[it]), (name, it, got[it], ref[it])

    # resume the V checkpoint at iteration 3 (as if the run had stopped there) resharded to pp2
    # 1F1B, and from that 1F1B checkpoint back to the V, weights unchanged
    shutil.rmtree(ck / "iter_0000005")
    (ck / TRACKER_FILE).write_text("3")
    assert convert_cli.main(["reshard", "--load", str(ck), "--save", str(tmp_path / "f1b"),
                             "--iteration", "3", "--tensor-model-parallel-size", "1",
                             "--pipeline-model-parallel-size", "2", "--data-parallel-size", "1",
                             "--zero-stage", "0"]) == 0
    assert json.loads((tmp_path / "f1b" / "iter_0000003" / "args.json").read_text())[
        "training"]["pipeline_schedule"] in (None, "1f1b")
    assert convert_cli.main(["reshard", "--load", str(tmp_path / "f1b"), "--save",
                             str(tmp_path / "v2"), "--tensor-model-parallel-size", "1",
                             "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                             "dualpipev", "--data-parallel-size", "2", "--zero-stage", "2"]) == 0
    for r in ("mp_rank_00_000", "mp_rank_00_001"):
        a, b = (torch.load(d / "iter_0000003" / r / "model_optim_rng.pt", weights_only=False)
                for d in (ck, tmp_path / "v2"))
        for k in ("model0", "model1"):  # the V's two chunks, each layer where it was
            assert list(a[k]) == list(b[k]) and all(torch.equal(a[k][n], b[k][n]) for n in a[k])
        # rank 0's chunk 1 keeps its own copy of the tied embedding, as 1F1B's last stage does
        assert ("output_layer.weight" in a["model1"]) == (r == "mp_rank_00_000")
    jobs = {
        "resume V": (flags(*dpv, load=tmp_path / "v2",
                           metrics_file=tmp_path / "resume_v.jsonl", **V), 4),
        "resume 1f1b": (flags("--pipeline-model-parallel-size", "2", load=tmp_path / "f1b",
                              metrics_file=tmp_path / "resume_1f1b.jsonl", **V), 2),
    }
    _all_exit_0(jobs)
    whole = train_losses(tmp_path / "dpv.jsonl")
    for name in ("resume_v", "resume_1f1b"):
        got = train_losses(tmp_path / f"{name}.jsonl")
        assert sorted(got) == [4, 5], (name, got)
        for it in got:
            assert abs(got[it] - whole[it]) <= 1e-5 * abs(whole[it]), (name, it, got[it])
