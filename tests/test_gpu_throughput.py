"""benchmarks/gpu_throughput.py stays runnable: its tiny CPU row, megalite and Hugging Face.

Every run here happens with ``datasets`` and ``wandb`` unimportable (a meta-path blocker in a
sitecustomize on PYTHONPATH, which the benchmark passes on to its runs), as on a GPU machine
that has neither: a hard import of either on the --mock-data path fails these tests.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_throughput.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_throughput  # noqa: E402

BLOCKER = '''import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("datasets", "wandb"):
            raise ImportError(f"{name} is blocked: a GPU machine may not have it")
sys.meta_path.insert(0, _Blocked())
'''


@pytest.fixture
def env(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(BLOCKER)
    e = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=os.pathsep.join([str(block), ROOT]))
    proc = subprocess.run([sys.executable, "-c", "import wandb"], env=e, capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "wandb is blocked" in proc.stderr  # the blocker is in force
    return e


def _run(env, *argv):
    return subprocess.run([sys.executable, SCRIPT, *argv], env=env, capture_output=True,
                          text=True, timeout=300)


def test_tiny_row_on_cpu_prints_table_and_json(tmp_path, env):
    """The Mixtral row (HF's MixtralForCausalLM, grouped_mm experts) end to end; the dense rows
    run through the same runner (tiny-gpt2 in the time-budget test below)."""
    out = tmp_path / "result.json"
    proc = _run(env, "--rows", "tiny-mixtral", "--systems", "megalite,hf", "--iters", "2",
                "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["plan"] == ["tiny-mixtral/megalite", "tiny-mixtral/hf"]
    for row in ("tiny-mixtral",):
        res = doc["rows"][row]["results"]
        for system in ("megalite", "hf"):
            assert res[system]["tokens_per_sec"] > 0 and res[system]["peak_memory_bytes"] > 0
            assert 0 < res[system]["mfu"] <= 1 and res[system]["timed_iterations"] == 2
        assert f"| {row} | megalite |" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == doc


def test_timeouts_budget_and_json_written_after_each_run(tmp_path, env):
    """Runs that cannot finish in --run-timeout are killed and recorded; the plan stops at
    --time-budget; the JSON holds each finished run while the next one is still going.

    The numbers hold on a loaded machine: each run is killed after 8 s, so two runs leave less
    than the budget's 26 s - MIN_RUN_S (10 s) for the third whatever the load, and the first
    leaves enough for the second unless killing it takes another 8 s."""
    out = tmp_path / "result.json"
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--rows", "tiny-gpt2", "--systems", "megalite,hf,hf-compile",
         "--iters", "100000", "--warmup", "1", "--run-timeout", "8", "--time-budget", "26",
         "--json", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen_in_flight = False
    while proc.poll() is None and not seen_in_flight:
        time.sleep(0.2)
        try:
            rows = json.loads(out.read_text())["rows"]
        except (OSError, ValueError):
            continue
        seen_in_flight = "megalite" in rows.get("tiny-gpt2", {}).get("results", {}) \
            and proc.poll() is None
    stdout, stderr = proc.communicate(timeout=120)
    assert seen_in_flight, "the JSON had no megalite result while the hf run was in flight"
    assert proc.returncode == 1, stderr[-2000:]
    doc = json.loads(out.read_text())
    res = doc["rows"]["tiny-gpt2"]["results"]
    assert doc["complete"] and list(res) == ["megalite", "hf", "hf-compile"]
    for system in ("megalite", "hf"):
        assert res[system]["timed_out"] and res[system]["error"].startswith("timed out after 8 s")
    assert res["hf-compile"] == {"skipped": "--time-budget 26 s spent"}
    assert "| tiny-gpt2 | hf-compile | | | | | | | | | skipped: --time-budget 26 s spent |" in stdout


def test_a_run_cut_short_keeps_its_timed_iterations(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"split": "train", "iteration_time_ms": t, "peak_memory_bytes": m,
             "host_queue_ms_per_iteration": t / 2}
            for t, m in ((900.0, 5), (12.0, 7), (10.0, 6), (11.0, 6))]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs)
                    + '{"split": "memory"}\n{"split": "train", "iteration_ti')  # killed mid-line
    got = gpu_throughput._train_records(str(path))
    assert got == recs
    assert gpu_throughput.summarize(got, 1) == {"iteration_ms": 11.0, "peak_memory_bytes": 7,
                                                "timed_iterations": 3, "host_queue_ms": 5.5}
    assert gpu_throughput.summarize(got, 4) is None  # nothing after warm-up: no figure at all


def test_mixtral_row_builds_the_same_model_in_both_systems():
    """The HF side of an MoE row is MixtralForCausalLM with grouped_mm experts, of the shape
    megalite trains: the same parameters, so tokens/s compare like for like."""
    import transformers

    from megalite.convert.hf import model_config_to_hf_config
    from megalite.models.gpt import GPTModel

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    for row, params, active in (("tiny-mixtral", 238_400, 164_672),
                                ("mixtral-1.9b", 1_943_259_136, 697_550_848)):
        cfg = gpu_throughput._model_config(row)
        hf_config = model_config_to_hf_config(cfg, attn_implementation="sdpa",
                                              experts_implementation="grouped_mm")
        assert hf_config.architectures == ["MixtralForCausalLM"]
        with torch.device("meta"):
            hf = transformers.MixtralForCausalLM(hf_config)
        assert hf.config._experts_implementation == "grouped_mm"
        assert count(hf) == cfg.num_parameters() == params
        assert cfg.num_active_parameters() == active
    assert count(GPTModel(gpu_throughput._model_config("tiny-mixtral"))) == 238_400


def test_default_gpu_plan_has_the_target_comparisons():
    plan = gpu_throughput.DEFAULT_GPU_PLAN
    assert len(set(plan)) == len(plan)
    need = [("llama-1.5b", s) for s in gpu_throughput.SYSTEMS] + [
        (r, s) for r in ("gpt2-1.3b", "gpt2-350m") for s in ("megalite", "hf", "hf-compile")] + [
        ("mixtral-1.9b", "megalite"), ("mixtral-1.9b", "hf")]
    assert sorted(need) == sorted(plan)
    # eager runs first: a slow compile can only cost the figures planned after it
    first_compile = min(i for i, (_, s) in enumerate(plan) if s.endswith("compile"))
    assert all(s.endswith("compile") for _, s in plan[first_compile:])


def test_gpu_defaults(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args, cuda = gpu_throughput.parse_args([])
    assert cuda and args.plan == gpu_throughput.DEFAULT_GPU_PLAN
    assert (args.iters, args.warmup, args.run_timeout, args.time_budget) == (10, 3, 210, 450)
    args, _ = gpu_throughput.parse_args(["--rows", "gpt2-350m,llama-1.5b"])  # a cross product
    systems = gpu_throughput.SYSTEMS
    assert args.plan == [(r, s) for r in ("gpt2-350m", "llama-1.5b") for s in systems]


def test_unknown_row_fails_in_one_line(env):
    proc = _run(env, "--rows", "gpt2-7t")
    assert proc.returncode == 2
    assert "--rows: unknown gpt2-7t; valid:" in proc.stderr.strip().splitlines()[-1]


def test_unwritable_json_path_fails_before_any_run(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "out.json"
    assert gpu_throughput.main(["--rows", "tiny-gpt2", "--json", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"gpu_throughput.py: error: --json {bad}: ")


def test_a_machine_that_cannot_compile_runs_the_fast_paths_eagerly(monkeypatch, capsys):
    """SwiGLU and the cross entropy's blocks are compiled on a GPU; if compiling fails there (a
    toolchain or torch release the CPU tests cannot see), megalite warns once and runs them
    eagerly instead of losing the run."""
    from megalite import compiled
    from megalite.models.transformer import swiglu
    from megalite.tensor_parallel import cross_entropy as ce

    tried = []

    def broken_compile(fn, **kwargs):
        def run(*args):
            tried.append(fn.__name__)
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment "
                               "variable.\n(more lines)")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    f = compiled.compile_or_eager(swiglu, dynamic=True)
    h = torch.randn(3, 8)
    assert torch.equal(f(h), swiglu(h)) and torch.equal(f(h), swiglu(h))
    assert tried == ["swiglu"]  # tried once, eager from then on
    assert capsys.readouterr().err.splitlines() == [
        "megalite: torch.compile of swiglu failed (RuntimeError: Failed to find C compiler. "
        "Please specify via CC environment variable.); it runs eagerly from now on"]
    with pytest.raises(RuntimeError, match="size of tensor"):  # eager fails too: a real error
        compiled.compile_or_eager(swiglu)(torch.randn(3, 7))  # odd width: gate 4, up 3

    logits = torch.randn(2, 5, 64, requires_grad=True)
    target = torch.randint(0, 60, (2, 5))
    ref = ce.vocab_parallel_cross_entropy(logits, target, vocab_size=60)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    monkeypatch.setattr(ce, "COMPILE_BLOCKS", True)
    ce._compiled.cache_clear()
    try:
        loss = ce.vocab_parallel_cross_entropy(logits, target, vocab_size=60)
        (g,) = torch.autograd.grad(loss.sum(), logits)
    finally:
        ce._compiled.cache_clear()
    assert torch.equal(loss, ref) and torch.equal(g, g_ref)
    assert tried == ["swiglu", "swiglu", "block_stats", "block_grad"]
