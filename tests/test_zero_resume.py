"""A ZeRO checkpoint resumes at a different data-parallel size (through pretrain.py).

5 iterations at dp=2 with --zero-stage 1 save one optimizer shard per DP rank; resuming at dp=1
(stage 1) and at dp=4 (stage 2) merges the shards into the unsharded state and re-splits it
(checkpoint.load._load_dp_sharded_optimizer_state -> optim_state.merge_shard_state_dicts), so
iterations 6-10 match the uninterrupted dp=2 run.
"""


from pretrain_utils import flags, read_metrics, run_cli, run_main, train_losses


def _zero_flags(*extra, **kw):
    return flags("--overlap-grad-reduce", "--ddp-bucket-size", "4000", *extra, **kw)


def test_zero1_checkpoint_resumes_at_other_dp_sizes(tmp_path):
    whole, first = tmp_path / "whole.jsonl", tmp_path / "first.jsonl"
    ck = tmp_path / "ck"
    proc = run_cli(_zero_flags("--zero-stage", "1", "--overlap-param-gather", train_iters=10,
                               metrics_file=whole), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(_zero_flags("--zero-stage", "1", train_iters=10, exit_interval=5, save=ck,
                               metrics_file=first), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = sorted(p.name for p in (ck / "iter_0000005" / "mp_rank_00_000").iterdir())
    assert "distrib_optim_dp000.pt" in shards and "distrib_optim_dp001.pt" in shards

    ref = train_losses(whole)
    assert sorted(ref) == list(range(1, 11))
    assert train_losses(first) == {i: ref[i] for i in range(1, 6)}
    resumed = {}
    dp1 = tmp_path / "dp1.jsonl"
    assert run_main(_zero_flags("--zero-stage", "1", train_iters=10, load=ck,
                                save=tmp_path / "ck_dp1", metrics_file=dp1)) == 0
    resumed["dp=1 stage 1"] = train_losses(dp1)
    dp4 = tmp_path / "dp4.jsonl"
    proc = run_cli(_zero_flags("--zero-stage", "2", train_iters=10, load=ck,
                               save=tmp_path / "ck_dp4", metrics_file=dp4), nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed["dp=4 stage 2"] = train_losses(dp4)
    for where, got in resumed.items():
        assert sorted(got) == list(range(6, 11)), (where, sorted(got))
        for it in got:
            rel = abs(got[it] - ref[it]) / abs(ref[it])
            assert rel <= 1e-5, f"{where}: iteration {it} loss {got[it]} vs {ref[it]}"
    # not trivially equal: training moved the loss
    assert len({round(v, 5) for v in ref.values()}) >= 8
    # the memory record of iteration 1 equals docs/theory.md's formula (padded Ψ)
    mem = read_metrics(whole, split="memory")[0]
    assert mem["zero_stage"] == 1 and mem["dp_size"] == 2
    assert mem["mem_total_bytes"] == mem["mem_theory_total_bytes"]


def test_checkpoints_of_the_unaligned_layout_still_load(tmp_path, monkeypatch):
    """Checkpoints saved before parameters were aligned to 64 elements and buckets / ZeRO-3 units
    to lcm(N, 128) (alignment 1 is that layout: end to end, padded to a multiple of N) resume
    through the merge by parameter name and offset, as the uninterrupted run continues. (Files in
    the older per-stage formats are tests/test_optimizer_formats.py's.)"""
    from megalite.distributed import param_and_grad_buffer as pgb

    for stage in ("1", "3"):
        whole, part = tmp_path / f"whole{stage}.jsonl", tmp_path / f"part{stage}.jsonl"
        ck = tmp_path / f"ck{stage}"
        assert run_main(_zero_flags("--zero-stage", stage, train_iters=4,
                                    metrics_file=whole)) == 0
        with monkeypatch.context() as m:
            m.setattr(pgb, "PARAM_ALIGNMENT", 1)
            m.setattr(pgb, "BUCKET_ALIGNMENT", 1)
            assert run_main(_zero_flags("--zero-stage", stage, train_iters=4, exit_interval=2,
                                        save=ck)) == 0
        assert run_main(_zero_flags("--zero-stage", stage, train_iters=4, load=ck,
                                    metrics_file=part)) == 0
        ref, got = train_losses(whole), train_losses(part)
        assert sorted(got) == [3, 4] and len({round(v, 5) for v in ref.values()}) == 4
        for it in got:
            assert abs(got[it] - ref[it]) <= 1e-5 * abs(ref[it]), (stage, it, got[it], ref[it])
