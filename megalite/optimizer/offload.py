"""Optimizer state on the host (``--optimizer-cpu-offload``): the fp32 masters and Adam moments of
the first units of an optimizer (parameters at ZeRO 0, shards at ZeRO 1-3) that together hold
``--optimizer-offload-fraction`` of its elements live in host memory and step there with torch's
own CPU AdamW (docs/offload.md). The gradients go down and the updated weights come back on a side
stream (pinned buffers and events on CUDA; on CPU the same copies, host to host)."""

from __future__ import annotations

import contextlib
import itertools
from typing import List, Sequence

import torch


def host_units(sizes: Sequence[int], cfg) -> List[int]:
    """The first units (by index) holding at least the offloaded fraction of the elements."""
    goal = sum(sizes) * cfg.optimizer_offload_fraction * cfg.optimizer_cpu_offload
    return [i for i, before in enumerate(itertools.accumulate([0, *sizes[:-1]])) if before < goal]


class HostAdamW:
    """torch.optim.AdamW (fused, on the CPU) over host copies of some units' fp32 masters; with
    none added, every method does nothing. Per step: :meth:`download` queues the gradients, the
    skip flag and the lr into pinned host buffers; :meth:`step` waits for them, steps (the fused
    kernel takes ``found_inf`` as a host tensor: a skipped step is skipped there and its count
    taken back, with no read on the host) and queues the weights back (:meth:`upload`)."""

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.device, self.opt = cfg, device, None
        cuda = device.type == "cuda" and cfg.optimizer_cpu_offload
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.done = torch.cuda.Event() if self.stream is not None else None
        self.groups = ([], [])  # the views that decay, those that do not
        self.grads: list = []  # per unit: its host gradient and [(view, view's gradient)]
        self.units: list = []  # per unit: (host master, staging, device landing)
        self.moments: dict = {}  # the sharded units' torch state, views of flat moments
        self.ids: set = set()  # the host masters and moments, by id
        self.flag, self.lr = self._pinned(()), self._pinned((), torch.float64)
        self.present: List[bool] = []  # per unit: whether this step's gradient exists

    def _pinned(self, shape, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=self.stream is not None)

    def holds(self, t: torch.Tensor) -> bool:
        return id(t) in self.ids

    @torch.no_grad()
    def add(self, master: torch.Tensor, landing: torch.Tensor, runs, sharded: bool) -> tuple:
        """A unit: its fp32 ``master`` values move to the host; ``landing`` (device) receives the
        updated weights; ``runs`` ``[(lo, hi, group)]`` (group 0 decays). ``sharded``: a flat
        shard, whose moments are flat host tensors the runs view (the ZeRO files' layout); else
        one parameter, whose moments torch's state holds. Returns (master, moments) on the host."""
        host, grad = self._pinned(master.shape), self._pinned(master.shape)
        host.copy_(master)
        staging = host if landing.dtype == torch.float32 else self._pinned(host.shape,
                                                                           landing.dtype)
        moments = (torch.zeros_like(host), torch.zeros_like(host)) if sharded else (None, None)
        pairs = []
        for lo, hi, group in runs:
            view = host[lo:hi] if sharded else host
            self.groups[group].append(view)
            pairs.append((view, grad[lo:hi] if sharded else grad))
            if sharded:
                self.moments[view] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": moments[0][lo:hi],
                                      "exp_avg_sq": moments[1][lo:hi]}
        self.grads.append((grad, pairs))
        self.units.append((host, staging, landing))
        self.ids.update(id(t) for t in (host, *moments) if t is not None)
        return (host, *moments)

    def build(self, state=None) -> None:
        """The CPU AdamW over the units added, sharing ``state`` if given (ZeRO 0's torch one)."""
        cfg = self.cfg
        groups = [{"params": ps, "weight_decay": wd} for ps, wd in
                  zip(self.groups, (cfg.weight_decay, 0.0)) if ps]
        if groups:
            self.opt = torch.optim.AdamW(groups, lr=cfg.lr, eps=cfg.adam_eps, fused=True,
                                         betas=(cfg.adam_beta1, cfg.adam_beta2))
            self.opt.state = self.opt.state if state is None else state
            self.opt.state.update(self.moments)

    def _on_side(self):
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    @torch.no_grad()
    def download(self, grads: list, found_inf: torch.Tensor, lr) -> None:
        """Queue the device gradients of the units (in order; None: a parameter without one,
        which the step leaves alone as torch's does), the skip flag and the lr to the host."""
        if self.opt is None:
            return
        lr = lr if torch.is_tensor(lr) else torch.full((), lr, dtype=torch.float64)
        self.present = [g is not None for g in grads]
        copies = [(buf, g) for (buf, _), g in zip(self.grads, grads) if g is not None]
        with self._on_side():
            for buf, src in copies + [(self.flag, found_inf), (self.lr, lr)]:
                if src.is_cuda:  # (the main stream may free it meanwhile: a 16-bit's fp32 copy)
                    src.record_stream(self.stream)
                buf.copy_(src.reshape(buf.shape), non_blocking=True)
            if self.done is not None:
                self.done.record(self.stream)

    @torch.no_grad()
    def step(self) -> None:
        if self.opt is None:
            return
        if self.done is not None:
            self.done.synchronize()  # the gradients are on the host (a wait, not a read)
        for group in self.opt.param_groups:
            group["lr"] = self.lr
        views = [(v, g if present else None) for (_, pairs), present in
                 zip(self.grads, self.present) for v, g in pairs]
        for view, grad in views:  # (only now: ZeRO 0's device step sees the same masters)
            view.grad = grad
        self.opt.found_inf = self.flag  # read by the fused kernel, on the host
        self.opt.step()
        for view, _ in views:
            view.grad = None
        self.upload()

    @torch.no_grad()
    def upload(self) -> None:
        """Queue the host masters into the device landings (rounded on the host for 16-bit
        landings: half the bytes); the device's next work waits for them."""
        with self._on_side():
            for host, staging, landing in self.units:
                if staging is not host:
                    staging.copy_(host)
                landing.copy_(staging.view_as(landing), non_blocking=True)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    @torch.no_grad()
    def reload(self) -> None:
        """Host masters <- device landings (after model weights were loaded without state)."""
        for host, _, landing in self.units:
            host.copy_(landing.reshape(host.shape))
