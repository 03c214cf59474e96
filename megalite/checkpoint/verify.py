"""Loads that prove themselves (docs/checkpoints.md): a save records a probe loss and the norms of
the optimizer state, as any layout computes them; a load recomputes both and refuses a change."""

from __future__ import annotations

import math
import os
import re
from typing import Dict, Optional

import torch

from megalite import collectives as C
from megalite.checkpoint.format import (RECORD_FILE, CheckpointError, load_file,
                                        loadable_iteration_dir, read_tracker)
from megalite.checkpoint.layout import Layout
from megalite.config import CHECKPOINT_ARGS_FIELDS
from megalite.optimizer.clip_grads import counts_for_norm
from megalite.optimizer.optimizer import ADAM_KINDS
from megalite.param_meta import param_meta

# Relative tolerances: docs/checkpoints.md, "The tolerance" (what layout rounding leaves).
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
NORM_RTOL = 1e-5
PROBE_SEED = 20260607  # the probe's tokens ("The probe")


def describe_layout(cfg, ps) -> str:
    return (f"{Layout.of_config(cfg).describe()} cp={ps.cp_size} dp={ps.dp_size} ep={ps.ep_size} "
            f"etp={ps.etp_size} zero={cfg.optimizer.zero_stage} {cfg.model.params_dtype}")


def _probe_of(cfg) -> str:  # what the probe's loss depends on beside the weights (else: unchecked)
    return repr([cfg.model.output_vocab_size, cfg.model.params_dtype]
                + [getattr(cfg.model, n) for n in CHECKPOINT_ARGS_FIELDS])


def _counted_state(model_chunks, optimizer, ps):
    """(name, kind, tensor) of the optimizer state this rank counts, so that the world counts
    each element once: the gradient norm's rule (clip_grads), plus DP rank 0 of replicas."""
    if getattr(optimizer, "sharded_state_dict_per_dp_rank", False):  # ZeRO: disjoint over DP
        if ps.dp_cp_rank >= ps.zero_size:  # HSDP: instance 0's shards (the others are copies)
            return
        for i, segments in enumerate(optimizer.segments):
            runs = {tuple(r) for r in (*optimizer.norm_runs[i], *optimizer.expert_norm_runs[i])}
            state = (optimizer.masters[i], optimizer.exp_avg[i], optimizer.exp_avg_sq[i])
            for name, lo, hi, _, _ in segments:
                if (lo, hi) in runs:  # (ZeRO 1/2 prefix several chunks' names "chunk{c}.")
                    yield from ((re.sub(r"^chunk\d+\.", "", name), kind, t[lo:hi])
                                for kind, t in zip(ADAM_KINDS, state))
        return
    names = {p: n for c in model_chunks for n, p in getattr(c, "module", c).named_parameters()}
    for p, m in zip(optimizer.model_params, optimizer.masters):
        expert = ps.experts_apart and param_meta(p).expert  # (replicated over EDP only)
        mine = (ps.edp_rank == 0 and counts_for_norm(p, ps.etp_rank, True) if expert else
                ps.dp_cp_rank == 0 and counts_for_norm(p, ps.tp_rank, ps.is_pipeline_first_stage))
        if mine:
            st = sorted(optimizer.inner.state.get(m, {}).items())  # the moments (not "step")
            yield from ((names[p], k, t) for k, t in [("master", m), *st]
                        if torch.is_tensor(t) and t.shape == m.shape)


@torch.no_grad()
def fingerprint(model_chunks, optimizer, ps) -> Dict[str, Dict[str, float]]:
    """{parameter name: {"master" and each moment: its L2 norm over the whole model}}, alike at
    any layout. Collective: one gather of this rank's squares (one host read)."""
    counted = list(_counted_state(model_chunks, optimizer, ps))
    # (float64, in pieces of 2^24: an fp32 norm of 5e7 elements is 1e-3 off, by the cut's amount)
    squares = [sum(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2
                   for x in t.detach().reshape(-1).split(1 << 24)) for _, _, t in counted]
    # (one device: offloaded optimizer state's squares are on the host)
    squares = torch.stack([s.to(ps.device) for s in squares]).tolist() if squares else []
    total: Dict[str, Dict[str, float]] = {}
    local = [(name, kind, sq) for (name, kind, _), sq in zip(counted, squares)]
    for part in C.all_gather_object(local, C.world_group()):
        for name, kind, sq in part:
            total.setdefault(name, {})[kind] = total.get(name, {}).get(kind, 0.0) + sq
    return {n: {k: math.sqrt(v) for k, v in ks.items()} for n, ks in sorted(total.items())}


def make_record(probe_loss: float, model_chunks, optimizer, iteration: int, cfg, ps) -> dict:
    """What a save writes as RECORD_FILE (collective); no norms with --no-save-optim."""
    state = {} if cfg.checkpoint.no_save_optim else {
        "optimizer": fingerprint(model_chunks, optimizer, ps)}
    return {"iteration": iteration, "layout": describe_layout(cfg, ps),
            "probe_of": _probe_of(cfg), "probe_loss": probe_loss, **state}


def read_record(load_dir: str) -> Optional[dict]:
    """The record of the checkpoint ``--load`` resumed, or None (imported, or saved without)."""
    path = os.path.join(loadable_iteration_dir(load_dir, read_tracker(load_dir)), RECORD_FILE)
    return load_file(path, f"--load {load_dir}") if os.path.isfile(path) else None


def check_record(record: dict, probe_loss: float, state: Optional[dict], cfg, ps) -> None:
    """CheckpointError (one line) on a norm that differs (``state`` None: none), then the probe."""
    def refuse(what: str, saved: float, now: float):
        raise CheckpointError(f"--load {cfg.checkpoint.load}: iteration {record['iteration']} "
                              f"does not load as saved: {what} is {now:.9g}, saved {saved:.9g} "
                              f"(saved at {record['layout']}; this run: {describe_layout(cfg, ps)})"
                              f"; pass --no-verify-load to load it anyway")
    for name, kinds in (record.get("optimizer", {}) if state is not None else {}).items():
        for kind, saved in kinds.items():  # (a moment gone is one of norm 0)
            if abs(state.get(name, {}).get(kind, 0.0) - saved) > NORM_RTOL * abs(saved):
                refuse(f"the norm of {name}'s {kind}", saved, state.get(name, {}).get(kind, 0.0))
    rtol = LOSS_RTOL[cfg.model.params_dtype] if record["probe_of"] == _probe_of(cfg) else math.inf
    if not abs(probe_loss - record["probe_loss"]) <= rtol * abs(record["probe_loss"]):
        refuse("the probe loss", record["probe_loss"], probe_loss)
