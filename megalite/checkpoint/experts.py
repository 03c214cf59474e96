"""Expert tensors in checkpoints: saved whole, ``[E, ...]`` by global expert index, whatever the
EP and ETP sizes; a load keeps this rank's part (docs/checkpoints.md, "Experts")."""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple, Optional, Tuple

import torch

from megalite import collectives as C
from megalite.checkpoint.format import CheckpointError, chunk_key
from megalite.moe.layer import MoELayer
from megalite.optimizer.optimizer import FULL_FORMAT
from megalite.param_meta import param_meta
from megalite.tensor_parallel.utils import shard_tensor, unshard_tensors


class Expert(NamedTuple):
    """One expert tensor of a MoE layer."""
    chunk: int
    key: str  # in the chunk's state_dict
    param: torch.nn.Parameter
    shape: Tuple[int, ...]  # this rank's [E_local, ...] (a ZeRO-3 parameter's data is a stand-in)
    first: int  # global index of its first expert
    total: int  # E
    group: object  # the EP group that holds the other E - E_local


def experts_of(model_chunks) -> list:
    """Every expert tensor of every MoE layer on this rank."""
    out = []
    for i, chunk in enumerate(model_chunks):
        module = getattr(chunk, "module", chunk)  # a DDP / ZeRO-3 wrapper's keys are its module's
        shapes = {n: tuple(s) for u in getattr(chunk, "units", ()) for n, s in zip(u.names,
                                                                                  u.shapes)}
        for prefix, m in module.named_modules():
            if not isinstance(m, MoELayer):
                continue
            for name, p in m.named_parameters(recurse=False):
                if param_meta(p).expert:
                    key = f"{prefix}.{name}" if prefix else name
                    out.append(Expert(i, key, p, shapes.get(key, tuple(p.shape)),
                                      m.local_expert_offset, m.num_experts, m.groups.ep))
    return out


def split_experts(model_chunks) -> list:
    """The expert tensors this rank holds a part of: split over EP ranks (E_local < E) or, under
    ETP > 1, sliced over the ETP group (their metadata's ``tp_split``)."""
    return [e for e in experts_of(model_chunks)
            if e.shape[0] != e.total or param_meta(e.param).tp_split]


def whole_shape(e: Expert, ps) -> Tuple[int, ...]:
    """[E, ...] of one whole expert tensor: E_local x EP experts, each with its ETP slices."""
    shape, m = [e.total, *e.shape[1:]], param_meta(e.param)
    if m.tp_split:
        shape[m.partition_dim] *= ps.etp_size
    return tuple(shape)


def gather_whole(t: torch.Tensor, e: Expert, ps) -> torch.Tensor:
    """This rank's part of an expert tensor -> the whole [E, ...] one: the ETP slices joined
    along the parameter's partition dim, then the EP ranks' experts along dim 0."""
    m = param_meta(e.param)
    if m.tp_split and ps.etp_size > 1:
        parts = t.new_empty((ps.etp_size,) + tuple(t.shape))
        C.all_gather_into_tensor(parts.view(-1, *t.shape[1:]), t, group=ps.etp_group,
                                 tag="checkpoint_experts")
        t = unshard_tensors(list(parts.unbind(0)), m.partition_dim, m.partition_stride)
    if C.group_size(e.group) > 1:
        full = t.new_empty((t.shape[0] * C.group_size(e.group),) + tuple(t.shape[1:]))
        C.all_gather_into_tensor(full, t, group=e.group, tag="checkpoint_experts")
        t = full
    return t


def optimizer_slots(optimizer, experts):
    """(expert, index in the fp32 master list, index in torch's packed state, master) per expert
    tensor: the plain optimizer keys both by the parameter's position, whatever the EP size."""
    index = {id(p): i for i, p in enumerate(optimizer.model_params)}
    packed = {id(m): j for j, m in
              enumerate(chain.from_iterable(g["params"] for g in optimizer.param_groups))}
    for e in experts:
        i = index.get(id(e.param))
        if i is not None:
            m = optimizer.masters[i]
            yield e, i, packed[id(m)], m


def with_full_experts(sd: dict, experts: dict) -> dict:
    """The plain optimizer's state_dict with the gathered expert tensors in place of this rank's
    (the per-parameter dicts are the live state's own: replaced, never written into)."""
    packed = sd["optimizer"]["state"]
    for (j, k), t in experts.get("state", {}).items():
        packed[j] = {**packed[j], k: t}
    for i, t in experts.get("master", {}).items():
        sd["fp32_master_params"][i] = t
    return sd


def keep_local_experts(state: dict, opt_sd: Optional[dict], model_chunks, optimizer,
                       ps) -> None:
    """On load, in place: this rank's [first, first + E_local) of every saved [E, ...] tensor of
    the model and the optimizer (the plain optimizer's state, or a merged FULL_FORMAT one), and of
    that its ETP slice, cut by the parameter's own partition dim."""
    split = split_experts(model_chunks)
    if not split:
        return

    def local(t, e, what):
        if t.shape[0] != e.total:
            raise CheckpointError(f"{what} holds {t.shape[0]} experts along dim 0, this model "
                                  f"{e.total} (a checkpoint of this model stores all of them)")
        t = t.narrow(0, e.first, e.shape[0])
        m = param_meta(e.param)
        if m.tp_split:
            t = shard_tensor(t, m.partition_dim, ps.etp_rank, ps.etp_size, m.partition_stride)
        return t.clone()

    for e in split:
        sd = state.get(chunk_key(e.chunk, len(model_chunks)), {})
        if e.key in sd:  # a missing key is reported by load_state_dict
            sd[e.key] = local(sd[e.key], e, e.key)
    if opt_sd is None:
        return
    if opt_sd.get("format") == FULL_FORMAT:
        names = {id(p): n for n, p in optimizer.param_names.items()}
        params = opt_sd["params"]
        for e in split:
            name = names.get(id(e.param))
            if name in params:
                params[name] = {k: local(v, e, f"the optimizer's {k} of {name}")
                                for k, v in params[name].items()}
        return
    packed, masters = opt_sd["optimizer"]["state"], opt_sd.get("fp32_master_params")
    for e, i, j, m in optimizer_slots(optimizer, split):
        st = packed.get(j, {})
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() == m.dim():
                st[k] = local(v, e, f"the optimizer's {k} of {e.key}")
        if masters is not None and i < len(masters):
            masters[i] = local(masters[i], e, f"the fp32 master of {e.key}")
