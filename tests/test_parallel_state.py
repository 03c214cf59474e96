"""The rank grids (dense and expert), process groups from torchrun's environment, and the
conjugate collective pairs."""

import itertools

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megalite import collectives as C
from megalite.config import ConfigError, ParallelConfig
from megalite.parallel_state import (
    expert_rank_grid,
    get_parallel_state,
    initialize_model_parallel,
    rank_grid,
)
from megalite.tensor_parallel import mappings as M


def test_rank_grid_is_the_tp_cp_dp_pp_layout_group_by_group():
    """Every group kind, from the rank formula of the module docstring: one group per position
    of the other axes, those positions (and each group's ranks) in pp -> dp -> cp -> tp order,
    the order every rank creates the process groups in."""
    tp, cp, dp, pp = 2, 3, 2, 2
    sizes = dict(p=pp, d=dp, c=cp, t=tp)

    def rank(x):
        return ((x["p"] * dp + x["d"]) * cp + x["c"]) * tp + x["t"]

    def want(of):
        rest = [a for a in "pdct" if a not in of]
        return [[rank({**dict(zip(rest, o)), **dict(zip(of, i))})
                 for i in itertools.product(*(range(sizes[a]) for a in of))]
                for o in itertools.product(*(range(sizes[a]) for a in rest))]

    got = rank_grid(tp * cp * dp * pp, tp, pp, cp)
    assert got == (dp, want("t"), want("d"), want("p"), want("pt"), want("c"), want("dc"))
    with pytest.raises(ConfigError, match=r"world size \(18\).*--context-parallel-size \(3\)"):
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                       context_parallel_size=3).validate(18)


def test_expert_grid_folds_onto_the_same_ranks():
    # world 8, TP 2, EP 4, ETP 1: EP spans two dense TP groups; EDP joins the two EP groups'
    # ranks at the same position
    edp, etp_g, ep_g, edp_g, pp_g = expert_rank_grid(8, 1, 4, 1)
    assert edp == 2 and etp_g == [[r] for r in range(8)] and pp_g == rank_grid(8, 2, 1)[3]
    assert ep_g == [[0, 1, 2, 3], [4, 5, 6, 7]] and edp_g == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for world, pp in ((8, 1), (16, 2), (24, 2)):
        for etp, ep in ((1, 1), (2, 2), (1, 4), (4, 2)):
            if world % (etp * ep * pp):
                continue
            edp, *groups, pp_g = expert_rank_grid(world, etp, ep, pp)
            for g, size in zip(groups + [pp_g], (etp, ep, edp, pp)):  # partitions of the ranks
                assert all(len(r) == size for r in g) and sorted(sum(g, [])) == list(range(world))
            for tp, cp in ((1, 1), (2, 1), (2, 2)):  # the dense grid's pipeline groups
                assert world % (tp * cp * pp) or pp_g == rank_grid(world, tp, pp, cp)[3]
    # ETP = TP, EP = DP x CP: the experts reuse the dense groups, EDP is 1 (the folding's point)
    _, tp_g, _, _, _, _, dp_cp_g = rank_grid(16, 2, 2, 2)
    edp, etp_g, ep_g, edp_g, _ = expert_rank_grid(16, 2, 4, 2)
    assert (edp, etp_g, ep_g, edp_g) == (1, tp_g, dp_cp_g, [[r] for r in range(16)])
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size \(3\)"):
        ParallelConfig(expert_model_parallel_size=3).validate(8)


def test_expert_grid_is_megatrons_expert_rank_generator():
    """The expert groups are the ones megatron-core derives for the same sizes (its
    RankGenerator over tp-ep-dp-pp with the expert sizes), as sets of rank lists."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator

    for world, etp, ep, pp in ((8, 1, 4, 1), (8, 2, 2, 1), (16, 2, 2, 2), (24, 1, 3, 2),
                               (32, 2, 4, 2)):
        edp, etp_g, ep_g, edp_g, pp_g = expert_rank_grid(world, etp, ep, pp)
        ref = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-ep-dp-pp")
        for ours, kind in ((etp_g, "tp"), (ep_g, "ep"), (edp_g, "dp"), (pp_g, "pp")):
            assert sorted(ours) == sorted(ref.get_ranks(kind)), (world, etp, ep, pp, kind)


# (TP, CP, EP, ETP) at world 4: EP over the data ranks, EP beside TP with ETP 1, the defaults
# (the expert groups are the dense ones), and EP over DP x CP
EXPERT_LAYOUTS = ((1, 1, 2, None), (2, 1, 2, 1), (2, 1, 1, None), (1, 2, 4, None))


def _expert_groups_worker(rank, world_size):
    out = []
    for tp, cp, ep, etp in EXPERT_LAYOUTS:
        ps = initialize_model_parallel(tp, 1, context_parallel_size=cp,
                                       expert_model_parallel_size=ep,
                                       expert_tensor_parallel_size=etp, backend="gloo",
                                       device="cpu", set_default=False)
        edp, etp_g, ep_g, edp_g, _ = expert_rank_grid(world_size, etp or tp, ep, 1)
        for kind, groups in (("etp", etp_g), ("ep", ep_g), ("edp", edp_g)):
            ranks = next(g for g in groups if rank in g)
            group = getattr(ps, f"{kind}_group")
            assert getattr(ps, f"{kind}_ranks") == ranks, (kind, tp, ep, etp)
            assert getattr(ps, f"{kind}_size") == len(ranks)
            assert getattr(ps, f"{kind}_rank") == ranks.index(rank)
            assert (group is None) == (len(ranks) == 1)  # a group of one: None, as the others
            t = torch.tensor([float(rank)])
            C.all_reduce(t, group=group)  # sums over exactly those ranks (one: a local no-op)
            assert t.item() == sum(ranks), (kind, t.item(), ranks)
        if ep == 1 and etp is None:  # the defaults: the dense groups themselves
            assert ps.edp_group is ps.dp_cp_group and ps.etp_group is ps.tp_group
        if ep == world_size // tp and (etp or tp) == tp:
            assert ps.ep_group is ps.dp_cp_group
        out.append(ps.describe())
    return out


def test_expert_groups_from_the_expert_grid():
    out = run_distributed(_expert_groups_worker, 4)
    assert out[3][0] == "rank 3/4: tp 0/1 dp 3/4 pp 0/1 | etp 0/1 ep 1/2 edp 1/2"
    assert out[3][1] == "rank 3/4: tp 1/2 dp 1/2 pp 0/1 | etp 0/1 ep 1/2 edp 1/2"
    assert out[3][2] == "rank 3/4: tp 1/2 dp 1/2 pp 0/1"  # dense layout: as before


def _groups_worker(rank, world_size):
    # Picks rank/world size from RANK/WORLD_SIZE set by the harness, as under torchrun.
    ps = initialize_model_parallel(2, 2, backend="gloo", device="cpu")
    assert get_parallel_state() is ps
    assert (ps.tp_size, ps.dp_size, ps.pp_size) == (2, 2, 2)
    assert ps.tp_rank == rank % 2 and ps.dp_rank == (rank // 2) % 2 and ps.pp_rank == rank // 4
    # the group really contains the ranks it claims: all-reduce the global rank over each group
    for group, ranks in ((ps.tp_group, ps.tp_ranks), (ps.dp_group, ps.dp_ranks),
                         (ps.pp_group, ps.pp_ranks)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks)
    assert ps.embedding_ranks == [ps.pp_ranks[0], ps.pp_ranks[-1]]
    assert ps.is_pipeline_first_stage == (rank < 4)
    return ps.describe()


def test_groups_from_torchrun_environment_tp_dp_pp_order():
    out = run_distributed(_groups_worker, 8)
    assert out[5] == "rank 5/8: tp 1/2 dp 0/2 pp 1/2"


def _mappings_worker(rank, world_size):
    ps = initialize_model_parallel(world_size, 1, backend="gloo", device="cpu", set_default=False)
    g = ps.tp_group
    n = world_size
    x = torch.arange(8.0).view(4, 2).add(rank).requires_grad_(True)

    # f: identity forward, all-reduce backward
    y = M.copy_to_tensor_model_parallel_region(x, g)
    assert torch.equal(y, x)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.full_like(x, n))
    x.grad = None
    # g: all-reduce forward, identity backward
    y = M.reduce_from_tensor_model_parallel_region(x, g)
    expect = sum(torch.arange(8.0).view(4, 2) + r for r in range(n))
    assert torch.equal(y, expect)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.ones_like(x))
    x.grad = None
    # SP pair: all-gather along dim 0 forward, reduce-scatter backward
    y = M.gather_from_sequence_parallel_region(x, g)
    assert y.shape == (4 * n, 2) and torch.equal(y[4 * rank:4 * rank + 4], x)
    y.backward(torch.ones_like(y) * (rank + 1))
    assert torch.equal(x.grad, torch.full_like(x, sum(range(1, n + 1))))
    x.grad = None
    # reduce-scatter forward, all-gather backward
    z = torch.ones(4 * n, 2, requires_grad=True)
    y = M.reduce_scatter_to_sequence_parallel_region(z, g)
    assert y.shape == (4, 2) and torch.equal(y, torch.full((4, 2), float(n)))
    y.backward(torch.full_like(y, float(rank)))
    assert torch.equal(z.grad[4 * rank:4 * rank + 4], torch.full((4, 2), float(rank)))
    # last-dim scatter/gather are inverses
    full = torch.arange(4.0 * n).view(1, 4 * n)
    assert torch.equal(M.gather_from_tensor_model_parallel_region(
        M.scatter_to_tensor_model_parallel_region(full, g), g), full)
    # The byte counter, checked from first principles and against the bytes this process really
    # writes to its sockets (Linux /proc/self/io "wchar"), for n = 4 ranks and a 65536-element
    # fp32 array, S = 262144 bytes. Ring all-reduce: a reduce-scatter phase of 3 steps and an
    # all-gather phase of 3 steps, each step sending one S/4 = 65536-byte chunk: 6 x 65536 =
    # 393216 bytes. All-gather of a 262144-byte shard from each rank: 3 steps of 262144 bytes =
    # 786432. (Gloo's reduce-scatter is an all-reduce internally, so only these two are measured.)
    assert n == 4
    for kind, call, expect in (
            ("all_reduce", lambda: C.all_reduce(torch.ones(65536), group=g), 393216),
            ("all_gather", lambda: C.all_gather_into_tensor(torch.empty(4 * 65536),
                                                            torch.ones(65536), group=g), 786432)):
        dist.barrier(group=g)
        C.reset_bytes_sent()
        before = _socket_bytes_written()
        call()
        written = _socket_bytes_written() - before
        assert C.bytes_sent() == {kind: expect}, C.bytes_sent()
        assert expect <= written <= 1.02 * expect, (kind, written, expect)  # + message headers
    return True


def _socket_bytes_written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def test_conjugate_pairs_forward_and_backward():
    assert all(run_distributed(_mappings_worker, 4))


def test_gpt_model_runs_without_torch_distributed():
    from megalite.config import ModelConfig
    from megalite.models import GPTModel

    assert not dist.is_initialized()
    model = GPTModel(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                                 seq_length=8, vocab_size=50, hidden_dropout=0.1,
                                 attention_dropout=0.1))  # the library's dropout of then
    logits = model(torch.randint(0, 50, (3, 8)))
    assert logits.shape == (3, 8, 50)
