"""ZeRO-3 checkpoints through pretrain.py and the conversion tools (docs/zero3.md, "Checkpoints").

One 10-iteration --zero-stage 3 run on 2 torchrun ranks saves at iterations 5 and 10 (saving does
not perturb training, so it is also the uninterrupted reference). Its iteration-5 checkpoint then:

* holds the consolidated model: model_optim_rng.pt has the plain GPTModel's keys and shapes, and
  per-DP-rank optimizer shards (distrib_optim_dp000/001.pt);
* resumes at dp=1 (the shards merged by parameter name and re-split) with the same losses 6-10;
  the same-DP-size fast path is tests/test_zero3.py's pretrain test;
* with --no-load-optim gives the same loss at iteration 6 (the weights) but not later (a fresh
  Adam), so both halves of the state are proven to matter;
* --finetune at stage 3 equals --finetune at stage 0 from the same files;
* exports with `convert.py megalite-to-hf` to a model transformers loads with the megalite
  model's logits;
* reshards offline (`convert.py reshard`) to stage 0 and to stage 3 at dp=1, and either resumes
  with the same losses.
The iteration-1 memory record equals 16Ψ/N up to unit padding (megalite/memory.py).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from pretrain_utils import ROOT, flags, read_metrics, run_cli, run_main, train_losses

from megalite.checkpoint import format as ckpt

sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
import convert as convert_cli  # noqa: E402  (tools/checkpoint/convert.py)

ITERS = 10


def _resumed_matches(got, ref, iters, rel=1e-5):
    assert sorted(got) == list(iters), sorted(got)
    for it in iters:
        assert abs(got[it] - ref[it]) <= rel * abs(ref[it]), (it, got[it], ref[it])


def test_zero3_checkpoint_consolidated_resume_finetune_export_reshard(tmp_path):
    ck, whole = tmp_path / "ck", tmp_path / "whole.jsonl"
    proc = run_cli(flags("--zero-stage", "3", train_iters=ITERS, save=ck, save_interval=5,
                         metrics_file=whole), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = train_losses(whole)
    assert sorted(ref) == list(range(1, ITERS + 1))
    assert len({round(v, 5) for v in ref.values()}) >= 8  # training moved the loss
    (ck / ckpt.TRACKER_FILE).write_text("5")
    shard = ck / "iter_0000005" / "mp_rank_00_000"

    # 1. The model file is the consolidated model, as a stage-0 checkpoint's.
    from megalite.models import GPTModel
    from megalite.parallel_state import ParallelState

    cfg = ckpt.read_checkpoint_config(str(ck))
    sd = torch.load(shard / ckpt.MODEL_FILE, weights_only=True)["model"]
    plain = GPTModel(cfg.model, ParallelState(), seed=1).state_dict()
    assert list(sd) == list(plain)
    assert all(sd[k].shape == plain[k].shape for k in plain)
    assert sorted(os.listdir(shard)) == ["distrib_optim_dp000.pt", "distrib_optim_dp001.pt",
                                         ckpt.MODEL_FILE]

    # 2. Resume at dp = 1: shards merged by name and re-split.
    dp1 = tmp_path / "dp1.jsonl"
    assert run_main(flags("--zero-stage", "3", train_iters=ITERS, load=ck,
                          metrics_file=dp1)) == 0
    _resumed_matches(train_losses(dp1), ref, range(6, ITERS + 1))

    # 3. --no-load-optim: the weights alone (iteration 6's loss is computed before its update).
    cold = tmp_path / "cold.jsonl"
    assert run_main(flags("--zero-stage", "3", "--no-load-optim", train_iters=8, load=ck,
                          metrics_file=cold)) == 0
    got = train_losses(cold)
    assert abs(got[6] - ref[6]) <= 1e-5 * abs(ref[6]), (got[6], ref[6])
    assert abs(got[8] - ref[8]) > 1e-4 * abs(ref[8]), "a fresh Adam should change the losses"

    # 4. --finetune (weights only, iteration 0) at stage 3 == at stage 0, from the same files.
    ft = {}
    for stage in ("0", "3"):
        path = tmp_path / f"ft{stage}.jsonl"
        assert run_main(flags("--zero-stage", stage, "--finetune", train_iters=3, load=ck,
                              metrics_file=path)) == 0
        ft[stage] = train_losses(path)
    _resumed_matches(ft["3"], ft["0"], range(1, 4))
    assert abs(ft["3"][1] - ref[1]) > 1e-3 * ref[1], "finetune started from the initial weights"

    # 5. Export to Hugging Face: transformers gives the megalite model's logits.
    hf_dir = tmp_path / "hf"
    assert convert_cli.main(["megalite-to-hf", "--load", str(ck), "--save", str(hf_dir)]) == 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    model = GPTModel(cfg.model, ParallelState(), seed=1)
    model.load_state_dict(sd)
    model.eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    # 6. Offline reshard of the ZeRO-3 optimizer state: to stage 0, and to stage 3 at dp = 1
    #    (one unit-flat file); each resumes with the uninterrupted run's losses.
    for stage in ("0", "3"):
        out = tmp_path / f"reshard{stage}"
        assert convert_cli.main(["reshard", "--load", str(ck), "--save", str(out),
                                 "--tensor-model-parallel-size", "1",
                                 "--pipeline-model-parallel-size", "1", "--zero-stage", stage,
                                 "--data-parallel-size", "1"]) == 0
        files = sorted(os.listdir(out / "iter_0000005" / "mp_rank_00_000"))
        assert files == ([ckpt.MODEL_FILE] if stage == "0"
                         else ["distrib_optim_dp000.pt", ckpt.MODEL_FILE]), files
        if stage == "3":  # the offline unit layout is Zero3Model's (the loader's fast path)
            def units(*paths):  # per shard (unit), its parameters in order, over all DP ranks
                files = [torch.load(p, weights_only=True)["shards"] for p in paths]
                return [list(dict.fromkeys(g[0] for f in files for g in f[i]["segments"]))
                        for i in range(len(files[0]))]

            assert units(out / "iter_0000005" / "mp_rank_00_000" / "distrib_optim_dp000.pt") \
                == units(shard / "distrib_optim_dp000.pt", shard / "distrib_optim_dp001.pt")
        path = tmp_path / f"resumed{stage}.jsonl"
        assert run_main(flags("--zero-stage", stage, train_iters=ITERS, load=out,
                              metrics_file=path)) == 0
        _resumed_matches(train_losses(path), ref, range(6, ITERS + 1))

    # 7. The iteration-1 memory record: measured == 16Ψ/N with Ψ padded per unit (fp32: params
    #    are their own masters), and within the alignment padding of the unpadded formula (< 64
    #    elements per parameter, < lcm(N, 128) per unit).
    mem = read_metrics(str(whole), split="memory")[0]
    assert mem["zero_stage"] == 3 and mem["dp_size"] == 2, mem
    n, psi = 2, mem["num_params_local_padded"]
    assert mem["num_params_local"] == sum(v.numel() for v in plain.values())
    for key, per_param in (("params", 4), ("grads", 4), ("master_params", 0),
                           ("optimizer_states", 8)):
        assert mem[f"mem_{key}_bytes"] == mem[f"mem_theory_{key}_bytes"] == per_param * psi / n, key
    assert mem["mem_total_bytes"] == 16 * psi / n == mem["mem_theory_zero_paper_total_bytes"]
    num_units = cfg.model.num_layers + 1  # tied GPT-2: embedding+output, one per layer
    slack = 16 * (63 * len(plain) + (math.lcm(n, 128) - 1) * num_units) / n
    assert 0 <= mem["mem_total_bytes"] - mem["mem_theory_unpadded_total_bytes"] <= slack
    json.dumps(mem)  # the record is plain JSON


def test_zero3_run_loads_a_stage0_checkpoint_by_resharding(tmp_path, capsys):
    """A stage-3 run pointed at a stage-0 checkpoint (no per-DP-rank files) assembles its shard
    from the plain optimizer state on load (docs/checkpoints.md, "Resharding on load") and says
    so; with --no-load-optim it loads the weights, nothing resharded."""
    ck = tmp_path / "ck"
    assert run_main(flags(train_iters=2, save=ck, metrics_file=tmp_path / "a.jsonl")) == 0
    capsys.readouterr()
    assert run_main(flags("--zero-stage", "3", train_iters=3, load=ck,
                          metrics_file=tmp_path / "b.jsonl")) == 0
    out = capsys.readouterr().out
    assert "resharded on load" in out and "ZeRO optimizer" in out, out[-2000:]
    assert run_main(flags("--zero-stage", "3", "--no-load-optim", train_iters=3, load=ck,
                          metrics_file=tmp_path / "c.jsonl")) == 0
