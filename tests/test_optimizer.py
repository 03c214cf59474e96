"""Optimizer: loss scaler, global-norm clipping, weight-decay groups, LR schedules, fp16/bf16."""

import math

import pytest
import torch

from model_utils import tiny_config

from megalite.config import OptimizerConfig
from megalite.models import GPTModel
from megalite.optimizer import OptimizerParamScheduler, build_optimizer
from megalite.optimizer.clip_grads import grad_norm_squared
from megalite.optimizer.grad_scaler import DynamicGradScaler
from megalite.optimizer.optimizer import MixedPrecisionOptimizer
from megalite.parallel_state import ParallelState


def _model(dtype="float32", seed=5):
    return GPTModel(tiny_config(params_dtype=dtype), ParallelState(), seed=seed)


def _backward(model, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, 17), generator=g)
    loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
    (loss * scale).backward()
    return loss


def test_dynamic_scaler_backs_off_and_grows():
    s = DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=1.0, growth_interval=3, hysteresis=1)
    s.update(found_inf=True)
    assert s.scale == 2.0 ** 9  # halved on overflow
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 2.0 ** 9  # not yet: window is 3 clean steps
    s.update(found_inf=False)
    assert s.scale == 2.0 ** 10  # doubled after the window
    h = DynamicGradScaler(initial_scale=8.0, min_scale=4.0, growth_interval=100, hysteresis=2)
    h.update(True)
    assert h.scale == 8.0  # hysteresis: the first overflow is tolerated
    h.update(True)
    assert h.scale == 4.0
    h.update(True)
    assert h.scale == 4.0  # never below min_scale
    sd = h.state_dict()
    h2 = DynamicGradScaler(initial_scale=1024.0)
    h2.load_state_dict(sd)
    assert h2.state_dict() == sd


def test_fp16_overflow_skips_step_and_halves_scale():
    model = _model("float16")
    cfg = OptimizerConfig(initial_loss_scale=2.0 ** 8, hysteresis=1, lr=1e-2)
    opt = build_optimizer([model], cfg, ParallelState())
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, scale=opt.get_loss_scale())
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    updated, grad_norm, _ = opt.step()
    assert not updated and not torch.isfinite(grad_norm)
    assert opt.get_loss_scale() == 2.0 ** 7
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # a clean step then updates the fp16 model from its fp32 masters
    opt.zero_grad()
    _backward(model, scale=opt.get_loss_scale())
    updated, grad_norm, _ = opt.step()
    assert updated and math.isfinite(grad_norm)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for p, m in zip(opt.model_params, opt.masters):
        assert p.dtype == torch.float16 and m.dtype == torch.float32
        torch.testing.assert_close(p.float(), m.to(torch.float16).float())


def test_grad_norm_and_clipping_match_torch():
    ref, model = _model(), _model()
    _backward(ref)
    _backward(model)
    params = [p for p in ref.parameters() if p.grad is not None]
    want = torch.nn.utils.clip_grad_norm_(params, max_norm=0.05).item()
    opt = build_optimizer([model], OptimizerConfig(clip_grad=0.05, lr=0.0, weight_decay=0.0),
                          ParallelState())
    got_norm = grad_norm_squared([p.grad for p in opt.model_params], ParallelState()).sqrt().item()
    assert abs(got_norm - want) <= 1e-6 * want
    updated, grad_norm, _ = opt.step()
    assert updated and abs(grad_norm - want) <= 1e-6 * want
    assert want > 0.05  # clipping was active
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-9, msg=name)


def test_no_weight_decay_on_1d_params():
    model = _model()
    opt = MixedPrecisionOptimizer([model], OptimizerConfig(weight_decay=0.1), ParallelState())
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    names_1d = {n for n, p in model.named_parameters() if p.dim() == 1}
    assert any("bias" in n for n in names_1d) and any("norm" in n for n in names_1d)
    # with zero gradients only the decayed group moves (decoupled decay: p -= lr * wd * p)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for g in opt.param_groups:
        g["lr"] = 0.1
    opt.step()
    for n, p in model.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, before[n]), n
        elif before[n].abs().sum() > 0:
            torch.testing.assert_close(p, before[n] * (1 - 0.1 * 0.1), msg=n)


class _Groups:
    def __init__(self):
        self.param_groups = [{"lr": None}]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "WSD", "inverse-square-root"])
def test_lr_schedule_shapes(style):
    s = OptimizerParamScheduler(_Groups(), max_lr=1.0, min_lr=0.1, warmup_steps=10,
                                decay_steps=110, decay_style=style, wsd_decay_steps=20)
    lrs = [s.get_lr(k) for k in range(130)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warmup
    assert all(b > a for a, b in zip(lrs[:9], lrs[1:10]))
    if style == "constant":
        assert all(x == 1.0 for x in lrs[10:])
        return
    if style == "inverse-square-root":
        assert lrs[40] == pytest.approx(math.sqrt(10 / 40))
        return
    assert all(b <= a + 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # non-increasing
    assert lrs[110] == pytest.approx(0.1) and lrs[129] == pytest.approx(0.1)
    if style == "linear":
        assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5)
    if style == "cosine":
        assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5)
        assert lrs[35] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    if style == "WSD":
        assert lrs[89] == 1.0 and lrs[100] == pytest.approx(0.1 + 0.9 * 0.5)
    # the scheduler writes the lr into the optimizer and its position survives a checkpoint
    opt = _Groups()
    s = OptimizerParamScheduler(opt, 1.0, 0.1, 10, 110, style, 20)
    for _ in range(37):
        s.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(lrs[37])
    s2 = OptimizerParamScheduler(_Groups(), 1.0, 0.1, 10, 110, style, 20)
    s2.load_state_dict(s.state_dict())
    assert s2.current_lr == s.current_lr


def test_bf16_keeps_fp32_masters_and_state_roundtrip():
    model = _model("bfloat16")
    opt = build_optimizer([model], OptimizerConfig(lr=1e-2), ParallelState())
    assert opt.get_loss_scale() == 1.0
    _backward(model)
    assert opt.step()[0]
    sd = opt.state_dict()
    model2 = _model("bfloat16")
    opt2 = build_optimizer([model2], OptimizerConfig(lr=1e-2), ParallelState())
    opt2.load_state_dict(sd)
    for a, b in zip(opt.masters, opt2.masters):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_zero_stage0_works_on_each_flat_buffer_at_once():
    """ZeRO 0 over DDP's flat buffers (bf16: an fp32 grad buffer, fp32 masters as views of one
    copy of the bf16 param buffer): zero_grad is one aten op per buffer and the step writes the
    model back with one copy per buffer, not one per parameter; the model equals its rounded
    masters after the step, and the buffer is zero after zero_grad."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from megalite.distributed.ddp import wrap_chunks

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func] += 1
            return func(*args, **(kwargs or {}))

    cfg = OptimizerConfig(lr=1e-2)
    chunks = wrap_chunks([_model("bfloat16")], cfg, ParallelState())[0]
    opt = build_optimizer(chunks, cfg, ParallelState())
    bufs = chunks[0].grad_buffers
    assert len(bufs) < len(opt.model_params)
    before = [p.detach().clone() for p in opt.model_params]
    _backward(chunks[0])
    mode = Ops()
    mode.ops = Counter()
    with mode:
        updated, _, _ = opt.step()
    assert updated and mode.ops[torch.ops.aten.copy_.default] == len(bufs), mode.ops
    for p, m, b in zip(opt.model_params, opt.masters, before):
        assert m.dtype == torch.float32 and torch.equal(p, m.to(p.dtype))
    assert any(not torch.equal(p, b) for p, b in zip(opt.model_params, before))
    assert any(b.grad_data.abs().sum() > 0 for b in bufs)
    mode.ops = Counter()
    with mode:
        opt.zero_grad()
    assert mode.ops == {torch.ops.aten.zero_.default: len(bufs)}, mode.ops
    assert all(b.grad_data.abs().sum() == 0 for b in bufs)


def _step_state(opt, sched) -> list:
    """Every tensor a step may change: masters, Adam moments and step counts, the schedule's
    count and lr, the model's parameters, and last the loss scaler's three (fp16)."""
    from megalite.optimizer.optimizer import ShardedAdamW

    if isinstance(opt, ShardedAdamW):
        ts = list(opt.masters) + list(opt.exp_avg) + list(opt.exp_avg_sq) + [opt.step_count]
        ts += [p for c in opt.chunks for p in c.parameters()]
    else:
        ts = list(opt.masters) + [v for st in opt.inner.state.values() for v in st.values()]
        ts += opt.model_params
    ts += [sched._count, sched.lr]
    sc = opt.grad_scaler
    ts += [sc.scale, sc._growth_tracker, sc._hysteresis_tracker] if sc is not None else []
    return [t.detach().clone() for t in ts]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_non_finite_step_is_skipped_on_the_device_bit_for_bit(zero):
    """A bf16 NaN loss or inf gradient (--check-for-nan-in-loss-and-grad: the loss is given)
    and an fp16 overflow: the step and the schedule read nothing on the host, and the model, the
    fp32 masters, the Adam moments, the step count and the schedule are bit for bit those before
    the skipped step, the loss scaler what a skip makes it (halved, hysteresis 1); the next step
    is applied and advances the schedule. ZeRO 0 (torch's fused kernels, given found_inf), 1
    and 3 (the masked foreach step), on one process."""
    from host_reads import HostReads

    from megalite.distributed.ddp import wrap_chunks
    from megalite.distributed.zero3 import shard_model_zero3

    ps = ParallelState()
    for dtype in ("bfloat16", "float16"):
        cfg = OptimizerConfig(lr=1e-2, zero_stage=zero, initial_loss_scale=2.0 ** 8,
                              hysteresis=1).validate()
        model = _model(dtype)
        chunks = [shard_model_zero3(model, ps, cfg)] if zero == 3 else \
            wrap_chunks([model], cfg, ps)[0]
        opt = build_optimizer(chunks, cfg, ps)
        sched = OptimizerParamScheduler(opt, 1e-2, 1e-3, 2, 10, "cosine", max_steps=10)

        def step(poison=None, loss=None):
            opt.zero_grad()
            _backward(chunks[0], scale=opt.get_loss_scale())
            if zero == 3:
                chunks[0].finalize_grads()
            else:
                chunks[0].finish_grad_sync()
            if poison is not None:  # one element of the reduced gradient
                grad = opt._grads()[0] if zero else chunks[0].grad_buffers[0].grad_data
                grad.view(-1)[0] = poison
            reads = HostReads()
            with reads:
                applied, norm, _ = opt.step(loss)
                sched.step(applied)
            assert sum(reads.per_iteration[0].values()) == 0, reads.per_iteration
            return applied, norm

        finite = torch.tensor(2.5) if dtype == "bfloat16" else None
        assert step(loss=finite)[0]  # moments and step counts are not zero any more
        bad = ([(None, torch.tensor(float("nan"))), (float("inf"), finite)]
               if dtype == "bfloat16" else [(float("inf"), None)])
        for poison, loss in bad:
            before = _step_state(opt, sched)
            applied, _ = step(poison, loss)
            after = _step_state(opt, sched)
            assert not applied, (dtype, poison)
            if dtype == "float16":
                assert [float(t) for t in after[-3:]] == [2.0 ** 7, 0, 0], after[-3:]
                before, after = before[:-3], after[:-3]
            for a, b in zip(before, after, strict=True):
                assert torch.equal(a, b), (zero, dtype, poison)
        applied, norm = step(loss=finite)
        assert applied and torch.isfinite(norm) and sched.num_steps == 2
