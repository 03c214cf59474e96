"""The training loop: ``pretrain(cfg)`` builds everything from a MegaliteConfig and trains (the
order of construction and the loss contract: docs/design.md, "How a run flows", contract 4)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from functools import partial
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from megalite.checkpoint import save as checkpoint_save
from megalite.checkpoint import verify
from megalite.checkpoint.format import with_checkpoint_args
from megalite.checkpoint.load import load_checkpoint
from megalite.checkpoint.snapshot import HostBuffers
from megalite import collectives as C
from megalite import collective_record as R
from megalite.config import V_SCHEDULES, MegaliteConfig
from megalite.context_parallel.sharding import shard as cp_shard
from megalite.exit_conditions import ExitConditions
from megalite.masks import Documents
from megalite.models.gpt import LossOutput
from megalite.models.mtp import mtp_targets
from megalite.logging import (
    MetricsLogger,
    CpuPeak,
    document_attention,
    model_flops_per_sequence,
    peak_flops_per_device,
    training_log_line,
)
from megalite.moe.layer import begin_step, moe_interval_metrics, moe_layers, update_expert_biases
from megalite.optimizer import OptimizerParamScheduler, build_optimizer
from megalite.parallel_state import (
    ParallelState,
    initialize_model_parallel,
    peak_memory_bytes,
    synchronize,
)
from megalite.pipeline_parallel.partition import build_model_chunks
from megalite.pipeline_parallel.executor import get_forward_backward_func
from megalite.tensor_parallel.random import (
    get_all_rng_states,
    model_parallel_seed,
    set_all_rng_states,
)


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a NaN loss in bf16/fp32); the message says why."""


# ---------------------------------------------------------------------------------------- Seams
def wrap_model_for_data_parallel(model_chunks: List[torch.nn.Module], cfg: MegaliteConfig,
                                 ps: ParallelState
                                 ) -> Tuple[List[torch.nn.Module], Optional[Callable], Callable]:
    """Apply data parallelism: (chunks, no_sync_func, finalize_model_grads_func). Stages 0-2:
    bucketed DDP (docs/data_parallel.md); stage 3: parameter sharding (docs/zero3.md)."""
    if cfg.optimizer.zero_stage <= 2:
        from megalite.distributed.ddp import wrap_chunks

        return wrap_chunks(model_chunks, cfg.optimizer, ps)
    from megalite.distributed.zero3 import wrap_chunks_zero3

    return wrap_chunks_zero3(model_chunks, cfg, ps)


def unigram_entropy(dataset, max_samples: int = 2000) -> Tuple[float, int]:
    """Entropy (nats) of the token frequencies of the first samples of ``dataset``: the loss a
    model that ignores context cannot beat."""
    n = min(len(dataset), max_samples)
    if not n:
        return float("nan"), 0
    tokens = torch.cat([torch.as_tensor(dataset[i]["tokens"]).long().flatten() for i in range(n)])
    counts, n = torch.bincount(tokens), tokens.numel()
    p = counts[counts > 0].double() / n
    return float(-(p * p.log()).sum()), n


# ------------------------------------------------------------------------------------- One step
class _CarryNonFinite(torch.autograd.Function):
    """Identity on the loss; its backward adds ``loss - loss`` (0 when finite, bit for bit; NaN
    otherwise), so a non-finite loss on any rank reaches the agreed global gradient norm and
    every rank skips the step alike, with no collective added (--check-for-nan-in-loss-and-grad)."""

    @staticmethod
    def forward(ctx, loss):
        ctx.poison = (loss - loss).detach()
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + ctx.poison


def _loss_func(loss_mask: torch.Tensor, loss_scale, output: LossOutput, carry: bool = False):
    """Contract loss: this micro-batch's summed token loss over the GLOBAL batch's token count,
    formed by the model from its loss weights (_forward_step); the loss scale they carry is
    divided back out here (the schedule multiplies it in again before backward)."""
    mask = loss_mask.float()
    loss = output.loss / loss_scale
    loss = _CarryNonFinite.apply(loss) if carry else loss
    stats = {"lm_loss_sum": (output.token_loss * mask).sum(), "num_tokens": mask.sum()}
    return loss, {**stats, **{k: v / loss_scale for k, v in output.logged.items()}}


def _forward_step(num_global_tokens: torch.Tensor, data_iterator, model, carry: bool = False,
                  loss_scale=1.0):
    tokens, labels, loss_mask, position_ids, *mtp, documents = next(data_iterator)
    # Each token's weight: 1 / the global token count, times the fp16 loss scale. The loss head
    # forms its gradients in forward, where an unscaled fp16 gradient would underflow; the
    # scale divided out of the loss (_loss_func) brings backward exactly 1 (s / s).
    weight = loss_scale / num_global_tokens
    # MTP's depths: their labels and loss masks (Trainer._micro_batches), weighted as the main
    mtp = {"mtp_targets": (mtp[0], mtp[1].float() * weight)} if mtp else {}
    output = model(tokens, labels=labels, position_ids=position_ids, documents=documents,
                   loss_weights=loss_mask.float() * weight, **mtp)
    return output, partial(_loss_func, loss_mask, loss_scale, carry=carry)


class StepRecord(NamedTuple):
    """What one step leaves on the device until Trainer._drain reads it: this rank's [token loss
    sum, token count, logged sums] (float64), the grad norm, whether it was applied, its lr."""

    sums: torch.Tensor
    grad_norm: torch.Tensor
    applied: torch.Tensor
    lr: torch.Tensor


class _Interval:
    """The iterations since the last log line and their training time, from the host's start of a
    step to the device's end of the last, evaluations and saves paused out (docs/logging.md)."""

    def __init__(self):
        self.n, self.start, self.time = 0, None, 0.0
        self.host_queue = 0.0  # seconds the host took to queue the steps' forward-backward

    def add(self, start: float, host_queue: float) -> None:
        self.start = start if self.start is None else self.start
        self.host_queue += host_queue
        self.n += 1

    def pause(self, device) -> None:
        if self.start is not None:
            synchronize(device)
            self.time, self.start = self.time + time.perf_counter() - self.start, None


class Trainer:
    """One pretraining run: construction is the set-up, :meth:`train` the loop; a step reads
    nothing on the host (docs/performance.md, "A step with no host read")."""

    def __init__(self, cfg: MegaliteConfig, ps: ParallelState, logger: MetricsLogger, tokenizer,
                 t_start: float, memory_estimate: Optional[Callable[..., dict]] = None):
        self.cfg, self.ps, self.logger, self.t_start = cfg, ps, logger, t_start
        # (cfg, world size, device type, pipeline stage) -> {"total", "params", ...} bytes, or None
        self.memory_estimate = memory_estimate
        self.tokenizer, self.eod = tokenizer, tokenizer.eod
        self.summary = {"valid": {}}  # + train_losses / grad_norms from history (_result)
        self.skipped = 0
        self.pending: List[Tuple[int, StepRecord]] = []  # on the device, until _drain
        self.history: Dict[int, Tuple[float, float, bool, float]] = {}  # (loss, norm, applied, lr)
        # the model's logged sums beside the loss (MTP's per depth) and their values per step
        self.logged_keys = [f"mtp_{k + 1}_loss" for k in range(cfg.model.mtp_num_layers or 0)]
        self.logged: Dict[int, List[float]] = {}
        self.loss_scale = 1.0  # as of the last _drain
        self.saved_at = None
        self.pending_save: Optional[checkpoint_save.PendingSave] = None  # --async-save in flight
        self.host_buffers = None
        if cfg.checkpoint.async_save:  # refused here, before anything is built, if it cannot fit
            checkpoint_save.check_async_save_memory(cfg, ps)
            self.host_buffers = HostBuffers(pinned=ps.device.type == "cuda")
        self.times: List[float] = []
        self.host_queue_s = 0.0  # the last step's (train_step)
        self.documents: list = []  # the document lengths of each sample since the last log line
        self._build_data()
        self._build_model_and_optimizer()
        self._load_checkpoint()
        self._log_start()

    # ----------------------------------------------------------------------------------- Set-up
    def _build_data(self) -> None:
        from megalite.data import build_data_loader, build_pretraining_datasets, get_batch

        cfg, tr = self.cfg, self.cfg.training
        self.build_loader, self.get_batch = build_data_loader, get_batch
        # the same eval_iters batches at every evaluation, so successive validation losses are
        # comparable (Megatron walks on through the validation set)
        n_train = tr.train_iters * tr.global_batch_size
        n_eval = max(tr.eval_iters, 1) * tr.global_batch_size  # (0: 'one epoch' to the builder)
        self.train_ds, self.valid_ds, _test = build_pretraining_datasets(
            cfg.data, self.tokenizer, cfg.model.seq_length, tr.seed,
            num_samples=(n_train, n_eval, n_eval), cache_dir=cfg.data.data_cache_path)

    def _build_model_and_optimizer(self) -> None:
        cfg, ps, tr = self.cfg, self.ps, self.cfg.training
        model_parallel_seed(tr.seed, ps.tp_rank, ps.pp_rank, ps.device)
        chunks = build_model_chunks(
            cfg.model, ps, seed=tr.seed,
            num_layers_per_virtual_pipeline_stage=cfg.layers_per_virtual_stage(),
            decoder_first_pipeline_num_layers=tr.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=tr.decoder_last_pipeline_num_layers,
            device=ps.device, v_shape=tr.pipeline_schedule in V_SCHEDULES,
            sequence_parallel=cfg.parallel.sequence_parallel, execution=cfg.execution)
        self.chunks, self.no_sync_func, self.finalize_fn = wrap_model_for_data_parallel(
            chunks, cfg, ps)
        self.optimizer = build_optimizer(self.chunks, cfg.optimizer, ps)
        self.moe_layers = moe_layers(self.chunks)  # found once, not walked every step
        self.scheduler = OptimizerParamScheduler.from_config(self.optimizer, cfg.optimizer,
                                                             tr.train_iters, device=ps.device)
        self.forward_backward = get_forward_backward_func(
            ps.pp_size, cfg.parallel.virtual_pipeline_model_parallel_size, tr.pipeline_schedule)

    def _load_checkpoint(self) -> None:
        cfg, ps, ck = self.cfg, self.ps, self.cfg.checkpoint
        self.iteration, self.consumed, self.rng_state = 0, 0, None
        if ck.load:
            self.iteration, self.consumed, self.rng_state = load_checkpoint(
                cfg, self.chunks, self.optimizer, self.scheduler, ps, log=self.logger.print)
            if self.iteration or ck.finetune:
                what = ("weights only" if ck.finetune else
                        "weights, data position" + ("" if ck.no_load_optim else ", optimizer")
                        + ("" if ck.no_load_rng else ", RNG"))
                self.logger.print(f" loaded checkpoint {ck.load} at iteration {self.iteration} "
                                  f"({what})")
                self._verify_load()
        self.summary["iteration"] = self.iteration
        self.run_id = checkpoint_save.new_run_id(ps)
        if ck.save and ps.rank == 0:
            os.makedirs(ck.save, exist_ok=True)
            checkpoint_save.save_tokenizer(ck.save, self.tokenizer, ps)

    def _verify_load(self) -> None:
        """Before any step: the probe loss and optimizer norms the save recorded, recomputed at
        this layout (docs/checkpoints.md, "Loads that prove themselves")."""
        ck = self.cfg.checkpoint
        record = None if ck.no_verify_load else verify.read_record(ck.load)
        if record is not None:  # (None: imported, or saved before records)
            start, optim = time.perf_counter(), not (ck.finetune or ck.no_load_optim)
            state = verify.fingerprint(self.chunks, self.optimizer, self.ps) if optim else None
            verify.check_record(record, self.evaluate(probe=True)[0], state, self.cfg, self.ps)
            self.logger.print(f" verified the load as saved ({time.perf_counter() - start:.2f} s)")

    def _log_start(self) -> None:
        cfg, ps, tr, log = self.cfg, self.ps, self.cfg.training, self.logger
        n_params = cfg.model.num_parameters()
        log.print(f" megalite: world size {ps.world_size} | tp {ps.tp_size} cp {ps.cp_size} "
                  f"pp {ps.pp_size} dp {ps.dp_size} | device {ps.device} | "
                  f"{n_params / 1e6:.2f}M parameters | vocab {cfg.model.vocab_size} | "
                  f"{cfg.model.params_dtype}")
        if ps.rank == 0 and not tr.skip_train and self.train_ds is not None:
            ent, ntok = unigram_entropy(self.train_ds)
            self.summary["unigram_entropy"] = ent
            log.print(f" unigram entropy of the training tokens: {ent:.4f} nats "
                      f"(perplexity {math.exp(ent):.1f}, over {ntok} tokens): a model that "
                      f"ignores context cannot reach a lower loss")
            log.log({"unigram_entropy": ent, "unigram_ppl": math.exp(ent), "tokens": ntok,
                     "num_parameters": n_params}, self.iteration, split="data")
        self.flops_per_iter = model_flops_per_sequence(
            cfg.model, cfg.model.padded_vocab_size(ps.tp_size)) * tr.global_batch_size
        self.cpu_peak = CpuPeak()
        self.peak_flops = peak_flops_per_device(ps.device, cfg.model.params_dtype, self.cpu_peak) \
            if cfg.logging.log_throughput and ps.rank == 0 else float("nan")

    # --------------------------------------------------------------------------------- The loop
    def train(self) -> dict:
        tr = self.cfg.training
        if tr.skip_train:
            self._evaluate_and_log()
            return self._result()
        data_it = iter(self.build_loader(self.train_ds, self.consumed, tr.micro_batch_size,
                                         self.ps.dp_rank, self.ps.dp_size,
                                         num_workers=self.cfg.data.num_workers))
        if self.rng_state is not None:
            set_all_rng_states(self.rng_state, self.ps.device)  # right before step 1: exact resume
        interval = _Interval()
        for c in self.chunks:
            c.train()
        synchronize(self.ps.device)  # the first interval starts on an idle device
        # --exit-signal-handler / --exit-duration-in-mins, held until the final save is done
        with ExitConditions(tr, self.ps, self.t_start) as self.exits, self._joined_writer():
            while self.iteration < tr.train_iters:
                start = time.perf_counter()
                m = tr.num_micro_batches(self.ps.dp_size)
                batches = self._micro_batches(data_it, m)
                # --reset-attention-mask: the samples' document lengths, for the log line
                self.documents += [row for b in batches if b[-1] is not None
                                   for row in b[-1].lengths]
                with R.label(f"iteration {self.iteration + 1}"):  # the collective record's
                    self._record(self._measured_train_step(batches))
                interval.add(start, self.host_queue_s)
                if self._logs_at(self.iteration):
                    interval.pause(self.ps.device)  # closed at the log line
                    self._log(interval)
                    interval = _Interval()
                if self.iteration % tr.eval_interval == 0:
                    interval.pause(self.ps.device)
                    self._evaluate_and_log()
                if self._save_due():
                    interval.pause(self.ps.device)
                    self._save()
                reason = self._stop_reason()
                if reason:
                    self.logger.print(f" exiting at iteration {self.iteration} ({reason})")
                    break
            self._drain()
            return self._finish()

    @contextlib.contextmanager
    def _joined_writer(self):
        """A run that stops on an error lets its background writer finish (never published)."""
        try:
            yield
        finally:
            if self.pending_save is not None:
                self.pending_save.join()

    def _logs_at(self, iteration: int) -> bool:
        return iteration % self.cfg.logging.log_interval == 0 \
            or iteration == self.cfg.training.train_iters

    def _measured_train_step(self, batches):
        """``train_step(batches)``; on the first logged iteration after the first (whose lazily
        created optimizer states make it unlike the rest) also the peak of tensor memory, beside
        ``memory_estimate``'s figures (docs/planner.md, "Memory of real runs")."""
        cfg, ps = self.cfg, self.ps
        it = self.iteration + 1
        first = next((i for i in range(2, cfg.training.train_iters + 1) if self._logs_at(i)), 1)
        if it != first or not cfg.logging.log_memory_peak:
            return self.train_step(batches)
        from megalite.memory import PeakTensorMemory

        # No collective may cross the profiler's boundaries: gloo's in-flight work keeps a pointer
        # to the profiler's record and crashes when waited on after the profiler is gone.
        def settle():
            for chunk in self.chunks:
                getattr(chunk, "finish_param_sync", lambda: None)()

        settle()
        with PeakTensorMemory(ps.device) as probe:
            out = self.train_step(batches)
            settle()
        rec = {"measured_memory_bytes": probe.peak_bytes}
        line = f"measured peak of tensor memory {probe.peak_bytes / 2**30:.3f} GiB"
        est = self.memory_estimate(cfg, ps.world_size, ps.device.type, ps.pp_rank) \
            if self.memory_estimate and cfg.logging.log_planner_estimate else None
        if est is not None:
            line = (f"planner estimate {est['total'] / 2**30:.3f} GiB, {line} "
                    f"({probe.peak_bytes / est['total'] - 1:+.1%} vs estimate)")
            rec.update({"estimated_memory_bytes": int(est["total"]), **{
                f"estimated_{k}_bytes": int(est[k]) for k in (
                    "params", "grads", "optimizer", "activations")}})
        self.logger.print(f" memory at iteration {it} (rank 0): {line}")
        self.logger.log(rec, it, split="memory")
        return out

    def train_step(self, batches) -> StepRecord:
        """Forward-backward over the global batch and the optimizer step, with no host read."""
        num_global_tokens = self._global_token_count(batches)
        self.optimizer.zero_grad()
        # MoE balancing losses: averaged over the global batch's micro-batches, as the token loss
        # is (DP sums gradients), and scaled like it under fp16 (megalite/moe/layer.py)
        begin_step(self.moe_layers, self.optimizer.get_loss_scale()
                   / (len(batches) * self.ps.dp_size))
        start = time.perf_counter()
        stats = self._forward_backward(batches, num_global_tokens, forward_only=False)
        # no synchronize: on a GPU the host's time to queue the work, which must stay below the
        # device's time to run it (logged as host_queue_ms_per_iteration)
        self.host_queue_s = time.perf_counter() - start
        sums = self._local_loss_sums(stats)
        # --check-for-nan-in-loss-and-grad: a non-finite loss or norm skips the step on the
        # device on every rank alike; the host stops the run at _drain, before any save
        lr = self.scheduler.lr  # this step's (the scheduler hands out a new tensor per step)
        loss = sums[0] / sums[1].clamp_min(1.0) if self._check_finite else None
        with R.label("optimizer step"):
            applied, grad_norm, _ = self.optimizer.step(loss)
        self.scheduler.step(applied)
        update_expert_biases(self.moe_layers, self.ps.tp_group, self.ps.dp_cp_group, applied)
        return StepRecord(sums, grad_norm, applied, lr)

    @property
    def _check_finite(self) -> bool:
        return (self.cfg.training.check_for_nan_in_loss_and_grad
                and self.cfg.model.params_dtype != "float16")

    def _diverged(self, what: str, iteration: int) -> TrainingError:
        return TrainingError(
            f"{what} at iteration {iteration} in {self.cfg.model.params_dtype}, its optimizer "
            f"step skipped and the run stopped (--check-for-nan-in-loss-and-grad): training "
            f"diverged; lower --lr, raise --lr-warmup-iters or set --clip-grad")

    def _record(self, record: StepRecord) -> None:
        self.iteration += 1
        self.consumed += self.cfg.training.global_batch_size
        self.pending.append((self.iteration, record))
        if self.iteration == 1:  # model-state bytes vs docs/theory.md's ZeRO formula (memory.py)
            from megalite.memory import memory_report

            self.logger.log(memory_report(self.chunks, self.optimizer), 1, split="memory")

    def _save_due(self) -> bool:
        ck = self.cfg.checkpoint
        return bool(ck.save and ck.save_interval and self.iteration % ck.save_interval == 0)

    def _stop_reason(self) -> Optional[str]:
        """Why training stops after this iteration, or None. Every rank must agree (a rank that
        stops alone leaves its peers waiting in a collective)."""
        tr = self.cfg.training
        if tr.exit_interval and self.iteration % tr.exit_interval == 0:
            return f"--exit-interval {tr.exit_interval}"
        return self.exits.stop_reason()  # signals, time limit: agreed over all ranks

    def _finish(self) -> dict:
        if self.iteration % self.cfg.training.eval_interval != 0:
            self._evaluate_and_log()
        if self.cfg.checkpoint.save and self.saved_at != self.iteration:
            self._save()
        self._settle_save(wait=True)  # the end, SIGTERM and the time limit wait for the writer
        s = self.summary
        s["iteration"], s["skipped_iterations"] = self.iteration, self.skipped
        s["wall_time_s"] = time.time() - self.t_start
        done = f" done: {self.iteration} iterations in {s['wall_time_s']:.1f} s"
        if s["valid"] and "unigram_entropy" in s:
            done += (f" | final validation loss {s['valid'][max(s['valid'])]:.4f} nats vs "
                     f"unigram entropy {s['unigram_entropy']:.4f} nats")
        self.logger.print(done)
        return self._result()

    def _result(self) -> dict:
        """What pretrain() returns: the summary with each step's loss and grad norm."""
        self.summary["train_losses"] = {it: h[0] for it, h in sorted(self.history.items())}
        self.summary["grad_norms"] = {it: h[1] for it, h in sorted(self.history.items())}
        return self.summary

    # -------------------------------------------------------------- Logging, evaluation, saving
    def _drain(self) -> None:
        """Read the records of the steps since the last read: one collective, one host read, on
        every rank alike. Raises TrainingError naming the first step that was not finite, so no
        checkpoint is written from such a state."""
        if not self.pending:
            return
        its = [it for it, _ in self.pending]
        recs = [r for _, r in self.pending]
        self.pending = []
        n = len(recs)
        sums = torch.stack([r.sums for r in recs])  # [n, 2 + logged]
        w = sums.shape[1]
        C.all_reduce(sums, group=C.world_group(), tag="loss_report")
        scale = self.optimizer.get_loss_scale()
        parts = [sums.flatten()] + [torch.stack([getattr(r, k) for r in recs]).double()
                                    for k in ("grad_norm", "applied", "lr")]
        if torch.is_tensor(scale):
            parts.append(scale.double().reshape(1))
        values = torch.cat(parts).tolist()  # the one host read
        if torch.is_tensor(scale):
            self.loss_scale = values.pop()
        norms, applied, lrs = (values[w * n + k * n:w * n + (k + 1) * n] for k in range(3))
        for i, it in enumerate(its):
            loss = values[w * i] / max(values[w * i + 1], 1.0)
            self.history[it] = (loss, norms[i], bool(applied[i]), lrs[i])
            self.logged[it] = values[w * i + 2:w * (i + 1)]
            self.skipped += not applied[i]
            for what, x in (("loss", loss), ("grad norm", norms[i])):
                if self._check_finite and not math.isfinite(x):
                    raise self._diverged(f"{what} {x}", it)

    def _log(self, interval: _Interval) -> None:
        cfg, ps, tr = self.cfg, self.ps, self.cfg.training
        self._drain()
        self._settle_save(wait=False)  # a log line agrees on a background save's outcome
        gbs, t_it = tr.global_batch_size, interval.time / interval.n
        self.times += [t_it] * interval.n
        its = range(self.iteration - interval.n + 1, self.iteration + 1)
        steps = [self.history[it] for it in its]
        _, norm, applied, lr = steps[-1]
        rec = {"iteration": self.iteration, "consumed_samples": self.consumed,
               "lm_loss": sum(s[0] for s in steps) / interval.n, "lr": lr,
               "grad_norm": norm if applied else None, "loss_scale": self.loss_scale,
               "global_batch_size": gbs, "iteration_time_ms": 1000 * t_it,
               "host_queue_ms_per_iteration": 1000 * interval.host_queue / interval.n,
               "skipped_iterations": sum(not s[2] for s in steps),
               "peak_memory_bytes": peak_memory_bytes(ps.device)}
        for k, key in enumerate(self.logged_keys):  # already over the global token count
            rec[key] = sum(self.logged[it][k] for it in its) / interval.n
        if cfg.model.num_experts is not None:
            rec.update(moe_interval_metrics(
                self.moe_layers, cfg.model,
                interval.n * tr.global_batch_size // tr.micro_batch_size, ps))
        if cfg.logging.log_throughput:
            achieved = self.flops_per_iter / t_it / ps.world_size
            peak = self.peak_flops
            if ps.device.type == "cpu" and ps.rank == 0 and achieved > peak:
                peak = self.peak_flops = self.cpu_peak.at_least(achieved)
            rec.update(tokens_per_sec=gbs * cfg.model.seq_length / t_it,
                       tflops_per_device=achieved / 1e12, peak_tflops_per_device=peak / 1e12,
                       mfu=(achieved / peak) if math.isfinite(peak) and peak > 0 else None)
        if self.documents:  # --reset-attention-mask: the attention work the documents need
            flops, fraction = document_attention(cfg.model, self.documents)
            rec.update(attention_tflops_needed=flops * gbs / 1e12,
                       document_attention_fraction=fraction)
            self.documents = []
        recent = self.times[-20:]
        eta = (tr.train_iters - self.iteration) * sum(recent) / len(recent)
        self.logger.print(training_log_line(rec, tr.train_iters, eta))
        rec.pop("iteration")
        self.logger.log(rec, self.iteration, split="train")
        if tr.timing_log_level >= 1 and (ps.pp_size > 1 or ps.ep_size > 1):
            # measured bubble (docs/pipeline_parallel.md) and exposed all-to-all time (docs/moe.md)
            # of this step; a collective over the pipeline group, reached by every rank since the
            # log condition is global
            from megalite.pipeline_parallel.timeline import log_pipeline_step

            log_pipeline_step(self.forward_backward.last_timeline(), ps, self.iteration,
                              cfg.checkpoint.save or os.path.dirname(os.path.abspath(
                                  cfg.logging.metrics_file or "metrics.jsonl")), self.logger)

    def _evaluate_and_log(self) -> None:
        if self.cfg.training.eval_iters <= 0 or self.valid_ds is None:
            return
        loss, ppl = self.evaluate()
        self.summary["valid"][self.iteration] = loss
        self.logger.print(f" validation at iteration {self.iteration} | lm loss: {loss:.6E} | "
                          f"lm loss PPL: {ppl:.3f}")
        self.logger.log({"lm_loss": loss, "ppl": ppl}, self.iteration, split="valid")

    def _save(self) -> None:
        """Save this iteration, or with --async-save start a background write (one in flight)."""
        self._drain()  # before anything is written: raises if a step since then was not finite
        self._settle_save(wait=True)
        args = (self.cfg.checkpoint.save, self.iteration, self.chunks, self.optimizer,
                self.scheduler, self.consumed, self.cfg, self.ps, self.run_id)
        start = time.perf_counter()
        self.saved_at = self.iteration
        # what a load must reproduce, of the state this save writes (an async one's snapshot)
        record = verify.make_record(self.evaluate(probe=True)[0], self.chunks, self.optimizer,
                                    self.iteration, self.cfg, self.ps)
        if self.host_buffers is None:
            path = checkpoint_save.save_checkpoint(*args, record=record)
            stall = time.perf_counter() - start
            self.logger.print(f" saved checkpoint {path} ({stall:.2f} s)")
            self.logger.log({"stall_s": stall, "published_iteration": self.iteration},
                            self.iteration, split="checkpoint")
            return
        self.pending_save = checkpoint_save.start_async_save(*args, buffers=self.host_buffers,
                                                             record=record)
        synchronize(self.ps.device)  # (the stall includes the snapshot's device-to-host copies)
        self.save_stall_s = time.perf_counter() - start
        self.logger.print(f" saving checkpoint {self.pending_save.plan.final} in the background "
                          f"(snapshot {self.save_stall_s:.2f} s, "
                          f"{self.host_buffers.nbytes / 2**20:.1f} MiB of host memory)")

    def _settle_save(self, wait: bool) -> None:
        """Agree on the background save in flight (a collective): published once every rank's
        files are durable, an error on any rank raised on all. ``wait``: block until done."""
        pending = self.pending_save
        if pending is None:
            return
        start = time.perf_counter()
        if not pending.settle(wait):
            return
        waited = time.perf_counter() - start if wait else 0.0  # training stalled on the writer
        self.pending_save = None
        self.logger.print(f" saved checkpoint {pending.plan.final} (written in the background "
                          f"in {pending.write_s:.2f} s, published at iteration {self.iteration})")
        self.logger.log({"stall_s": self.save_stall_s, "waited_s": waited,
                         "write_s": pending.write_s, "writer_cpu_s": pending.cpu_s,
                         "host_bytes": self.host_buffers.nbytes,
                         "published_iteration": self.iteration}, pending.plan.iteration,
                        split="checkpoint")

    @torch.no_grad()
    def evaluate(self, probe: bool = False) -> Tuple[float, float]:
        """(loss, perplexity) over the same ``eval_iters`` validation batches, or the probe's."""
        cfg, ps, tr = self.cfg, self.ps, self.cfg.training
        # evaluation must not perturb training randomness (a DataLoader iterator draws a seed):
        # else --eval-interval would change the run, and a resumed run differ from the whole one
        rng = get_all_rng_states(ps.device)
        for c in self.chunks:
            c.eval()
        m, n = tr.num_micro_batches(ps.dp_size), tr.eval_iters
        if probe:  # one row of tokens from a constant seed (not --seed or the data: a resume may
            # change them) as every DP rank's micro-batches, 2 x PP at PP > 1 (any schedule's)
            m, n = (1 if ps.pp_size == 1 else 2 * ps.pp_size), 1
            row = torch.randint(self.tokenizer.vocab_size, (1, cfg.model.seq_length + 1),
                                generator=torch.Generator().manual_seed(verify.PROBE_SEED))
            it = iter([{"tokens": row.expand(tr.micro_batch_size, -1)}] * m)
        else:
            it = iter(self.build_loader(self.valid_ds, 0, tr.micro_batch_size, ps.dp_rank,
                                        ps.dp_size, num_workers=cfg.data.num_workers))
        sums = torch.zeros(2, dtype=torch.float64, device=ps.device)
        for _ in range(n):
            batches = self._micro_batches(it, m, mtp=False)  # the main loss only: no MTP depth
            stats = self._forward_backward(batches, self._global_token_count(batches),
                                           forward_only=True)
            sums += self._local_loss_sums(stats, logged=False)
        C.all_reduce(sums, group=C.world_group(), tag="loss_report")  # the global batches' sums
        for c in self.chunks:
            c.train()
        set_all_rng_states(rng, ps.device)
        total, ntok = sums.tolist()[:2]
        loss = total / max(ntok, 1.0)
        return loss, math.exp(min(loss, 50.0))

    # ----------------------------------------------------------------------- Batches and losses
    def _micro_batches(self, it, m: int, mtp: bool = True):
        """Every CP rank of a DP rank reads the same samples and keeps its chunks of each; MTP's
        targets with ``mtp`` (without them the model runs no depth: _forward_step)."""
        out, ps, data = [], self.ps, self.cfg.data
        for _ in range(m):
            *tensors, documents = self.get_batch(next(it), self.eod, data.eod_mask_loss,
                                                 data.reset_position_ids,
                                                 data.reset_attention_mask)
            if self.cfg.model.mtp_num_layers and mtp:  # shifted while the sequence is whole (CP)
                tensors += mtp_targets(tensors[1], tensors[2], self.cfg.model.mtp_num_layers)
            # documents stay whole: a CP rank's attention blocks meet every rank's chunks
            out.append(tuple(None if t is None else self._to_device(
                cp_shard(t, ps.cp_rank, ps.cp_size, dim=1)) for t in tensors)
                + (self._to_device(documents),))
        return out

    def _to_device(self, t):
        """Host batch (a tensor, Documents or None) -> device; on CUDA pinned and non-blocking,
        so the copy queues behind the running step instead of stalling it."""
        if t is None or self.ps.device.type != "cuda":
            return t
        if isinstance(t, Documents):
            return t.to(self.ps.device, non_blocking=True)
        return t.pin_memory().to(self.ps.device, non_blocking=True)

    def _global_token_count(self, batches) -> torch.Tensor:
        n = torch.zeros(1, dtype=torch.float32, device=self.ps.device)
        for b in batches:
            n += b[2].sum()
        C.all_reduce(n, group=self.ps.dp_cp_group, tag="loss_token_count")  # CP: token shards
        return n.clamp_min(1.0).squeeze(0)

    def _forward_backward(self, batches, num_global_tokens: torch.Tensor, forward_only: bool):
        """Run the pipeline schedule over the micro-batches; returns the loss stage's stats."""
        tr = self.cfg.training
        extra = {} if forward_only else dict(
            grad_scale_func=self.optimizer.scale_loss, no_sync_func=self.no_sync_func,
            finalize_model_grads_func=self.finalize_fn,
            # the combined 1F1B / F&B pairs: docs/moe.md, docs/pipeline_parallel.md
            overlap_moe_expert_parallel_comm=self.cfg.training.overlap_moe_expert_parallel_comm,
            delay_wgrad_compute=self.cfg.training.delay_wgrad_compute,
            # the timeline marks every op (CUDA events) after a barrier: only on logged steps
            timing_log_level=tr.timing_log_level if self._logs_at(self.iteration + 1) else 0)
        return self.forward_backward(
            forward_step_func=partial(
                _forward_step, num_global_tokens, carry=self._check_finite and not forward_only,
                loss_scale=1.0 if forward_only else self.optimizer.get_loss_scale()),
            data_iterator=iter(batches), model=self.chunks, num_microbatches=len(batches),
            seq_length=self.cfg.model.seq_length // self.ps.cp_size,  # CP: this rank's tokens
            micro_batch_size=tr.micro_batch_size,
            parallel_state=self.ps, forward_only=forward_only, **extra)

    def _local_loss_sums(self, stats_list, logged: bool = True) -> torch.Tensor:
        """This rank's [token loss sum, token count, logged sums if ``logged``] (float64, on the
        device). Only TP rank 0 of the loss stage adds: a world SUM gives the global batch's."""
        keys = ["lm_loss_sum", "num_tokens"] + (self.logged_keys if logged else [])
        t = torch.zeros(len(keys), dtype=torch.float64, device=self.ps.device)
        if self.ps.tp_rank == 0:  # the schedules return no stats off the loss stage
            for s in stats_list:
                t += torch.stack([s[k].double() for k in keys])
        return t


# ------------------------------------------------------------------------------------- pretrain
def pretrain(cfg: MegaliteConfig, ps: Optional[ParallelState] = None, stream=None,
             memory_estimate=None) -> dict:
    """Train as configured; returns a summary (final iteration, last losses). ``cfg`` is
    resolved once the world size and the tokenizer (the vocab) are known, read-only from there.
    ``memory_estimate``: logged beside the measured peak (pretrain.py passes the planner's)."""
    par = cfg.parallel
    if ps is None:
        ps = initialize_model_parallel(
            par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
            context_parallel_size=par.context_parallel_size, cp_comm_type=par.cp_comm_type,
            expert_model_parallel_size=par.expert_model_parallel_size,
            expert_tensor_parallel_size=par.expert_tensor_parallel_size,
            distributed_optimizer_instances=cfg.optimizer.num_distributed_optimizer_instances,
            backend=par.distributed_backend, device=par.device,
            timeout_minutes=par.distributed_timeout_minutes)
    t_start = time.time()
    if cfg.checkpoint.load and cfg.checkpoint.use_checkpoint_args:
        cfg = with_checkpoint_args(cfg)
    from megalite.data import build_tokenizer

    tokenizer = build_tokenizer(cfg.data, cfg.data.data_cache_path, cfg.model.vocab_size)
    cfg = cfg.resolve(ps.world_size, tokenizer.vocab_size)
    logger = MetricsLogger(cfg, is_writer=(ps.rank == 0), stream=stream)
    try:
        return Trainer(cfg, ps, logger, tokenizer, t_start, memory_estimate).train()
    finally:
        logger.close()
