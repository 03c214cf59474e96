"""Restoring a run from a checkpoint, at its own layout or resharded on load
(docs/checkpoints.md: "Resuming", "Resharding on load", "Experts")."""

from __future__ import annotations

import glob
import os
from typing import Callable, List, Optional, Tuple

import torch

from megalite import collectives as C
from megalite.checkpoint.experts import keep_local_experts
from megalite.checkpoint.format import (MODEL_FILE, RESHARD_HINT, TRACKER_FILE, CheckpointError,
                                        chunk_key, distrib_optim_name, latest_iteration,
                                        load_file, loadable_iteration_dir,
                                        read_checkpoint_config, read_tracker, shard_dir_name)
from megalite.checkpoint.layout import Layout
from megalite.checkpoint.optim_state import merge_rank_files
from megalite.checkpoint.reshard import load_resharded
from megalite.config import ConfigError, MegaliteConfig, model_shape_differences
from megalite.optimizer.optimizer import FULL_FORMAT
from megalite.param_meta import ParamMeta, param_meta
from megalite.tensor_parallel.random import (get_all_rng_states, model_parallel_seed,
                                             set_all_rng_states)


def agree_on_errors(ps, error: Optional[BaseException]) -> None:
    """If any rank failed to load, every rank raises (so none waits forever in a collective)."""
    flag = torch.tensor([1.0 if error is not None else 0.0])  # host path
    if ps.world_size > 1:
        C.all_reduce(flag, group=C.world_group(), op=C.ReduceOp.MAX, tag="checkpoint_error_flag",
                     host=True)
    if flag.item() > 0:
        if error is not None:
            raise error
        raise CheckpointError("loading the checkpoint failed on another rank (see its message)")


def _as_checkpoint_error(e: BaseException, what: str, file: str) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, ConfigError):  # the resharder's, naming its own file
        return CheckpointError(str(e))
    return CheckpointError(f"{what}: loading {file} failed: {C.one_line(e)}")


def _load_dp_files(shard: str, what: str) -> List[dict]:
    """Every DP rank's ZeRO optimizer file of one (TP, PP) directory, each once, or a one-line
    error naming the file that is missing."""
    files = sorted(glob.glob(os.path.join(shard, "distrib_optim_dp*.pt")))
    if not files:
        raise CheckpointError(f"{what}: {shard} has no distrib_optim_dp*.pt (the checkpoint's "
                              f"optimizer state is not sharded per DP rank); resume with the "
                              f"--zero-stage that saved it, or pass --no-load-optim")
    sds = [load_file(f, what) for f in files]
    gone = [distrib_optim_name(d) for d in range(int(sds[0].get("dp_size", 0)))
            if not os.path.exists(os.path.join(shard, distrib_optim_name(d)))]
    if gone:  # a file of the saving DP group is missing: name it, not the merge that fails
        raise CheckpointError(f"{what}: {os.path.join(shard, gone[0])} is missing (incomplete "
                              f"checkpoint)")
    return sds


def _load_dp_sharded_optimizer_state(it_dir: str, optimizer, ps, what: str) -> dict:
    """This DP rank's ZeRO optimizer shard; if it was saved at another DP size (or bucket layout,
    ZeRO stage, EP size), every DP rank's file merged into the unsharded state, which the
    optimizer re-splits (docs/data_parallel.md, "resharding")."""
    shard = os.path.join(it_dir, shard_dir_name(ps.tp_rank, ps.pp_rank))
    own = os.path.join(shard, distrib_optim_name(ps.zero_rank))
    if os.path.exists(own):
        sd = load_file(own, what, mmap=True)  # read whole only if it fits (load_state_dict copies)
        if optimizer.shard_fits(sd):
            return sd
    metas = {n: param_meta(p) for n, p in optimizer.param_names.items()}

    def tp_files(t):
        return _load_dp_files(os.path.join(it_dir, shard_dir_name(t, ps.pp_rank)), what)

    try:
        return merge_rank_files(_load_dp_files(shard, what), tp_files, ps.tp_size, ps.tp_rank,
                                lambda n: metas.get(n, ParamMeta()))
    except CheckpointError:  # a missing or corrupt file, named
        raise
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{what}: the distrib_optim_dp*.pt files in {shard} do not fit this "
                              f"optimizer ({e}); resume with the --zero-stage that saved them, "
                              f"or pass --no-load-optim")


def _describe(layout: Layout, per_dp: bool) -> str:
    return f"{layout.describe()}, {'ZeRO' if per_dp else 'plain (ZeRO 0)'} optimizer"


def _layout_change(cfg: MegaliteConfig, saved_cfg: MegaliteConfig, it_dir: str, per_dp: bool,
                   load_optim: bool, what: str) -> Optional[str]:
    """None where the checkpoint's files fit this run's layout and optimizer kind as they are,
    else the change (for the log line): resharding on load makes any such change."""
    # the first stage's file says where the optimizer state is (memory-mapped: only its small
    # entries are read)
    head = load_file(os.path.join(it_dir, shard_dir_name(0, 0), MODEL_FILE), what, mmap=True)
    saved_per_dp = "opt_param_scheduler" in head and "optimizer" not in head
    del head
    saved, mine = Layout.of_config(saved_cfg), Layout.of_config(cfg)
    if saved.same_files(mine, cfg.model.num_layers) and not (load_optim and saved_per_dp != per_dp):
        return None
    return f"saved with {_describe(saved, saved_per_dp)}, this run uses {_describe(mine, per_dp)}"


def _read_state(cfg: MegaliteConfig, it_dir: str, iteration: int, optimizer, ps, per_dp: bool,
                load_optim: bool, resharded: Optional[str], what: str
                ) -> Tuple[dict, Optional[dict]]:
    """This rank's model file and optimizer state (None without one to load)."""
    if resharded:
        # expert shards that follow the expert grid (EP, ETP, EDP) take the unsharded state
        apart = per_dp and any(getattr(optimizer, "shard_is_expert", ()))
        state, opt_sd = load_resharded(cfg.checkpoint.load, iteration, cfg, ps, load_optim,
                                       apart)
        if load_optim and per_dp and not apart and not optimizer.shard_fits(opt_sd):
            raise CheckpointError(
                f"{what}: {resharded}: the optimizer shard assembled for this rank does not "
                f"fit its optimizer (another bucket or unit layout); {RESHARD_HINT}")
        return state, opt_sd
    state = load_file(os.path.join(it_dir, shard_dir_name(ps.tp_rank, ps.pp_rank), MODEL_FILE),
                      what)
    if not load_optim:
        return state, None
    if "opt_param_scheduler" not in state:
        raise CheckpointError(f"{what}: the checkpoint has no optimizer state (saved with "
                              f"--no-save-optim); pass --no-load-optim or --finetune")
    if per_dp:
        return state, _load_dp_sharded_optimizer_state(it_dir, optimizer, ps, what)
    if "optimizer" not in state:
        raise CheckpointError(f"{what}: the optimizer state was saved per data-parallel rank "
                              f"(ZeRO); load with the same --zero-stage / "
                              f"--use-distributed-optimizer")
    return state, state["optimizer"]


def _restore(state: dict, opt_sd: Optional[dict], model_chunks, optimizer, scheduler, ps,
             per_dp: bool, what: str) -> None:
    """Copy the files' contents into this rank's model chunks, optimizer and scheduler (local)."""
    # (a ZeRO shard that fits this rank is its own already; a merged one holds all experts)
    whole = opt_sd is not None and (not per_dp or opt_sd.get("format") == FULL_FORMAT)
    keep_local_experts(state, opt_sd if whole else None, model_chunks, optimizer, ps)
    for i, chunk in enumerate(model_chunks):
        missing, unexpected = chunk.load_state_dict(state[chunk_key(i, len(model_chunks))],
                                                    strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{what}: model weights do not match this model (missing "
                                  f"{list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
    optimizer.reload_model_params()
    if opt_sd is not None:
        try:
            optimizer.load_state_dict(opt_sd)
        except Exception as e:
            raise CheckpointError(f"{what}: optimizer state does not fit this optimizer ({e}); "
                                  f"pass --no-load-optim to start the optimizer afresh")
        scheduler.load_state_dict(state["opt_param_scheduler"])


def _reseeded_rng(seed: int, iteration: int, ps) -> dict:
    """The RNG states of a rank resuming at another layout: seeded as a run with ``--seed seed +
    iteration`` seeds this rank (``model_parallel_seed``). Returned, not set."""
    before = get_all_rng_states(ps.device)
    model_parallel_seed(seed + iteration, ps.tp_rank, ps.pp_rank, ps.device)
    out = get_all_rng_states(ps.device)
    set_all_rng_states(before, ps.device)
    return out


def load_checkpoint(cfg: MegaliteConfig, model_chunks, optimizer, scheduler, ps,
                    log: Optional[Callable[[str], None]] = None
                    ) -> Tuple[int, int, Optional[dict]]:
    """Restore from ``cfg.checkpoint.load``. Collective. Returns (iteration, consumed_samples,
    rng_state or None): the RNG state is set by the caller right before the first step. A
    checkpoint of another layout or optimizer kind is resharded on load, its RNG re-seeded
    (said once on ``log``)."""
    ck = cfg.checkpoint
    what = f"--load {ck.load}"
    iteration, error = None, None
    try:
        if not os.path.isdir(ck.load):
            raise CheckpointError(f"{what}: no such directory")
        iteration = read_tracker(ck.load)
    except Exception as e:  # e.g. an unreadable tracker: every rank must hear of it
        error = e if isinstance(e, CheckpointError) else CheckpointError(f"{what}: {C.one_line(e)}")
    agree_on_errors(ps, error)
    if iteration is None:
        if ck.exit_on_missing_checkpoint:
            raise CheckpointError(f"{what}: no {TRACKER_FILE} (no completed checkpoint) and "
                                  f"--exit-on-missing-checkpoint was given")
        if ck.load != ck.save:
            latest_iteration(ck.load, what)  # no tracker: raises "not a megalite checkpoint"
        return 0, 0, None  # --save X --load X on a first run: start from scratch

    # Phase 1, local: read and validate every file this rank needs and copy it into this rank's
    # own tensors; any exception counts. Phase 2, after every rank agrees phase 1 succeeded: the
    # collectives (ZeRO-1/2's parameter all-gather). A rank that failed can then never leave its
    # peers waiting in a collective it does not join.
    it_dir = loadable_iteration_dir(ck.load, iteration)
    own_file = os.path.join(it_dir, shard_dir_name(ps.tp_rank, ps.pp_rank), MODEL_FILE)
    load_optim = not (ck.finetune or ck.no_load_optim)
    per_dp = bool(getattr(optimizer, "sharded_state_dict_per_dp_rank", False))
    resharded = None
    try:
        if not os.path.isdir(it_dir):
            raise CheckpointError(f"{what}: {TRACKER_FILE} names iteration {iteration} but "
                                  f"{it_dir} does not exist")
        saved_cfg = read_checkpoint_config(ck.load, iteration)
        diffs = model_shape_differences(saved_cfg.model, cfg.model)
        if diffs:
            raise CheckpointError(
                f"{what}: the checkpoint has a different model shape: {'; '.join(diffs)} "
                f"(pass the checkpoint's values or --use-checkpoint-args)")
        resharded = _layout_change(cfg, saved_cfg, it_dir, per_dp, load_optim, what)
        state, opt_sd = _read_state(cfg, it_dir, iteration, optimizer, ps, per_dp, load_optim,
                                    resharded, what)
        _restore(state, opt_sd, model_chunks, optimizer, scheduler, ps, per_dp, what)
    except Exception as e:  # any failure, not only ours: a peer must not wait for this rank
        error = _as_checkpoint_error(e, what, it_dir if resharded else own_file)
    agree_on_errors(ps, error)
    if load_optim and hasattr(optimizer, "sync_model_params"):
        optimizer.sync_model_params()

    if ck.finetune:
        return 0, 0, None
    rng = None if ck.no_load_rng else state.get("rng_state")
    if resharded and not ck.no_load_rng:
        seed = saved_cfg.training.seed
        rng = _reseeded_rng(seed, iteration, ps)
        if log is not None:
            log(f" resharded on load ({resharded}): RNG re-seeded from seed {seed} and iteration "
                f"{iteration}, so data and weights resume exactly but dropout masks differ from "
                f"an uninterrupted run's")
    return int(state["iteration"]), int(state["consumed_samples"]), rng
