"""ZeRO stage 3 (megalite.distributed.zero3 + megalite.optimizer.zero3_optimizer).

Parity (docs/design.md, contract 5): per-iteration losses and grad norms of a tiny training loop
equal the single-process GPTModel + torch.optim.AdamW run (rel 1e-4, 10 iterations), with dp 2 and
4, tp2 x dp2 with SP, and full recomputation. Memory: between steps each rank holds 16Ψ/N bytes
(fp32: params = masters, grads, two Adam moments; docs/theory.md) up to padding; during forward at
most depth + 1 = 2 units are gathered. Overlap: the next unit's all-gather is issued before the
current unit's forward ends (and is not, with prefetch off). Communication: the bytes counted by
megalite.collectives equal the 3Ψ-style prediction. Resume: per-rank state and, at another DP
size, the consolidated full state continue with the same losses.

Workers are grouped into two spawns (world 2 and world 4) to keep the file fast.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from model_utils import VOCAB, tiny_config

from megalite import collectives as C
from megalite.config import ConfigError, ExecutionConfig, OptimizerConfig
from megalite.memory import distinct_storage_bytes
from megalite.models import GPTModel
from megalite.parallel_state import ParallelState, initialize_model_parallel

ITERS = 6  # parity steps; the resume checks stop at ITERS // 2 = 3, with Adam state
GLOBAL_BATCH = 8
SEQ = 16
HP = dict(lr=2e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
          clip_grad=0.5, zero_stage=3)


def _batch(it: int):
    g = torch.Generator().manual_seed(1000 + it)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _reference(cfg, iters=ITERS, seed=7):
    """Single process: GPTModel + torch AdamW, same two groups, clip_grad_norm_."""
    torch.manual_seed(0)
    model = GPTModel(cfg, ParallelState(), seed=seed)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": HP["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=HP["lr"],
                            betas=(HP["adam_beta1"], HP["adam_beta2"]), eps=HP["adam_eps"])
    out = []
    for it in range(iters):
        tokens, labels = _batch(it)
        opt.zero_grad()
        loss = model(tokens, labels=labels).sum() / labels.numel()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), HP["clip_grad"])
        opt.step()
        out.append((loss.item(), norm.item()))
    return out


def _build(cfg, ps, seed=7, sequence_parallel=False, execution=ExecutionConfig(),
           **opt_overrides):
    from megalite.distributed.zero3 import shard_model_zero3
    from megalite.optimizer.zero3_optimizer import Zero3Optimizer

    oc = OptimizerConfig(**{**HP, **opt_overrides}).validate()
    model = shard_model_zero3(GPTModel(cfg, ps, seed=seed, sequence_parallel=sequence_parallel,
                                       execution=execution), ps, oc)
    return model, Zero3Optimizer(model, oc, ps)


def _train(model, opt, ps, iters, start=0, microbatches=2, on_step=None):
    """This DP rank's slice of each global batch, in micro-batches; loss / global token count."""
    out = []
    b = GLOBAL_BATCH // ps.dp_size
    for it in range(start, start + iters):
        tokens, labels = _batch(it)
        tokens, labels_local = (t[ps.dp_rank * b:(ps.dp_rank + 1) * b] for t in (tokens, labels))
        opt.zero_grad()
        total = torch.zeros(1)
        mb = b // microbatches
        for k in range(microbatches):
            sl = slice(k * mb, (k + 1) * mb)
            loss = model(tokens[sl], labels=labels_local[sl]).sum() / labels.numel()
            opt.scale_loss(loss).backward()
            total += loss.detach()
        if ps.dp_group is not None:
            dist.all_reduce(total, group=ps.dp_group)
        updated, norm, _ = opt.step()
        assert updated
        out.append((total.item(), norm))
        if on_step is not None:
            on_step(it)
    return out


def _assert_parity(got, ref, where, rel=1e-4):
    assert len(got) == len(ref), where
    for it, ((loss, norm), (rloss, rnorm)) in enumerate(zip(got, ref)):
        assert abs(loss - rloss) <= rel * abs(rloss), f"{where} iter {it}: loss {loss} vs {rloss}"
        assert abs(norm - rnorm) <= rel * abs(rnorm), f"{where} iter {it}: norm {norm} vs {rnorm}"


def _storage_bytes(model, opt) -> int:
    """Bytes of every distinct storage the sharded model and its optimizer hold (dedup by ptr)."""
    tensors = [p.data for p in model.parameters()] + list(opt.exp_avg) + list(opt.exp_avg_sq)
    for u in model.units:
        tensors += [u.shard, u.main, u.grad, u.full, u.full_grad]
    return distinct_storage_bytes(tensors)


# -------------------------------------------------------------------------------- world size 2
def _dp2_worker(rank, world_size):
    from megalite.distributed.zero3 import FORWARD
    from megalite.overlap import WeightGradStore
    from megalite.tensor_parallel.layers import enable_weight_grad_deferral

    ps = initialize_model_parallel(1, 1, backend="gloo", device="cpu", set_default=False)
    n = ps.dp_size
    # 1. gpt2 (tied embedding+output unit), fp32, 2 micro-batches: parity, memory, comm, overlap.
    cfg = tiny_config("gpt2", num_layers=3)
    ref = _reference(cfg)
    model, opt = _build(cfg, ps)
    assert all(p.data.numel() == 0 for p in model.parameters()), "params not placeholders"
    psi = sum(u.numel for u in model.units)
    assert psi == sum(p.numel() for p in GPTModel(cfg, ParallelState(), seed=7).parameters())
    memory = []

    def check_memory(it):
        memory.append(_storage_bytes(model, opt))

    model.record = True
    C.reset_bytes_sent()
    got = _train(model, opt, ps, ITERS, on_step=check_memory)
    _assert_parity(got, ref, "gpt2 dp2")
    # Communication: ITERS steps x 2 micro-batches, every byte predicted from the unit sizes.
    sent = C.bytes_sent()
    expect = model.expected_step_bytes(num_microbatches=2)
    for tag, nbytes in expect.items():
        assert sent.get(tag, 0) == ITERS * nbytes, (tag, sent.get(tag), ITERS * nbytes)
    # 3Ψ accounting on padded Ψ: the tied unit is gathered twice in forward (its two uses) and
    # not in backward (kept full after the head's forward; the embedding's backward reads no
    # weights); every layer once in forward and once in backward; everything reduce-scattered.
    padded = sum(u.padded for u in model.units)
    ring = (n - 1) / n * 4
    assert expect["zero3_reduce_scatter"] == 2 * int(padded * ring)
    tied = model.units[0]
    assert tied.name == "embedding+output" and len(tied.uses) == 2
    assert expect["zero3_all_gather_fwd"] == 2 * int(ring * (padded + tied.padded))
    assert expect["zero3_all_gather_bwd"] == 2 * int(ring * (padded - tied.padded))
    # Memory between iterations: 16 bytes per local element (shard = master, grad, m, v) exactly,
    # i.e. 16Ψ/N up to padding: parameters start at multiples of 64 elements, units end at
    # multiples of lcm(N, 128) (Megatron's alignment, param_and_grad_buffer.packed).
    shard_elems = model.shard_elements()
    assert all(m == 16 * shard_elems for m in memory), (memory, shard_elems)
    assert 16 * psi / n <= memory[-1] == 16 * padded / n
    assert all(o % 64 == 0 for u in model.units for o in u.offsets)
    assert all(u.padded % 128 == 0 for u in model.units)
    assert all(u.gathered_bytes() == 0 and u.full_grad.untyped_storage().nbytes() == 0
               for u in model.units)
    # Forward peak: never more than depth + 1 = 2 units' parameters gathered.
    two_largest = sum(sorted(u.full_bytes() for u in model.units)[-2:])
    assert model.peak_gathered_units[FORWARD] == 2
    assert model.peak_gathered_bytes[FORWARD] <= two_largest
    # Overlap: the all-gather of layer i+1 is issued before layer i's forward compute ends.
    model.reset_stats()
    _train(model, opt, ps, 1, start=ITERS, microbatches=1)
    trace = model.trace

    def first(what, unit, kind=""):
        return next(t for w, u, k, t in trace
                    if w == what and u == unit and (not kind or k == kind))

    names = [u.name for u in model.units]
    for a, b in zip(names[1:-1], names[2:]):
        assert first("ag_issue", b, "fwd") < first("fwd_end", a), (a, b)
    assert first("ag_issue", "embedding+output", "fwd") < first("fwd_end", names[-1])
    # ... and the reduce-scatter of a layer is issued before the next layer's backward begins.
    assert first("rs_issue", names[2]) < first("bwd_begin", names[1])

    # 2. Prefetch off: same numbers, but gathers start only when a unit is needed (the overlap
    #    assertion above would fail), and one unit is gathered at a time.
    model0, opt0 = _build(cfg, ps, zero3_prefetch_depth=0)
    model0.record = True
    _assert_parity(_train(model0, opt0, ps, 3), ref[:3], "gpt2 dp2 no prefetch")
    trace = model0.trace
    assert first("ag_issue", names[2], "fwd") > first("fwd_end", names[1])
    assert model0.peak_gathered_units[FORWARD] == 1

    # 3. llama (untied: embedding, layers, output units), full recomputation, depth 2.
    lcfg = tiny_config("llama", num_layers=3)
    lref = _reference(lcfg)
    rcfg = tiny_config("llama", num_layers=3)
    model, opt = _build(rcfg, ps, execution=ExecutionConfig(recompute_granularity="full"),
                        zero3_prefetch_depth=2)
    assert [u.name for u in model.units] == ["embedding", "layers.0", "layers.1", "layers.2",
                                             "output"]
    C.reset_bytes_sent()
    _assert_parity(_train(model, opt, ps, ITERS), lref, "llama dp2 recompute")
    assert model.peak_gathered_units[FORWARD] == 3  # depth + 1
    sent, expect = C.bytes_sent(), model.expected_step_bytes(2)
    for tag, nbytes in expect.items():
        assert sent.get(tag, 0) == ITERS * nbytes, (tag, sent.get(tag), ITERS * nbytes)

    # 4. Resume at the same DP size: per-rank state into a fresh (differently seeded) model.
    model, opt = _build(cfg, ps)
    first_half = _train(model, opt, ps, ITERS // 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model, opt = _build(cfg, ps, seed=99)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    second_half = _train(model, opt, ps, ITERS - ITERS // 2, start=ITERS // 2)
    _assert_parity(first_half + second_half, ref, "gpt2 dp2 resume")

    # 5. bf16: gathered in 16 bits, fp32 masters; close to the fp32 reference, and the same run
    #    as bf16 ZeRO-1/2: the gradients are reduced in fp32 at every stage. (Reduced in bf16,
    #    stage 3's losses differ by ~3e-5 and its grad norms by ~1e-3, relative.)
    from megalite.distributed.ddp import wrap_chunks
    from megalite.optimizer.distrib_optimizer import DistributedOptimizer

    bcfg = tiny_config("gpt2", num_layers=3, params_dtype="bfloat16")
    model, opt = _build(bcfg, ps)
    assert model.units[1].shard.dtype == torch.bfloat16
    assert model.units[1].main.dtype == torch.float32
    got = _train(model, opt, ps, 5)
    for (l, _), (r, _) in zip(got, ref):
        assert abs(l - r) <= 2e-2 * r, (l, r)
    for stage in (1, 2):
        oc = OptimizerConfig(**{**HP, "zero_stage": stage}).validate()
        chunks, _, _ = wrap_chunks([GPTModel(bcfg, ps, seed=7)], oc, ps)
        want = _train(chunks[0], DistributedOptimizer(chunks, oc, ps), ps, 5)
        for it, ((l, g), (wl, wg)) in enumerate(zip(got, want)):
            assert abs(l - wl) <= 2e-6 * wl and abs(g - wg) <= 1e-4 * wg, (stage, it, l, wl, g, wg)

    # 6. fp16 with dynamic loss scaling: an inf on one rank makes every rank skip the step.
    fcfg = tiny_config("gpt2", num_layers=2, params_dtype="float16")
    model, opt = _build(fcfg, ps, initial_loss_scale=2.0 ** 10, hysteresis=1)
    _train(model, opt, ps, 2)
    before = [u.main.clone() for u in model.units]
    tokens, labels = _batch(0)
    opt.zero_grad()
    opt.scale_loss(model(tokens[:2], labels=labels[:2]).sum() / labels.numel()).backward()
    if rank == 0:
        model.units[1].grad[0] = float("inf")
    scale = opt.get_loss_scale()
    updated, norm, _ = opt.step()
    assert not updated and not torch.isfinite(norm) and opt.get_loss_scale() == scale / 2
    assert all(torch.equal(a, u.main) for a, u in zip(before, model.units))

    # 7. Deferred weight gradients (zb-h1) are refused with a clear error.
    model, opt = _build(cfg, ps)
    store = WeightGradStore()
    enable_weight_grad_deferral([model], store)
    loss = model(tokens[:2], labels=labels[:2]).sum()
    with pytest.raises(RuntimeError, match="zb-h1"):
        with store.capture():
            loss.backward()
    return True


def test_zero3_dp2_parity_memory_overlap_comm_resume():
    assert all(run_distributed(_dp2_worker, 2, timeout=240))


# -------------------------------------------------------------------------------- world size 4
def _dp4_worker(rank, world_size):
    from megalite.distributed.zero3 import FORWARD

    cfg = tiny_config("gpt2", num_layers=2)
    ref = _reference(cfg)
    # 1. dp = 4, and export the full state at the midpoint.
    ps = initialize_model_parallel(1, 1, backend="gloo", device="cpu", set_default=False)
    model, opt = _build(cfg, ps)
    got = _train(model, opt, ps, ITERS // 2)
    full = opt.gather_full_state()
    _assert_parity(got + _train(model, opt, ps, ITERS - ITERS // 2, start=ITERS // 2), ref,
                   "gpt2 dp4")
    assert model.peak_gathered_units[FORWARD] == 2
    # The consolidated state has every parameter of the plain model, at its shape.
    plain = dict(GPTModel(cfg, ParallelState(), seed=7).named_parameters())
    assert set(full["params"]) == set(plain)
    assert all(full["params"][k]["master"].shape == plain[k].shape for k in plain)

    # 2. Resume at DP size 2 from the dp=4 full state (two independent dp=2 replicas).
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ps2 = ParallelState(rank=rank, world_size=world_size, dp_size=2, dp_rank=rank % 2,
                        dp_group=groups[rank // 2], dp_ranks=[rank // 2 * 2, rank // 2 * 2 + 1])
    model2, opt2 = _build(cfg, ps2, seed=99)
    opt2.load_full_state(full)
    got2 = _train(model2, opt2, ps2, ITERS - ITERS // 2, start=ITERS // 2)
    _assert_parity(got[: ITERS // 2] + got2, ref, "gpt2 dp4 -> dp2 resharded")
    with pytest.raises(ValueError, match="gather_full_state"):
        opt2.load_state_dict(opt.state_dict())

    # 3. tp 2 x dp 2 with sequence parallelism (SP norm/bias/position grads summed over TP).
    ps = initialize_model_parallel(2, 1, backend="gloo", device="cpu", set_default=False)
    assert ps.dp_size == 2
    for family in ("gpt2", "llama"):
        tp_ref = ref if family == "gpt2" else _reference(tiny_config("llama", num_layers=2))
        scfg = tiny_config(family, num_layers=2)
        model, opt = _build(scfg, ps, sequence_parallel=True)
        _assert_parity(_train(model, opt, ps, ITERS), tp_ref, f"{family} tp2 dp2 sp")
    return True


def test_zero3_dp4_tp2_sp_and_reshard_to_dp2():
    assert all(run_distributed(_dp4_worker, 4, timeout=240))


# ------------------------------------------------------------------------------ single process
def test_zero3_single_process_matches_reference():
    """dp = 1 (no torch.distributed; docs/design.md, contract 7): collectives are local copies."""
    cfg = tiny_config("gpt2", num_layers=2)
    model, opt = _build(cfg, ParallelState())
    _assert_parity(_train(model, opt, ParallelState(), 4), _reference(cfg, 4), "dp1")


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v", "dualpipev"])
def test_zero3_refuses_zero_bubble_schedule(schedule):
    """The zero-bubble schedules defer weight gradients to a W pass (a clear ConfigError, tied
    embeddings or not); 1F1B/interleaved run (tests/test_zero3_pipeline.py)."""
    from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig, TrainingConfig

    # 8 layers: the V schedules cut 2 chunks per rank, so the layer split itself is valid
    cfg = MegaliteConfig(model=ModelConfig(num_layers=8),
                         parallel=ParallelConfig(pipeline_model_parallel_size=2),
                         training=TrainingConfig(pipeline_schedule=schedule),
                         optimizer=OptimizerConfig(zero_stage=3))
    with pytest.raises(ConfigError, match=f"--zero-stage 3 does not support --pipeline-schedule "
                                          f"{schedule} "):
        cfg.validate()


# ---------------------------------------------------------------------------- pretrain.py e2e
def test_pretrain_zero_stage3_matches_single_device_and_resumes(tmp_path):
    """--zero-stage 3 through the real entry point (2 torchrun ranks): the same per-iteration
    losses as one process; a run resumed from its iteration-3 checkpoint continues identically."""
    from pretrain_utils import flags, read_metrics, run_cli, run_main, train_losses

    single, z3, resumed = (tmp_path / f"{n}.jsonl" for n in ("single", "z3", "resumed"))
    ck = tmp_path / "ck"
    assert run_main(flags(train_iters=6, metrics_file=single)) == 0
    proc = run_cli(flags("--zero-stage", "3", train_iters=6, metrics_file=z3, save=ck,
                         save_interval=3), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = train_losses(single), train_losses(z3)
    assert sorted(got) == sorted(ref) == list(range(1, 7))
    for it in ref:
        assert abs(got[it] - ref[it]) <= 1e-4 * abs(ref[it]), (it, got[it], ref[it])
    assert len({round(v, 5) for v in ref.values()}) >= 5
    mem = read_metrics(z3, "memory")[0]  # the run really was sharded
    assert mem["zero_stage"] == 3 and mem["dp_size"] == 2, mem
    # Resume from iteration 3 (model file from DP rank 0, per-DP-rank optimizer files).
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    proc = run_cli(flags("--zero-stage", "3", train_iters=6, metrics_file=resumed, load=ck),
                   nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = train_losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for it in again:
        assert abs(again[it] - got[it]) <= 1e-5 * abs(got[it]), (it, again[it], got[it])
