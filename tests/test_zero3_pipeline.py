"""ZeRO-3 with pipeline parallelism: each pipeline chunk is sharded on its own (docs/zero3.md).

Parity (docs/design.md, contract 5) through pretrain.py: pp 2 x dp 2 at --zero-stage 3 gives the
single-process losses and grad norms (rel 1e-4) with 1F1B (tied GPT-2 embedding split over the two
stages: the two copies are one-parameter units whose gradient shards are all-reduced over the
embedding group; without that all-reduce the grad norms differ by ~10% from iteration 1) and with
interleaved 1F1B (two chunks per rank). The 1F1B run's checkpoint resumes at pp 2 x dp 1 (shards
merged by name) with the same losses, and its per-rank unit layout is the one the offline
converter rebuilds (checkpoint/optim_state.zero3_units).
"""

from __future__ import annotations

import pytest
import torch

from pretrain_utils import flags, read_metrics, run_cli, run_main

from megalite.checkpoint import format as ckpt

ITERS = 6


def _losses_and_norms(path):
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in read_metrics(str(path))}


def _assert_match(got, ref, iters, rel):
    assert sorted(got) == list(iters), sorted(got)
    for it in iters:
        for what, a, b in zip(("loss", "grad norm"), got[it], ref[it]):
            assert abs(a - b) <= rel * abs(b), f"iteration {it} {what}: {a} vs {ref[it]}"


@pytest.mark.parametrize("layers,extra", [
    (2, []),  # 1F1B, one chunk per rank
    (4, ["--num-layers-per-virtual-pipeline-stage", "1"]),  # interleaved, two chunks per rank
], ids=["1f1b", "interleaved"])
def test_zero3_pp2_dp2_matches_single_device(tmp_path, layers, extra):
    single, piped = tmp_path / "single.jsonl", tmp_path / "pp.jsonl"
    base = flags(train_iters=ITERS, num_layers=layers)
    assert run_main(base + ["--metrics-file", str(single)]) == 0
    ck = tmp_path / "ck"
    save = ["--save", str(ck), "--save-interval", "3"] if not extra else []
    proc = run_cli(base + ["--zero-stage", "3", "--pipeline-model-parallel-size", "2",
                           "--metrics-file", str(piped)] + extra + save, nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = _losses_and_norms(single), _losses_and_norms(piped)
    assert len({round(v[1], 4) for v in ref.values()}) >= 5  # training moved
    _assert_match(got, ref, range(1, ITERS + 1), rel=1e-4)
    mem = read_metrics(str(piped), split="memory")[0]
    assert mem["zero_stage"] == 3 and mem["dp_size"] == 2, mem
    if extra:
        return

    # Resume the pp 2 x dp 2 checkpoint of iteration 3 at pp 2 x dp 1.
    (ck / ckpt.TRACKER_FILE).write_text("3")
    resumed = tmp_path / "resumed.jsonl"
    proc = run_cli(base + ["--zero-stage", "3", "--pipeline-model-parallel-size", "2",
                           "--load", str(ck), "--metrics-file", str(resumed)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_match(_losses_and_norms(resumed), got, range(4, ITERS + 1), rel=1e-5)

    # The offline converter rebuilds each stage's unit layout (shared-embedding units included):
    # its files list the same segments (parameter, position, shape) as the saving run's.
    from megalite.checkpoint.layout import Layout, chunks_of
    from megalite.checkpoint.optim_state import OptimCommon, zero3_units, zero_target

    cfg = ckpt.read_checkpoint_config(str(ck))
    layout = Layout.of_config(cfg)
    for r, chunks in enumerate(chunks_of(layout, cfg.model.num_layers)):
        rebuilt = zero_target("zero3", cfg.model, chunks, layout.pp, layout.tp, 2,
                              cfg.optimizer).files(OptimCommon(), cfg.optimizer)
        for d in range(2):
            sd = torch.load(ck / "iter_0000003" / ckpt.shard_dir_name(0, r)
                            / ckpt.distrib_optim_name(d), weights_only=True)
            assert [s["segments"] for s in sd["shards"]] == \
                [s["segments"] for s in rebuilt[d]["shards"]], (r, d)
    units = [u for u, _ in zero3_units(cfg.model, chunks, layout.pp, layout.tp)]
    assert units[-2:] == ["output", "output_layer"], units  # the last stage's tied copy
