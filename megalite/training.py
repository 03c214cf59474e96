"""The training loop: ``pretrain(cfg)`` builds everything from a MegaliteConfig and trains.

Order of construction (each step's object feeds the next; config flows one way, docs/design.md
"Conventions"): process groups -> tokenizer (fixes the vocab) -> seeded model chunks ->
data-parallel wrapping -> optimizer -> LR schedule -> checkpoint -> datasets -> loop.

The loss contract (docs/design.md, contract 4): a global batch is ``global_batch_size`` samples
whatever the layout; each micro-batch's loss is ``sum(per_token_loss * loss_mask) / N`` where N is
the number of loss tokens in the whole *global* batch, counted up front by summing this rank's
micro-batch masks and all-reducing over the DP group. Summing those losses over micro-batches and
(through the DP all-reduce SUM of gradients) over DP ranks gives exactly the single-device mean loss
and its gradient.

Seams other parts plug into:
  * :func:`wrap_model_for_data_parallel` -- the one place data parallelism is applied (bucketed
    DDP for ZeRO stages 0-2, parameter sharding for stage 3);
  * ``megalite.optimizer.build_optimizer`` -- plain AdamW or the ZeRO DistributedOptimizer;
  * ``megalite.pipeline_parallel.schedules.get_forward_backward_func`` and
    ``megalite.pipeline_parallel.partition.build_model_chunks`` -- schedules and stage cuts;
  * ``megalite.logging.log_metrics`` -- extra scalars from anywhere.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Callable, List, Optional, Tuple

import torch

from megalite import checkpointing
from megalite import collectives as C
from megalite.arguments import validate_for_world
from megalite.config import ConfigError, MegaliteConfig
from megalite.logging import (
    MetricsLogger,
    model_flops_per_sequence,
    peak_flops_per_device,
    set_active_logger,
    training_log_line,
)
from megalite.optimizer import OptimizerParamScheduler, build_optimizer
from megalite.parallel_state import (
    ParallelState,
    initialize_model_parallel,
    peak_memory_bytes,
    synchronize,
)
from megalite.pipeline_parallel.partition import build_model_chunks
from megalite.pipeline_parallel.schedules import get_forward_backward_func
from megalite.tensor_parallel.random import (
    get_all_rng_states,
    model_parallel_seed,
    set_all_rng_states,
)


def world_group():
    """The world as a group for megalite.collectives (whose ``None`` means "no peers")."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a NaN loss in bf16/fp32); the message says why."""


# ------------------------------------------------------------------------------------------------
# Seams
# ------------------------------------------------------------------------------------------------
def wrap_model_for_data_parallel(model_chunks: List[torch.nn.Module], cfg: MegaliteConfig,
                                 ps: ParallelState
                                 ) -> Tuple[List[torch.nn.Module], Optional[Callable], Callable]:
    """Apply data parallelism. Returns (chunks, no_sync_func, finalize_model_grads_func).

    Stages 0-2: each chunk is wrapped in megalite.distributed.DistributedDataParallel (contiguous
    fp32 grad buffers, bucketed all-reduce / reduce-scatter, overlapped with backward under
    --overlap-grad-reduce); ``no_sync_func`` defers the DP reduction to the last micro-batch and
    the finalize function waits for it, then all-reduces SP grads over TP and tied-embedding grads
    over the embedding group (docs/data_parallel.md). Stage 3 shards the parameters themselves
    (megalite/distributed/zero3.py).
    """
    if cfg.optimizer.zero_stage <= 2:
        from megalite.distributed.ddp import wrap_chunks

        return wrap_chunks(model_chunks, cfg.optimizer, ps)
    # stage 3: parameter sharding (docs/zero3.md); OptimizerConfig.validate admits only 0-3
    from megalite.distributed.zero3 import wrap_chunks_zero3

    return wrap_chunks_zero3(model_chunks, cfg, ps)


def build_data(cfg: MegaliteConfig, ps: ParallelState, seq_length: int):
    """(tokenizer, train_ds, valid_ds, test_ds, loader_fn, get_batch_fn) from megalite.data."""
    from megalite.data import (
        build_data_loader,
        build_pretraining_datasets,
        build_tokenizer,
        get_batch,
    )

    tr = cfg.training
    tokenizer = build_tokenizer(cfg.data, cache_dir=cfg.data.data_cache_path)
    gbs = tr.global_batch_size
    # Validation re-reads the same eval_iters global batches at every evaluation, so successive
    # validation losses are comparable (Megatron instead walks on through the validation set).
    n_train = tr.train_iters * gbs
    n_eval = max(tr.eval_iters, 1) * gbs  # (0 would mean 'one epoch' to the builder)
    train_ds, valid_ds, test_ds = build_pretraining_datasets(
        cfg.data, tokenizer, seq_length, tr.seed, num_samples=(n_train, n_eval, n_eval),
        cache_dir=cfg.data.data_cache_path)
    return tokenizer, train_ds, valid_ds, test_ds, build_data_loader, get_batch


def unigram_entropy(dataset, max_samples: int = 2000) -> Tuple[float, int]:
    """Entropy (nats) of the token frequencies of the first samples of ``dataset``.

    A model that ignores context cannot beat this cross-entropy, so validation loss well below it
    shows the model learned more than token frequencies.
    """
    counts = None
    n = 0
    for i in range(min(len(dataset), max_samples)):
        tok = torch.as_tensor(dataset[i]["tokens"]).long().flatten()
        bc = torch.bincount(tok)
        if counts is None:
            counts = bc
        else:
            if bc.numel() > counts.numel():
                bc, counts = counts, bc
            counts[: bc.numel()] += bc
        n += tok.numel()
    if not n:
        return float("nan"), 0
    p = counts[counts > 0].double() / n
    return float(-(p * p.log()).sum()), n


# ------------------------------------------------------------------------------------------------
# One step
# ------------------------------------------------------------------------------------------------
def _loss_func(loss_mask: torch.Tensor, num_global_tokens: torch.Tensor, output: torch.Tensor):
    """Contract loss: this micro-batch's summed token loss over the GLOBAL batch's token count."""
    mask = loss_mask.to(output.dtype if output.is_floating_point() else torch.float32)
    loss_sum = (output.float() * mask.float()).sum()
    loss = loss_sum / num_global_tokens
    return loss, {"lm_loss_sum": loss_sum.detach(), "num_tokens": mask.sum().detach()}


def _forward_step(num_global_tokens: torch.Tensor, data_iterator, model):
    tokens, labels, loss_mask, position_ids = next(data_iterator)
    output = model(tokens, labels=labels, position_ids=position_ids)
    return output, partial(_loss_func, loss_mask, num_global_tokens)


class Trainer:
    """State of one pretraining run; ``pretrain`` drives it."""

    def __init__(self, cfg: MegaliteConfig, ps: ParallelState):
        self.cfg = cfg
        self.ps = ps

    def _micro_batches(self, it, m: int):
        out = []
        for _ in range(m):
            mb = next(it)
            tokens, labels, loss_mask, position_ids = self.get_batch(
                mb, self.eod, self.cfg.data.eod_mask_loss)
            dev = self.ps.device
            out.append((tokens.to(dev), labels.to(dev), loss_mask.to(dev).float(),
                        position_ids.to(dev) if position_ids is not None else None))
        return out

    def _global_token_count(self, batches) -> torch.Tensor:
        n = torch.zeros(1, dtype=torch.float32, device=self.ps.device)
        for b in batches:
            n += b[2].sum()
        C.all_reduce(n, group=self.ps.dp_group, tag="loss_token_count")
        return n.clamp_min(1.0).squeeze(0)

    def _data_iterator(self, batches):
        # One iterator per rank (the schedule contract's recommended form): the schedule takes the
        # m micro-batches in order on every pipeline rank and hands each chunk the one it runs.
        return iter(batches)

    def _reduce_loss(self, stats_list) -> Tuple[float, float]:
        """(sum of token losses, token count) over the whole global batch, on every rank.

        Only the last pipeline stage has losses, and its TP ranks hold identical copies: TP rank 0
        of the last stage contributes, then a world all-reduce hands the result to every rank
        (rank 0 logs; every rank sees a NaN and stops together).
        """
        t = torch.zeros(2, dtype=torch.float64, device=self.ps.device)
        if self.ps.is_pipeline_last_stage and self.ps.tp_rank == 0:
            for s in stats_list:
                t[0] += float(s["lm_loss_sum"])
                t[1] += float(s["num_tokens"])
        C.all_reduce(t, group=world_group(), tag="loss_report")
        return float(t[0]), float(t[1])

    def train_step(self, batches):
        cfg, ps = self.cfg, self.ps
        tr = cfg.training
        num_global_tokens = self._global_token_count(batches)
        self.optimizer.zero_grad()
        stats = self.forward_backward(
            forward_step_func=partial(_forward_step, num_global_tokens),
            data_iterator=self._data_iterator(batches), model=self.chunks,
            num_microbatches=len(batches), seq_length=cfg.model.seq_length,
            micro_batch_size=tr.micro_batch_size, parallel_state=ps, forward_only=False,
            grad_scale_func=self.optimizer.scale_loss, no_sync_func=self.no_sync_func,
            finalize_model_grads_func=self.finalize_fn, timing_log_level=tr.timing_log_level)
        updated, grad_norm, num_zeros = self.optimizer.step()
        if updated:
            self.scheduler.step()
        loss_sum, ntok = self._reduce_loss(stats)
        return loss_sum / max(ntok, 1.0), updated, grad_norm

    @torch.no_grad()
    def evaluate(self) -> Tuple[float, float]:
        cfg, ps = self.cfg, self.ps
        tr = cfg.training
        # Evaluation must not perturb training randomness (a DataLoader iterator draws a seed from
        # the global generator): otherwise --eval-interval would change the training run, and a
        # resumed run would differ from an uninterrupted one.
        rng = get_all_rng_states(ps.device)
        for c in self.chunks:
            c.eval()
        it = iter(self.build_loader(self.valid_ds, 0, tr.micro_batch_size, ps.dp_rank, ps.dp_size,
                                    num_workers=cfg.data.num_workers))
        m = tr.num_micro_batches(ps.dp_size)
        total, ntok = 0.0, 0.0
        for _ in range(tr.eval_iters):
            batches = self._micro_batches(it, m)
            n = self._global_token_count(batches)
            stats = self.forward_backward(
                forward_step_func=partial(_forward_step, n),
                data_iterator=self._data_iterator(batches), model=self.chunks,
                num_microbatches=m, seq_length=cfg.model.seq_length,
                micro_batch_size=tr.micro_batch_size, parallel_state=ps, forward_only=True)
            s, k = self._reduce_loss(stats)
            total, ntok = total + s, ntok + k
        for c in self.chunks:
            c.train()
        set_all_rng_states(rng, ps.device)
        loss = total / max(ntok, 1.0)
        return loss, math.exp(min(loss, 50.0))


def _vpp_layers_per_stage(cfg: MegaliteConfig) -> Optional[int]:
    if cfg.training.num_layers_per_virtual_pipeline_stage is not None:
        return cfg.training.num_layers_per_virtual_pipeline_stage
    v = cfg.parallel.virtual_pipeline_model_parallel_size
    if v is None:
        return None
    L, p = cfg.model.num_layers, cfg.parallel.pipeline_model_parallel_size
    if L % (p * v) != 0:
        raise ConfigError(f"--num-layers ({L}) must be divisible by --pipeline-model-parallel-size "
                          f"({p}) x --num-virtual-stages-per-pipeline-rank ({v})")
    return L // (p * v)


# ------------------------------------------------------------------------------------------------
# pretrain
# ------------------------------------------------------------------------------------------------
def pretrain(cfg: MegaliteConfig, ps: Optional[ParallelState] = None, stream=None) -> dict:
    """Train as configured; returns a summary (final iteration, last losses) for scripts/tests."""
    par, ck = cfg.parallel, cfg.checkpoint
    if ps is None:
        ps = initialize_model_parallel(
            par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
            backend=par.distributed_backend, device=par.device,
            timeout_minutes=par.distributed_timeout_minutes)
    validate_for_world(cfg, ps.world_size)
    ps.vpp_size = par.virtual_pipeline_model_parallel_size
    t_start = time.time()
    if ck.load and ck.use_checkpoint_args:
        checkpointing.apply_checkpoint_args(cfg)

    trainer = Trainer(cfg, ps)
    logger = MetricsLogger(cfg, is_writer=(ps.rank == 0), stream=stream)
    set_active_logger(logger)
    try:
        return _run(cfg, ps, trainer, logger, t_start)
    finally:
        set_active_logger(None)
        logger.close()


def _run(cfg: MegaliteConfig, ps: ParallelState, trainer: Trainer, logger: MetricsLogger,
         t_start: float) -> dict:
    tr, ck = cfg.training, cfg.checkpoint
    gbs, s = tr.global_batch_size, cfg.model.seq_length

    # Data first: the tokenizer fixes the vocab size, which fixes the embedding shape.
    tokenizer, train_ds, valid_ds, _test_ds, build_loader, get_batch = build_data(cfg, ps, s)
    cfg.model.vocab_size = int(tokenizer.vocab_size)
    cfg.model.validate(ps.tp_size)
    trainer.eod, trainer.get_batch, trainer.build_loader = tokenizer.eod, get_batch, build_loader
    trainer.valid_ds = valid_ds

    model_parallel_seed(tr.seed, ps.tp_rank, ps.pp_rank, ps.device)
    chunks = build_model_chunks(
        cfg.model, ps, seed=tr.seed,
        num_layers_per_virtual_pipeline_stage=_vpp_layers_per_stage(cfg),
        decoder_first_pipeline_num_layers=tr.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=tr.decoder_last_pipeline_num_layers,
        device=ps.device)
    chunks, no_sync_func, finalize_fn = wrap_model_for_data_parallel(chunks, cfg, ps)
    optimizer = build_optimizer(chunks, cfg.optimizer, ps)
    scheduler = OptimizerParamScheduler.from_config(optimizer, cfg.optimizer, tr.train_iters)
    trainer.chunks, trainer.optimizer, trainer.scheduler = chunks, optimizer, scheduler
    trainer.no_sync_func, trainer.finalize_fn = no_sync_func, finalize_fn
    trainer.forward_backward = get_forward_backward_func(
        ps.pp_size, cfg.parallel.virtual_pipeline_model_parallel_size, tr.pipeline_schedule)

    iteration, consumed, rng_state = 0, 0, None
    if ck.load:
        iteration, consumed, rng_state = checkpointing.load_checkpoint(
            cfg, chunks, optimizer, scheduler, ps)
        if iteration or ck.finetune:
            what = ("weights only" if ck.finetune else
                    "weights, data position" + ("" if ck.no_load_optim else ", optimizer")
                    + ("" if ck.no_load_rng else ", RNG"))
            logger.print(f" loaded checkpoint {ck.load} at iteration {iteration} ({what})")
    run_id = checkpointing.new_run_id(ps)
    if ck.save and ps.rank == 0:
        import os

        os.makedirs(ck.save, exist_ok=True)
        checkpointing.save_tokenizer(ck.save, tokenizer, ps)

    n_params = cfg.model.num_parameters()
    summary = {"train_losses": {}, "valid": {}, "iteration": iteration}
    logger.print(f" megalite: world size {ps.world_size} | tp {ps.tp_size} "
                 f"pp {ps.pp_size} dp {ps.dp_size} | device {ps.device} | "
                 f"{n_params / 1e6:.2f}M parameters | vocab {cfg.model.vocab_size} | "
                 f"{cfg.optimizer.params_dtype}")
    if ps.rank == 0 and not tr.skip_train and train_ds is not None:
        ent, ntok = unigram_entropy(train_ds)
        summary["unigram_entropy"] = ent
        logger.print(f" unigram entropy of the training tokens: {ent:.4f} nats "
                     f"(perplexity {math.exp(ent):.1f}, over {ntok} tokens): a model that ignores "
                     f"context cannot reach a lower loss")
        logger.log({"unigram_entropy": ent, "unigram_ppl": math.exp(ent), "tokens": ntok,
                    "num_parameters": n_params}, iteration, split="data")

    flops_per_iter = model_flops_per_sequence(cfg.model, cfg.model.padded_vocab_size(ps.tp_size)) \
        * gbs
    peak = peak_flops_per_device(ps.device, cfg.optimizer.params_dtype) \
        if cfg.logging.log_throughput and ps.rank == 0 else float("nan")
    m = tr.num_micro_batches(ps.dp_size)

    def do_eval(it: int) -> None:
        if tr.eval_iters <= 0 or valid_ds is None:
            return
        loss, ppl = trainer.evaluate()
        summary["valid"][it] = loss
        logger.print(f" validation at iteration {it} | lm loss: {loss:.6E} | lm loss PPL: "
                     f"{ppl:.3f}")
        logger.log({"lm_loss": loss, "ppl": ppl}, it, split="valid")

    def do_save(it: int, consumed_samples: int) -> None:
        path = checkpointing.save_checkpoint(ck.save, it, chunks, optimizer, scheduler,
                                             consumed_samples, cfg, ps, run_id)
        logger.print(f" saved checkpoint {path}")

    if tr.skip_train:
        do_eval(iteration)
        return summary

    loader = build_loader(train_ds, consumed, tr.micro_batch_size, ps.dp_rank, ps.dp_size,
                          num_workers=cfg.data.num_workers)
    data_it = iter(loader)
    if rng_state is not None:
        set_all_rng_states(rng_state, ps.device)  # right before the first step: bit-exact resume

    interval = {"loss": 0.0, "n": 0, "time": 0.0, "grad_norm": None, "skipped": 0}
    total_skipped = 0
    saved_at = None
    times: List[float] = []
    for c in chunks:
        c.train()
    while iteration < tr.train_iters:
        synchronize(ps.device)
        t0 = time.perf_counter()
        batches = trainer._micro_batches(data_it, m)
        lr = scheduler.current_lr
        loss, updated, grad_norm = trainer.train_step(batches)
        synchronize(ps.device)
        dt = time.perf_counter() - t0
        iteration += 1
        consumed += gbs
        times.append(dt)
        if iteration == 1:  # model-state bytes vs docs/theory.md's ZeRO formula (memory.py)
            from megalite.memory import memory_report

            logger.log(memory_report(chunks, optimizer), iteration, split="memory")
        if not math.isfinite(loss) or (updated and grad_norm is not None
                                       and not math.isfinite(grad_norm)):
            if not cfg.optimizer.fp16:
                raise TrainingError(
                    f"loss became {loss} (grad norm {grad_norm}) at iteration {iteration} in "
                    f"{cfg.optimizer.params_dtype}: training diverged; lower --lr, raise "
                    f"--lr-warmup-iters or set --clip-grad")
        if not updated:
            interval["skipped"] += 1
            total_skipped += 1
        summary["train_losses"][iteration] = loss
        interval["loss"] += loss
        interval["n"] += 1
        interval["time"] += dt
        interval["grad_norm"] = grad_norm

        if iteration % cfg.logging.log_interval == 0 or iteration == tr.train_iters:
            n = interval["n"]
            t_it = interval["time"] / n
            rec = {"iteration": iteration, "consumed_samples": consumed,
                   "lm_loss": interval["loss"] / n, "lr": lr,
                   "grad_norm": interval["grad_norm"], "loss_scale": optimizer.get_loss_scale(),
                   "global_batch_size": gbs, "iteration_time_ms": 1000 * t_it,
                   "skipped_iterations": interval["skipped"],
                   "peak_memory_bytes": peak_memory_bytes(ps.device)}
            if cfg.logging.log_throughput:
                achieved = flops_per_iter / t_it / ps.world_size
                rec.update(tokens_per_sec=gbs * s / t_it, tflops_per_device=achieved / 1e12,
                           mfu=(achieved / peak) if math.isfinite(peak) and peak > 0 else None)
            recent = times[-min(len(times), 20):]
            eta = (tr.train_iters - iteration) * sum(recent) / len(recent)
            logger.print(training_log_line(rec, tr.train_iters, eta))
            rec.pop("iteration")
            logger.log(rec, iteration, split="train")
            interval = {"loss": 0.0, "n": 0, "time": 0.0, "grad_norm": None, "skipped": 0}
            if tr.timing_log_level >= 1 and ps.pp_size > 1:
                # measured bubble of this step (docs/pipeline_parallel.md); a collective over the
                # pipeline group, reached by every rank since the condition above is global
                import os

                from megalite.pipeline_parallel.timeline import log_pipeline_step

                log_pipeline_step(trainer.forward_backward.last_timeline(), ps, iteration,
                                  ck.save or os.path.dirname(os.path.abspath(
                                      cfg.logging.metrics_file or "metrics.jsonl")))

        if iteration % tr.eval_interval == 0:
            do_eval(iteration)
        if ck.save and ck.save_interval and iteration % ck.save_interval == 0:
            do_save(iteration, consumed)
            saved_at = iteration
        if tr.exit_interval and iteration % tr.exit_interval == 0:
            logger.print(f" exiting at iteration {iteration} (--exit-interval {tr.exit_interval})")
            break

    if iteration % tr.eval_interval != 0:
        do_eval(iteration)
    if ck.save and saved_at != iteration:
        do_save(iteration, consumed)
    summary["iteration"] = iteration
    summary["skipped_iterations"] = total_skipped
    summary["wall_time_s"] = time.time() - t_start
    done = f" done: {iteration} iterations in {summary['wall_time_s']:.1f} s"
    if summary["valid"] and "unigram_entropy" in summary:
        last = summary["valid"][max(summary["valid"])]
        done += (f" | final validation loss {last:.4f} nats vs unigram entropy "
                 f"{summary['unigram_entropy']:.4f} nats")
    logger.print(done)
    return summary
