"""AdamW with fp32 master weights for 16-bit models, loss scaling and global-norm clipping: the
plain optimizer (ZeRO 0) and the AdamW step both ZeRO optimizers share. The interface every megalite
optimizer keeps, its mixed precision and weight decay: docs/data_parallel.md, "The optimizer"; a
step skipped on the device: docs/performance.md, "A step with no host read"."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megalite.optimizer.clip_grads import clip_grads_by_norm, grad_norm_squared, split_counted
from megalite.optimizer.grad_scaler import build_grad_scaler, found_inf_flag
from megalite.optimizer.offload import HostAdamW, host_units
from megalite.param_meta import grad_of

# The ZeRO step's piece size (elements): what it holds aside to mask an update is five pieces
# (ShardedAdamW._adamw), 160 MiB in fp32, however large a shard is.
_CHUNK = 1 << 23

# The per-parameter state of every optimizer file format, by parameter name (one vocabulary).
ADAM_KINDS = ("master", "exp_avg", "exp_avg_sq")
# The ZeRO optimizers' two formats (docs/checkpoints.md, "Optimizer state files").
SHARD_FORMAT = "megalite.optim.shard/v2"
FULL_FORMAT = "megalite.optim.full/v2"


def model_parameters(model_chunks) -> List[torch.nn.Parameter]:
    """Trainable parameters of all chunks, each once, in a deterministic order."""
    seen, out = set(), []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def decide_step(grad_scaler, grads: List[torch.Tensor], counted: List[torch.Tensor], ps,
                dp_sharded: bool, loss: Optional[torch.Tensor], expert=()
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The step's decisions, on the device: ``(found_inf, grad_norm)``, 0-dim float32 tensors;
    ``found_inf`` is 1.0 where the step must not be applied (torch's fused optimizers' convention).
    The flag and the norm are global; ``loss`` is this rank's, which is enough because the training
    loop carries a non-finite loss into the gradients (training.py, ``_CarryNonFinite``)."""
    found_inf = torch.zeros((), dtype=torch.float32, device=ps.device)
    if grad_scaler is not None:
        found_inf = found_inf_flag(grads, ps.device, inv_scale=grad_scaler.inv_scale).reshape(())
        grad_scaler.update(found_inf)
    grad_norm = grad_norm_squared(counted, ps, dp_sharded, expert).sqrt().reshape(())
    if loss is not None:
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss.detach().reshape(()))
        found_inf = torch.where(finite, found_inf, 1.0)
    return found_inf, grad_norm


class _LossScaling:
    grad_scaler = None

    def get_loss_scale(self):
        """The fp16 loss scale as a 0-dim device tensor, else 1.0."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.grad_scaler.scale.to(loss.dtype) if self.grad_scaler is not None \
            else loss


class MixedPrecisionOptimizer(_LossScaling):
    """fp32/bf16/fp16 AdamW over this rank's (TP/PP-sharded, DP-replicated) parameters."""

    sharded_state_dict_per_dp_rank = False

    def __init__(self, model_chunks, opt_cfg, ps):
        self.ps = ps
        self.cfg = opt_cfg
        self.ddp_chunks = [c for c in model_chunks if hasattr(c, "zero_grad_buffer")]
        self.model_params = model_parameters(model_chunks)
        self.mixed = any(p.dtype in (torch.float16, torch.bfloat16) for p in self.model_params)
        # 16-bit parameters in a DDP buffer get their masters as views of one fp32 copy of that
        # buffer, so the step writes the model back with one copy per buffer, not one per
        # parameter (padding included: it is zero on both sides). Others get a master each.
        self.flat_masters: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, fp32 copy)
        in_buffer: Dict[torch.nn.Parameter, torch.Tensor] = {}
        for c in self.ddp_chunks:
            for buf in c.grad_buffers:
                if buf.param_dtype != torch.float32:
                    flat = buf.param_data.float()
                    self.flat_masters.append((buf.param_data, flat))
                    for p, slot in buf.slots.items():
                        in_buffer[p] = flat[slot.start:slot.end].view_as(p)
        self.masters: List[torch.Tensor] = []
        for p in self.model_params:
            if p.dtype == torch.float32:
                self.masters.append(p)
            else:
                m = torch.nn.Parameter(in_buffer[p] if p in in_buffer else
                                       p.detach().clone().float())
                self.masters.append(m)
        self.loose = [(p, m) for p, m in zip(self.model_params, self.masters)
                      if m is not p and p not in in_buffer]  # copied back one by one
        self.host = HostAdamW(opt_cfg, ps.device)  # docs/offload.md: the device master lands
        for i in host_units([m.numel() for m in self.masters], opt_cfg):
            p = self.model_params[i]
            self.masters[i] = self.host.add(self.masters[i], self.masters[i],
                                            [(0, p.numel(), int(p.dim() <= 1))], False)[0]
        decay = [m for p, m in zip(self.model_params, self.masters) if p.dim() > 1]
        no_decay = [m for p, m in zip(self.model_params, self.masters) if p.dim() <= 1]
        groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        device = self.masters[0].device if self.masters else torch.device("cpu")
        # torch's fused kernels, on every device: they take the skip flag (``found_inf``) and
        # the lr as device tensors, so a skipped step is skipped inside the kernel (torch takes
        # the step count back) and the host decides nothing (docs/performance.md).
        if opt_cfg.optimizer == "sgd":
            self.inner = torch.optim.SGD(groups, lr=opt_cfg.lr, momentum=opt_cfg.adam_beta1,
                                         fused=True)
            if opt_cfg.adam_beta1 != 0:  # torch leaves the buffers of a skipped first step
                for m in self.masters:   # unwritten: start them at 0, what they mean
                    self.inner.state[m]["momentum_buffer"] = torch.zeros_like(m)
        else:
            self.inner = torch.optim.AdamW(groups, lr=opt_cfg.lr,
                                           betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
                                           eps=opt_cfg.adam_eps,
                                           weight_decay=opt_cfg.weight_decay, fused=True)
        self.host.build(self.inner.state)  # one torch state for all masters: one file format
        # the lr tensor the scheduler hands over: the CUDA fused kernels read a float32 one, the
        # CPU kernels a double (the host float's value, exactly)
        self.lr_dtype = torch.float32 if device.type == "cuda" else torch.float64
        self.grad_scaler = build_grad_scaler(opt_cfg, self.model_params[0].dtype, ps.device)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for c in self.ddp_chunks:  # main_grad: one zero_ per flat DDP buffer, not per parameter
            c.zero_grad_buffer()
        for p in self.model_params:
            p.grad = None
        if self.mixed:
            for m in self.masters:
                m.grad = None

    def _master_grads(self) -> List[Optional[torch.Tensor]]:
        grads = []
        for p, m in zip(self.model_params, self.masters):
            g = grad_of(p)
            if self.host.holds(m):  # stepped on the host
                grads.append(None if g is None else g.float())
            elif m is p:
                if g is not None and p.grad is None:
                    p.grad = g  # main_grad (fp32) owned by a DP wrapper
                grads.append(p.grad)
            else:
                m.grad = g.float() if g is not None else None
                grads.append(m.grad)
        return grads

    @torch.no_grad()
    def step(self, loss: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, None]:
        grads = self._master_grads()
        present = [g for g in grads if g is not None]
        ps = self.ps
        counted, expert = split_counted(self.model_params, grads, ps)
        found_inf, grad_norm = decide_step(self.grad_scaler, present, counted, ps, False, loss,
                                           expert)
        if self.cfg.clip_grad > 0:
            clip_grads_by_norm(present, grad_norm, self.cfg.clip_grad)
        self.inner.found_inf = found_inf  # read by torch's fused step, as GradScaler sets it
        self.host.download([g for g, m in zip(grads, self.masters) if self.host.holds(m)],
                           found_inf, self.inner.param_groups[0]["lr"])
        self.inner.step()  # (the host masters have no .grad here: it steps the device's)
        self.host.step()  # into the device masters, rounded into the model below
        # (after a skipped step this copies back the values the model already holds)
        for model_flat, master_flat in self.flat_masters:
            model_flat.copy_(master_flat)  # rounds the fp32 masters into the 16-bit model
        for p, m in self.loose:
            p.data.copy_(m.data)
        return found_inf == 0, grad_norm, None

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model (after loading weights into the model)."""
        for model_flat, master_flat in self.flat_masters:
            master_flat.copy_(model_flat)
        for p, m in self.loose:
            m.data.copy_(p.data.float())
        self.host.reload()

    def state_dict(self) -> dict:
        inner = self.inner.state_dict()
        for g in inner["param_groups"]:  # the files keep the lr a number (read at a save)
            g["lr"] = float(g["lr"])
        sd = {"optimizer": inner,
              "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None}
        if self.mixed:
            sd["fp32_master_params"] = [m.detach().clone() for m in self.masters]
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        # torch restores the saved hyperparameters with the state; this run's flags win (betas,
        # eps, weight decay; the LR schedule sets lr), as the ZeRO optimizers read them from cfg.
        flags = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        self.inner.load_state_dict(sd["optimizer"])
        self.host.build(self.inner.state)  # (torch made a new state dict: share that one)
        for group, hyper in zip(self.inner.param_groups, flags):
            group.update(hyper)
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])
        if self.mixed:
            saved = sd.get("fp32_master_params")
            if saved is None:  # saved by an fp32 run: the model weights are the masters
                self.reload_model_params()
            else:
                if len(saved) != len(self.masters):
                    raise ValueError("optimizer state does not match the model's parameters")
                for m, s in zip(self.masters, saved):
                    m.data.copy_(s)
        else:  # fp32: the model weights, loaded already, are the masters (offloaded: copies)
            self.host.reload()


class ShardedAdamW(_LossScaling):
    """AdamW on flat fp32 shards: the step of both ZeRO optimizers (distrib_optimizer.py, stages
    1-2 over DDP's buckets; zero3_optimizer.py, stage 3 over the model's units).

    A subclass fills ``masters``, ``exp_avg``, ``exp_avg_sq`` (flat fp32 tensors, one per shard),
    ``runs`` (per shard, ``[(lo, hi, group)]``: a shard straddles parameters, so weight decay and
    lr apply per run), ``norm_runs`` (the runs this rank counts in the global gradient norm;
    under EP > 1 ``expert_norm_runs`` those of expert parameters, sharded over the
    expert-data-parallel group), ``segments`` (per shard, docs/checkpoints.md, "Optimizer state
    files"), ``zero_stage``, ``dp_size``, ``dp_rank``, and implements ``_grads``,
    ``_finish_grads``, ``_copy_masters_to_model``, ``_gather_flat``, ``_flat_slots``,
    ``zero_grad``."""

    sharded_state_dict_per_dp_rank = True
    expert_norm_runs: Sequence = ()
    shard_is_expert: Sequence[bool] = ()

    def _init_shared(self, cfg, ps, params_dtype: torch.dtype) -> None:
        self.cfg, self.ps = cfg, ps
        # applied steps (Adam's t, for the bias corrections): a device count, advanced by the
        # step's own device flag, so a skipped step leaves it as it was without a host read
        self.step_count = torch.zeros((), dtype=torch.float64, device=ps.device)
        self.grad_scaler = build_grad_scaler(cfg, params_dtype, ps.device)
        self.host = HostAdamW(cfg, ps.device)  # the shards stepped on the host (docs/offload.md)
        self.param_groups = [{"name": "decay", "lr": cfg.lr, "weight_decay": cfg.weight_decay},
                             {"name": "no_decay", "lr": cfg.lr, "weight_decay": 0.0}]

    @torch.no_grad()
    def step(self, loss: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, None]:
        self._finish_grads()
        grads = self._grads()
        counted, expert = ([g[a:b] for g, runs in zip(grads, norm_runs) for a, b in runs]
                           for norm_runs in (self.norm_runs, self.expert_norm_runs))
        found_inf, grad_norm = decide_step(self.grad_scaler, grads, counted, self.ps, True, loss,
                                           expert)
        applied = found_inf == 0
        clip_grads_by_norm(grads, grad_norm, self.cfg.clip_grad)
        self.step_count = self.step_count + applied
        # the copies down run beside the device's step
        self.host.download([g for g, m in zip(grads, self.masters) if self.host.holds(m)],
                           found_inf, self.param_groups[0]["lr"])
        self._adamw(grads, applied)
        self.host.step()
        self._publish()  # (after a skipped step: the values the model already holds)
        return applied, grad_norm, None

    def _publish(self) -> None:
        self._copy_masters_to_model()

    def _offload(self, landings: List[torch.Tensor]) -> List[int]:
        """--optimizer-cpu-offload: the first shards up to the fraction move to the host, each
        updating ``landings[i]``; returns their indices (the subclass lets their masters go)."""
        chosen = host_units([m.numel() for m in self.masters], self.cfg)
        for i in chosen:
            self.masters[i], self.exp_avg[i], self.exp_avg_sq[i] = self.host.add(
                self.masters[i], landings[i], self.runs[i], True)
        self.host.build()
        return chosen

    def _wait_param_sync(self) -> None:
        """Never read or write the params while a gather of them is in flight (ZeRO-1/2)."""

    def _scalar(self, x) -> torch.Tensor:
        """A 0-dim float64 device tensor: an lr the scheduler wrote already is one; a host float
        set by hand becomes one by a fill, not a copy from the host."""
        if torch.is_tensor(x):
            return x.double()
        return torch.full((), x, dtype=torch.float64, device=self.ps.device)

    def _adamw(self, grads: List[torch.Tensor], applied: torch.Tensor) -> None:
        """torch.optim.AdamW's update in the order and roundings of its foreach path (so a ZeRO
        run matches a single-process torch run), decay and lr per run, written only where
        ``applied`` (docs/performance.md, "A step with no host read"). The scalars are 0-dim
        float64 device tensors, the double arithmetic of the host floats they replace: torch.sqrt
        of a double may differ from math.sqrt in the last bit, but cast to float32, as the
        division takes it, it agrees for every step count up to 10^6 and beta2 in {0.9, 0.95,
        0.98, 0.99, 0.999} (checked)."""
        cfg, groups, t = self.cfg, self.param_groups, self.step_count
        beta1, beta2 = cfg.adam_beta1, cfg.adam_beta2
        lrs = [self._scalar(g["lr"]) for g in groups]
        decay = [1 - lr * g["weight_decay"] if g["weight_decay"] != 0 else None
                 for lr, g in zip(lrs, groups)]
        bias_correction1 = 1 - torch.pow(beta1, t)
        bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, t))
        step_size = [-lr / bias_correction1 for lr in lrs]
        # one lr for the whole shard (the scheduler writes the same tensor into every group)
        same = len({id(g["lr"]) if torch.is_tensor(g["lr"]) else g["lr"] for g in groups}) == 1
        for p, m, v, g, runs in zip(self.masters, self.exp_avg, self.exp_avg_sq, grads,
                                    self.runs):
            if self.host.holds(p):
                continue  # stepped on the host
            for lo in range(0, p.numel(), _CHUNK):
                hi = min(lo + _CHUNK, p.numel())
                piece = [(max(a, lo) - lo, min(b, hi) - lo, gi) for a, b, gi in runs
                         if a < hi and b > lo]
                m1 = torch.lerp(m[lo:hi], g[lo:hi], 1 - beta1)
                v1 = v[lo:hi] * beta2
                v1.addcmul_(g[lo:hi], g[lo:hi], value=1 - beta2)
                denom = torch.sqrt(v1)
                denom.div_(bias_correction2_sqrt)
                denom.add_(cfg.adam_eps)
                p1 = p[lo:hi].clone()
                for gi, c in enumerate(decay):
                    views = [p1[a:b] for a, b, k in piece if k == gi]
                    if c is not None and views:
                        torch._foreach_mul_(views, c)
                # p + (value * m) / denom: addcdiv's own order of operations
                if same:
                    u = m1 * step_size[0]
                    p1.add_(u.div_(denom))
                else:
                    for a, b, gi in piece:  # padding outside the runs stays 0
                        p1[a:b].add_((m1[a:b] * step_size[gi]).div_(denom[a:b]))
                del denom
                for old, new in ((p, p1), (m, m1), (v, v1)):
                    torch.where(applied, new, old[lo:hi], out=old[lo:hi])

    def _common_state(self) -> dict:  # (read at a save: the files hold numbers)
        return {"step": int(self.step_count),
                "param_groups": [{k: (float(v) if k == "lr" else v) for k, v in g.items()
                                  if k != "params"} for g in self.param_groups],
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None}

    def _load_common(self, sd: dict) -> None:
        self.step_count = torch.full((), float(int(sd["step"])), dtype=torch.float64,
                                     device=self.ps.device)
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            g["lr"] = saved["lr"]  # weight decay stays this run's flag
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])
        for st in self.host.moments.values():  # the host AdamW's own counts
            st["step"].fill_(int(sd["step"]))

    def _local(self):
        return zip(self.segments, zip(self.masters, self.exp_avg, self.exp_avg_sq))

    def state_dict(self) -> dict:
        """This DP rank's shards, SHARD_FORMAT (docs/checkpoints.md, "Optimizer state files")."""
        self._wait_param_sync()
        sd = {"format": SHARD_FORMAT, "zero_stage": self.zero_stage, "dp_size": self.dp_size,
              "dp_rank": self.dp_rank, **self._expert_layout(), **self._common_state(),
              "shards": [{"segments": [list(g) for g in segs],
                          **{k: t.detach().clone() for k, t in zip(ADAM_KINDS, ts)}}
                         for segs, ts in self._local()]}
        if self._expert_layout():
            for shard, expert in zip(sd["shards"], self.shard_is_expert):
                shard["expert"] = expert
        return sd

    def _expert_layout(self) -> dict:
        """The expert grid position a file records where expert shards lie apart (any of EP, ETP,
        TP above 1: ``ParallelState.experts_apart``; docs/checkpoints.md, "Experts")."""
        ps = self.ps
        if not any(self.shard_is_expert):
            return {}
        return {"etp_size": ps.etp_size, "etp_rank": ps.etp_rank, "ep_size": ps.ep_size,
                "ep_rank": ps.ep_rank, "edp_size": ps.edp_size, "edp_rank": ps.edp_rank}

    def shard_fits(self, sd: dict) -> bool:
        """Whether ``sd`` is this very rank's shard (format, DP size and rank, the same segments
        in shards of the same sizes); else the loader merges every rank's file."""
        mine = [[t[0].numel(), [list(g) for g in segs]] for segs, t in self._local()]
        return (sd.get("format") == SHARD_FORMAT and sd.get("dp_size") == self.dp_size
                and sd.get("dp_rank") == self.dp_rank
                and all(sd.get(k) == v for k, v in self._expert_layout().items())
                and [[s["master"].numel(), [list(g) for g in s["segments"]]]
                     for s in sd.get("shards", [])] == mine)

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """This rank's own shard, or an unsharded state (FULL_FORMAT) from any DP size. Local:
        ZeRO-1/2 then need :meth:`sync_model_params`, once every rank has read its files."""
        if sd.get("format") == FULL_FORMAT:
            return self.load_full_state(sd)
        if not self.shard_fits(sd):
            raise ValueError(
                f"optimizer shard was saved by DP rank {sd.get('dp_rank')} of {sd.get('dp_size')} "
                f"with another layout, this is rank {self.dp_rank} of {self.dp_size}: load the "
                f"unsharded state instead (gather_full_state() or merge_shard_state_dicts(), then "
                f"load_full_state(); docs/data_parallel.md)")
        self._wait_param_sync()
        for saved, (_, ts) in zip(sd["shards"], self._local()):
            for k, t in zip(ADAM_KINDS, ts):
                t.copy_(saved[k])
        self.host.upload()
        self._copy_masters_to_model()
        self._load_common(sd)

    @torch.no_grad()
    def gather_full_state(self) -> dict:
        """Unsharded fp32 masters and Adam moments by parameter name (this TP/PP rank's shapes).
        Collective over DP; every DP rank gets the same dict."""
        self._wait_param_sync()
        params: Dict[str, Dict[str, torch.Tensor]] = {}
        for i, ts in enumerate(zip(self.masters, self.exp_avg, self.exp_avg_sq)):
            # (on the device, which the gather serves: offloaded state lives on the host)
            full = [self._gather_flat(i, t.detach().to(self.ps.device)) for t in ts]
            for name, off, shape in self._flat_slots(i):
                n = math.prod(shape)
                params[name] = {k: f[off:off + n].view(shape).clone()
                                for k, f in zip(ADAM_KINDS, full)}
        return {"format": FULL_FORMAT, **self._common_state(), "params": params}

    @torch.no_grad()
    def load_full_state(self, full: dict) -> None:
        """Re-split an unsharded state (from any DP size) into this rank's shards, and the model
        params from its masters. Local: every rank reads the full tensors."""
        if full.get("format") != FULL_FORMAT:
            raise ValueError(f"not an unsharded optimizer state (format {full.get('format')!r})")
        params = full["params"]
        self._wait_param_sync()
        for segs, ts in self._local():
            for name, lo, hi, plo, shape in segs:
                if name not in params:
                    raise ValueError(f"the optimizer state has no parameter {name}")
                for k, t in zip(ADAM_KINDS, ts):
                    src = params[name][k]
                    if list(src.shape) != list(shape):
                        raise ValueError(f"optimizer state for {name} has shape "
                                         f"{tuple(src.shape)}, the model {tuple(shape)}: a "
                                         f"different TP layout?")
                    t[lo:hi].copy_(src.reshape(-1)[plo:plo + hi - lo])
        self._load_full_model(params)
        self._load_common(full)

    def _load_full_model(self, params: Dict[str, Dict[str, torch.Tensor]]) -> None:
        self.host.upload()
        self._copy_masters_to_model()

    def model_state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        """The tensors megalite/memory.py counts as masters and optimizer states."""
        device = [t for t in self.masters if not self.host.holds(t)]  # (the host's: not counted)
        return {"master_params": device, "optimizer_states": [
            t for t in (*self.exp_avg, *self.exp_avg_sq) if not self.host.holds(t)]}

