"""Checkpoints: bit-exact resume, atomic saves, and one-line errors for unusable checkpoints."""

import json
import os

import torch

from dist_utils import worker_context
from pretrain_utils import flags, read_metrics, run_main, train_losses

from megalite.checkpoint import format as ckpt_format


def test_resume_is_bit_exact(tmp_path):
    """Train 10; train 5, stop, --load, train 5 more: iterations 6-10 identical to the last bit.
    Dropout is on, so the RNG state (not just weights, Adam moments, LR step and data position)
    must be restored."""
    common = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "10"]
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    ck = tmp_path / "ck"
    assert run_main(flags(*common, metrics_file=full)) == 0
    assert run_main(flags(*common, "--exit-interval", "5", save=ck, save_interval=5,
                          metrics_file=part)) == 0
    assert (ck / ckpt_format.TRACKER_FILE).read_text().strip() == "5"
    assert run_main(flags(*common, save=ck, load=ck, save_interval=5, metrics_file=part)) == 0
    ref, got = train_losses(full), train_losses(part)
    assert sorted(got) == list(range(1, 11))
    for it in range(6, 11):
        assert got[it] == ref[it], f"iteration {it}: resumed {got[it]!r} != full {ref[it]!r}"
    # grad norms and learning rates continue identically as well
    gref = {r["iteration"]: (r["grad_norm"], r["lr"]) for r in read_metrics(full)}
    ggot = {r["iteration"]: (r["grad_norm"], r["lr"]) for r in read_metrics(part)}
    assert all(ggot[i] == gref[i] for i in range(6, 11))
    assert (ck / ckpt_format.TRACKER_FILE).read_text().strip() == "10"


def test_checkpoint_layout_and_weights_only(tmp_path):
    ck = tmp_path / "ck"
    assert run_main(flags(train_iters=2, save=ck)) == 0
    it_dir = ck / "iter_0000002"
    assert json.loads((it_dir / "args.json").read_text())["model"]["hidden_size"] == 32
    sd = torch.load(it_dir / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=True)
    assert sd["iteration"] == 2 and sd["consumed_samples"] == 16
    assert {"model", "optimizer", "opt_param_scheduler", "rng_state"} <= set(sd)
    assert (ck / "tokenizer" / "tokenizer.json").exists()
    assert not [p for p in os.listdir(ck) if ".tmp-" in p]


def _killed_during_save(argv, stage, iteration):
    import sys

    from megalite.checkpoint import save as ckpt_save

    def hook(where, path):
        if where == stage and f"iter_{iteration:07d}" in path:
            sys.stdout.flush()
            os._exit(17)  # no cleanup, as if the node died

    ckpt_save.fault_hook = hook
    import pretrain

    pretrain.main(argv)


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    argv = flags(train_iters=4, save=ck, save_interval=2)
    ctx = worker_context()  # a process of its own, forked from one that imported torch already
    for stage in ("shard_written", "before_rename"):
        p = ctx.Process(target=_killed_during_save, args=(argv, stage, 4))
        p.start()
        p.join(120)
        assert p.exitcode == 17, stage
        assert (ck / ckpt_format.TRACKER_FILE).read_text().strip() == "2", stage
        assert not (ck / "iter_0000004").exists(), stage
        assert [n for n in os.listdir(ck) if n.startswith("iter_0000004.tmp-")], stage
    # the previous checkpoint loads, and training continues from it
    out = tmp_path / "resumed.jsonl"
    assert run_main(flags(train_iters=4, save=ck, load=ck, metrics_file=out)) == 0
    assert sorted(train_losses(out)) == [3, 4]
    assert (ck / ckpt_format.TRACKER_FILE).read_text().strip() == "4"


def _error_line(capsys, rc):
    out = capsys.readouterr()
    assert rc != 0 and "Traceback" not in out.err
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1, out.err
    return lines[0]


def test_unusable_checkpoints_fail_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "ck"
    assert run_main(flags(train_iters=2, save=ck)) == 0
    capsys.readouterr()

    # different model shape: the message names the flag
    line = _error_line(capsys, run_main(flags("--hidden-size", "64", train_iters=3, load=ck)))
    assert "--hidden-size" in line and "--use-checkpoint-args" in line
    # ... which --use-checkpoint-args fixes
    assert run_main(flags("--hidden-size", "64", "--use-checkpoint-args", train_iters=3,
                          load=ck, metrics_file=tmp_path / "m.jsonl")) == 0
    assert sorted(train_losses(tmp_path / "m.jsonl")) == [3]
    capsys.readouterr()

    # args.json says TP 2: the load reshards (tests/test_reshard_load.py) and names the TP-rank
    # file such a checkpoint would have
    args_path = ck / "iter_0000002" / "args.json"
    good_args = args_path.read_text()
    bad = json.loads(good_args)
    bad["parallel"]["tensor_model_parallel_size"] = 2
    args_path.write_text(json.dumps(bad))
    line = _error_line(capsys, run_main(flags(train_iters=3, load=ck)))
    assert "mp_rank_01_000" in line and "is missing" in line and "tp=2" in line
    args_path.write_text(good_args)

    # truncated model file
    f = ck / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    line = _error_line(capsys, run_main(flags(train_iters=3, load=ck)))
    assert "corrupt or truncated" in line and "model_optim_rng.pt" in line

    # corrupt tracker file, and a directory that is not a checkpoint
    (ck / ckpt_format.TRACKER_FILE).write_text("garbage")
    line = _error_line(capsys, run_main(flags(train_iters=3, load=ck)))
    assert ckpt_format.TRACKER_FILE in line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _error_line(capsys, run_main(flags(train_iters=3, load=empty)))
    assert "latest_checkpointed_iteration.txt" in line


def test_finetune_loads_weights_only(tmp_path):
    ck = tmp_path / "ck"
    assert run_main(flags(train_iters=3, save=ck)) == 0
    out = tmp_path / "ft.jsonl"
    assert run_main(flags("--finetune", train_iters=2, load=ck, metrics_file=out)) == 0
    assert sorted(train_losses(out)) == [1, 2]  # iteration counter restarted
    # and the weights did come from the checkpoint: the first loss differs from a fresh start
    fresh = tmp_path / "fresh.jsonl"
    assert run_main(flags(train_iters=2, metrics_file=fresh)) == 0
    assert train_losses(out)[1] != train_losses(fresh)[1]


def _generate_main():
    import importlib.util

    from pretrain_utils import ROOT

    spec = importlib.util.spec_from_file_location("generate", os.path.join(ROOT, "tools",
                                                                           "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_generate_samples_from_checkpoint(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert run_main(flags(train_iters=2, save=ck)) == 0
    capsys.readouterr()
    generate = _generate_main()
    # mock data uses the NullTokenizer: ids are spelled as decimal numbers
    assert generate(["--load", str(ck), "--prompt", "5 17", "--max-new-tokens", "6",
                     "--top-k", "5", "--seed", "3"]) == 0
    first = capsys.readouterr().out.strip()
    assert generate(["--load", str(ck), "--prompt", "5 17", "--max-new-tokens", "6",
                     "--top-k", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == first  # seeded sampling is reproducible
    assert first.startswith("5 17") and len(first.split()) > 2
    assert generate(["--load", str(ck), "--prompt", "5 17", "--greedy",
                     "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip().startswith("5 17")
    assert generate(["--load", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and "Traceback" not in err
