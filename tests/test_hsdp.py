"""HSDP (--num-distributed-optimizer-instances R, docs/data_parallel.md): the ZeRO state sharded
inside each of R instances of DP/R ranks and replicated across them equals one process (also
with half the optimizer state offloaded to the host), sends only each rank's shard across the
instances, and its checkpoints load at another R and stage; the planner models it.

All the pretrain.py runs of one world size share one spawn (tests/pretrain_utils.pretrain_cases,
strict mode), and every run equals one process's run of the same flags.
"""

from __future__ import annotations

import pytest
import torch

import test_zero
import test_zero3 as z3
from dist_utils import run_distributed
from pretrain_utils import assert_same_run, flags, pretrain_cases, read_metrics, run_main
from test_zero import BUCKET, assert_params_close, opt_config, parity_config, reference_run, train

from megalite import collectives as C
from megalite.arguments import parse_args
from megalite.config import ConfigError
from megalite.parallel_state import initialize_model_parallel, instance_groups

ITERS = 4


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The training records of one process (ZeRO 0, no HSDP) of the runs' model and data."""
    ref = tmp_path_factory.mktemp("one") / "ref.jsonl"
    assert run_main(flags(train_iters=ITERS, metrics_file=ref)) == 0
    return read_metrics(ref)


def _flags(stage: int, metrics, *extra, r: int = 2, **kw):
    return flags("--zero-stage", stage, "--num-distributed-optimizer-instances", r,
                 "--overlap-grad-reduce", "--ddp-bucket-size", "4000", *extra,
                 train_iters=ITERS, metrics_file=metrics, **kw)


def _traffic(rank):
    """DP4 R2 at ZeRO 1 through the test loop of test_zero.py: the parameters equal one process's
    and each step's bytes are the ring accounting of docs/data_parallel.md, "HSDP"."""
    cfg = parity_config()
    _, ref_params = reference_run(cfg, opt_config(), ITERS)
    ps = initialize_model_parallel(1, 1, distributed_optimizer_instances=2, backend="gloo",
                                   device="cpu", set_default=False)
    assert (ps.zero_size, ps.shard_ranks, ps.replicate_ranks) == (
        2, [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2])
    out = train(ps, cfg, opt_config(zero_stage=1, overlap_grad_reduce=True), ITERS,
                bucket_size=BUCKET)
    assert_params_close(out["params"], ref_params, 1e-5, "dp4 r2 zero1")
    g = sum(b.numel for b in out["chunks"][0].buckets) * 4  # fp32 gradient bytes, padded
    # overlapped: bucket 0's shard crosses the instances before the backward's last gradient
    ddp = out["chunks"][0]
    ddp.record_events = True
    tokens, labels = test_zero.global_batch(0)
    (ddp(tokens[:2], labels=labels[:2]).sum() / labels.numel()).backward()
    events = [(kind, what) for kind, what, _ in ddp.events]
    assert events.index(("cross", 0)) < max(i for i, e in enumerate(events) if e[0] == "hook")
    ddp.finish_grad_sync()
    # ZeRO-3: the units' shards cross the instances once a step, after the last micro-batch
    model, opt = z3._build(z3.tiny_config(), ps)
    C.reset_bytes_sent()
    z3._assert_parity(z3._train(model, opt, ps, 2), z3._reference(z3.tiny_config(), 2),
                      "dp4 r2 zero3", 1e-5)
    sent, expect = C.bytes_sent(), model.expected_step_bytes(2)
    assert {k: sent[k] for k in expect} == {k: 2 * v for k, v in expect.items()}
    shards = sum(u.shard_size for u in model.units) * 4
    assert sent["dp_replicate"] == 2 * shards and all(u.dp_size == 2 for u in model.units)
    return out["bytes"][-1], g


def _world4_worker(rank, world_size, runs):
    traffic = _traffic(rank)
    pretrain_cases(rank, world_size, runs)
    return traffic


def test_hsdp_equals_one_process_sends_the_shard_and_its_checkpoints_load_at_other_r_and_stage(
        tmp_path, one_process):
    ck = tmp_path / "ck"
    runs = {f"dp4 r2 zero{s}": _flags(s, tmp_path / f"z{s}.jsonl", "--overlap-param-gather")
            for s in (1, 2)}
    runs["dp4 r2 zero3"] = _flags(3, tmp_path / "z3.jsonl")
    runs["dp4 r2 zero1 offload"] = _flags(1, tmp_path / "off.jsonl", "--optimizer-cpu-offload",
                                          optimizer_offload_fraction=0.5)
    runs["cp2 dp2 r2 zero2"] = _flags(2, tmp_path / "cp.jsonl", context_parallel_size=2)
    runs["pp2 dp2 r2 zero1"] = _flags(1, tmp_path / "pp.jsonl", pipeline_model_parallel_size=2)
    runs["save"] = _flags(1, tmp_path / "save.jsonl", save=ck, exit_interval=2)
    runs["resume r1 zero1"] = _flags(1, tmp_path / "r1.jsonl", r=1, load=ck)
    runs["resume r2 zero3"] = _flags(3, tmp_path / "r2z3.jsonl", load=ck)
    sent, g = run_distributed(_world4_worker, 4, list(runs.values()), timeout=400)[0]
    want = one_process
    for name, argv in runs.items():
        got = read_metrics(argv[argv.index("--metrics-file") + 1])
        if name.startswith("resume"):  # iterations 3 and 4, after the save at 2
            assert [r["iteration"] for r in got] == [3, 4], name
            got = want[:2] + got
        assert_same_run(want, got[:ITERS] if name != "save" else got + want[2:], ITERS,
                        name=name)
    # the states are sharded over an instance: measured == docs/theory.md's bytes at N = DP/R
    for z in (1, 2, 3):
        mem = read_metrics(tmp_path / f"z{z}.jsonl", split="memory")[0]
        assert mem["dp_size"] == 2 and mem["mem_total_bytes"] == mem["mem_theory_total_bytes"], z
    # instance 0's shards, written as a DP/R = 2 run writes them: two files, no trace of R
    shard = ck / "iter_0000002" / "mp_rank_00_000"
    assert sorted(p.name for p in shard.iterdir() if p.name.startswith("distrib")) == [
        "distrib_optim_dp000.pt", "distrib_optim_dp001.pt"]
    assert torch.load(shard / "distrib_optim_dp000.pt", weights_only=False)["dp_size"] == 2
    dp, r = 4, 2
    # inside the instance: a reduce-scatter over DP/R; across: the all-reduce of the G/(DP/R) shard
    assert sent["dp_grad_reduce_scatter"] == (dp // r - 1) * g // (dp // r)
    assert sent["dp_replicate"] == 2 * (r - 1) * g // (r * (dp // r)) == g // 2
    assert sent["dp_replicate"] < 3 * g // 4  # a flat reduce-scatter over DP4 sends 3G/4


def test_tp2_dp4_r2_equals_one_process(tmp_path, one_process):
    """TP 2 x DP 4 with R 2 (8 ranks): each instance is a node's TP 2 x DP 2."""
    runs = {z: _flags(z, tmp_path / f"z{z}.jsonl", "--sequence-parallel",
                      tensor_model_parallel_size=2) for z in (1, 3)}
    assert all(run_distributed(pretrain_cases, 8, list(runs.values()), timeout=400))
    for z, argv in runs.items():
        assert_same_run(one_process, read_metrics(argv[argv.index("--metrics-file") + 1]), ITERS,
                        name=f"tp2 dp4 r2 zero{z}")


def test_hsdp_bad_input_is_one_line():
    with pytest.raises(ConfigError, match="needs --zero-stage 1, 2 or 3"):
        parse_args(flags("--num-distributed-optimizer-instances", "2"))
    with pytest.raises(ConfigError, match="with --num-experts"):
        parse_args(flags("--num-distributed-optimizer-instances", "2", "--zero-stage", "1",
                         "--num-experts", "4"))
    dp_cp = [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ConfigError, match=r"instances 4 must divide the data-parallel size \(6"):
        instance_groups(dp_cp, 6, 4, 1, None)
    with pytest.raises(ConfigError, match="straddles the nodes of 4 ranks"):
        instance_groups(dp_cp, 6, 2, 3, 4)  # instances of 3 ranks on nodes of 4
    shard, replicate = instance_groups(dp_cp, 6, 3, 2, 8)
    assert shard == [[0, 1], [2, 3], [4, 5]] and replicate == [[0, 2, 4], [1, 3, 5]]


def test_planner_models_hsdp():
    """R instances of a node each: the states of a ZeRO run of DP/R ranks, and the shard's
    all-reduce over the network, 2(R-1)/R x G/(DP/R) bytes, in the DP time."""
    from megalite.config import ModelConfig
    from megalite.planner import GPUS, Cluster, Layout, Model, memory, step_time

    m = Model.from_config(ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16,
                                      seq_length=1024, vocab_size=32000))
    cl = Cluster(32, 8, GPUS["H100-80GB"])
    flat, node = Layout(data_parallel_size=32, zero_stage=1), Layout(data_parallel_size=8,
                                                                      zero_stage=1)
    hsdp = Layout(data_parallel_size=32, zero_stage=1, num_distributed_optimizer_instances=4)
    assert memory(m, hsdp, 64)["optimizer"] == memory(m, node, 64)["optimizer"] \
        > memory(m, flat, 64)["optimizer"]
    t = step_time(m, hsdp, cl, 64)
    g = 4 * m.cfg.num_parameters()
    assert t["dp_replicate_bytes"] == pytest.approx(2 * 3 / 4 * g / 8)
    slow = step_time(m, flat, cl, 64)  # flat ZeRO: every ring crosses the nodes
    assert 0 < t["dp_replicate_s"] <= t["dp_comm_s"] < slow["dp_comm_s"]
    assert slow["dp_replicate_s"] == 0
