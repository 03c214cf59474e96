"""pretrain.py end to end: bad input fails in one line. (Parallel layouts through pretrain.py equal
one process in test_multinode.py and test_pretrain_pipeline.py.)"""

import pytest

from pretrain_utils import flags, run_cli, run_main


def _one_error_line(capsys, rc):
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert rc != 0
    assert "Traceback" not in out.err
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1, out.err[-2000:]
    return errors[0]


@pytest.mark.parametrize("extra,expect", [
    (["--global-batch-size", "5", "--micro-batch-size", "2"], "--global-batch-size"),
    (["--fp16", "--bf16"], "--bf16 and --fp16"),
    (["--num-attention-heads", "5"], "--num-attention-heads"),
    (["--load", "/nonexistent/megalite_ck"], "no such directory"),
    (["--overlap-param-gather", "--train-iters", "1"], "--overlap-param-gather"),
    (["--ddp-bucket-size", "0", "--train-iters", "1"], "--ddp-bucket-size"),
])
def test_bad_flags_fail_in_one_line(capsys, tmp_path, monkeypatch, extra, expect):
    monkeypatch.chdir(tmp_path)
    base = [f for f in flags(train_iters=2)]
    # later flags win in argparse, so the overrides can simply be appended
    rc = run_main(base + extra)
    line = _one_error_line(capsys, rc)
    assert expect in line, line


def test_data_errors_fail_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"content": "def f(): pass"}\n' * 4)
    base = [f for f in flags(train_iters=2) if f != "--mock-data"]
    cases = [(["--data-path", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
             (["--data-path", str(no_field)], "--dataset-text-field"),
             (["--data-path"], "--data-path"),
             (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
               "no-such-org/no-such-tokenizer"], "--tokenizer-model")]
    for extra, expect in cases:
        rc = run_main(base + extra)
        line = _one_error_line(capsys, rc)
        assert expect in line, line


def test_unknown_flag_and_empty_dataset_exit_cleanly(tmp_path):
    proc = run_cli(["--no-such-flag", "3"], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--no-such-flag" in proc.stderr
    assert "Traceback" not in proc.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = run_cli([f for f in flags(train_iters=2) if f != "--mock-data"]
                   + ["--data-path", str(empty)], timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "empty.jsonl" in proc.stderr.strip().splitlines()[-1]


def test_help_groups_flags():
    proc = run_cli(["--help"], timeout=120)
    assert proc.returncode == 0
    for group in ("model:", "parallelism:", "mixed precision:", "optimizer and learning rate:",
                  "checkpoints:", "data:", "logging and evaluation:"):
        assert group in proc.stdout
    assert "--tensor-model-parallel-size" in proc.stdout


def test_divergence_aborts_with_one_line(capsys, tmp_path, monkeypatch):
    """fp32: a NaN/inf loss stops the run with a message instead of training on garbage."""
    monkeypatch.chdir(tmp_path)
    rc = run_main(flags("--lr", "1e30", "--min-lr", "0", "--lr-warmup-iters", "0",
                        "--clip-grad", "0", train_iters=6))
    line = _one_error_line(capsys, rc)
    assert rc == 1 and "diverged" in line and "--lr" in line
