"""Expert dispatch over the EP group (megalite/moe/alltoall.py, docs/moe.md "Token dispatch"):
real gloo ranks, random uneven per-expert counts with zeros, under strict mode's emulated GPU."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

from megalite import collectives as C
from megalite.moe.alltoall import combine, dispatch

H, E_LOCAL = 3, 2


def _world_counts(world, num_experts, seed):
    """Every rank's tokens per global expert [world, E], with zeros: whole rows of the first
    rank's, one rank sending nothing at all in a world of 4, random ones elsewhere."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (world, num_experts), generator=g)
    counts[torch.rand(world, num_experts, generator=g) < 0.25] = 0
    counts[0, :E_LOCAL] = 0
    if world == 4:
        counts[3] = 0
    return counts


def _tokens(src, counts_row):
    """Rank src's tokens sorted by expert; each row names (src, expert, index) so a receiver can
    tell exactly which token it got."""
    rows = [torch.tensor([float(src), float(e), float(i)])
            for e, n in enumerate(counts_row.tolist()) for i in range(n)]
    return torch.stack(rows) if rows else torch.zeros(0, H)


def _exchange(rank, world, ep, seed):
    import strict_collectives as S
    from host_reads import HostReads

    S.enable()
    dev = C.configure(torch.device("cpu"))  # the emulated GPU: host tensors are caught
    groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    group = groups[rank // ep]
    me, first = rank % ep, rank - rank % ep
    num_experts = ep * E_LOCAL
    counts_all = _world_counts(world, num_experts, seed)[first:first + ep]  # this EP group's
    mine = slice(me * E_LOCAL, (me + 1) * E_LOCAL)

    x = _tokens(me, counts_all[me]).to(dev).requires_grad_()
    tpe = counts_all[me].to(dev)
    C.reset_bytes_sent()
    with HostReads() as reads:
        grouped, counts, handle = dispatch(x, tpe, group, E_LOCAL)
        out = combine(grouped, handle)
    host_reads = sum(reads.per_iteration[-1].values())
    fwd = C.bytes_sent()

    # what this rank must receive: local expert by local expert, source ranks in order
    sent = [_tokens(s, counts_all[s]) for s in range(ep)]
    want = torch.cat([t[t[:, 1] == e] for e in range(mine.start, mine.stop) for t in sent])
    assert torch.equal(counts.cpu(), counts_all[:, mine].sum(0)), (counts, counts_all)
    assert torch.equal(grouped.detach().cpu(), want)
    assert torch.equal(out.detach().cpu(), x.detach().cpu())  # identity experts: the identity

    sent_rows = counts_all[me].sum().item() - counts_all[me, mine].sum().item()
    recv_rows = counts_all[:, mine].sum().item() - counts_all[me, mine].sum().item()
    row = H * x.element_size()
    assert fwd == {"moe_counts": (ep - 1) * E_LOCAL * tpe.element_size(),
                   "moe_dispatch": sent_rows * row, "moe_combine": recv_rows * row}, fwd

    C.reset_bytes_sent()
    out.sum().backward()
    assert torch.equal(x.grad.cpu(), torch.ones(x.shape))
    # backward: the combine's gradient takes the dispatch's way, and the reverse
    assert C.bytes_sent() == {"moe_combine": sent_rows * row, "moe_dispatch": recv_rows * row}

    # a per-expert scaling 'expert' (1 + its global index), weighted upstream gradients
    x.grad = None
    grouped, counts, handle = dispatch(x, tpe, group, E_LOCAL)
    scale = torch.arange(1.0, E_LOCAL + 1, device=dev) + mine.start
    rows_scale = scale.repeat_interleave(counts, output_size=grouped.shape[0])
    out = combine(grouped * rows_scale[:, None], handle)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + me)).to(dev)
    (out * w).sum().backward()
    expert = x.detach()[:, 1].cpu()
    assert torch.allclose(out.detach().cpu(), x.detach().cpu() * (1 + expert)[:, None])
    assert torch.equal(x.grad.cpu(), w.cpu() * (1 + expert)[:, None])

    try:  # a host tensor on the device path of the new collective
        C.all_to_all_single(torch.zeros(ep), torch.zeros(ep), None, None, group, "bad_a2a")
    except S.CollectiveDeviceError as e:
        bad = str(e)
    else:
        bad = None
    return host_reads, bad


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_dispatch_combine_over_ep(world, ep):
    for host_reads, bad in run_distributed(_exchange, world, ep, 17 + world + ep, timeout=180):
        assert host_reads == 1  # the split sizes, once per dispatch
        assert bad is not None and "bad_a2a on the device path" in bad


def test_ep1_is_a_no_op_without_traffic():
    counts = torch.tensor([2, 0, 3])
    x = _tokens(0, counts).requires_grad_()
    C.reset_bytes_sent()
    grouped, got, handle = dispatch(x, counts, None, 3)
    assert grouped is x and torch.equal(got, counts)
    assert combine(grouped, handle) is grouped
    out = torch.empty(5, H)
    C.all_to_all_single(out, x.detach(), [5], [5], None, "a2a")
    assert torch.equal(out, x.detach()) and C.bytes_sent() == {}


def test_expert_count_mismatch_is_one_line():
    with pytest.raises(ValueError, match=r"^--num-experts: 4 experts cannot be 3 per rank"):
        dispatch(torch.zeros(0, H), torch.zeros(4, dtype=torch.long), None, 3)


def _exchange_with_etp(rank, world, seed):
    """EP 2 x ETP 2 on 4 ranks (ETP fastest): every rank of an ETP pair gets both ranks' rows for
    its experts, in the same order; identity 'slices' come back summed, once per ETP rank."""
    import strict_collectives as S
    from host_reads import HostReads

    S.enable()
    dev = C.configure(torch.device("cpu"))
    etp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    etp_group, ep_group = etp_groups[rank // 2], ep_groups[rank % 2]
    ep_rank, etp_rank = rank // 2, rank % 2
    counts_all = _world_counts(world, 2 * E_LOCAL, seed)  # rank r's tokens per global expert
    x = _tokens(rank, counts_all[rank]).to(dev).requires_grad_()
    C.reset_bytes_sent()
    with HostReads() as reads:
        grouped, counts, handle = dispatch(x, counts_all[rank].to(dev), ep_group, E_LOCAL,
                                           etp_group)
        out = combine(grouped, handle)
    mine = slice(ep_rank * E_LOCAL, (ep_rank + 1) * E_LOCAL)
    # the ETP pair's rows for these experts: EP sources of ETP rank 0, then those of ETP rank 1
    sources = [[0, 2], [1, 3]]
    want = torch.cat([t[t[:, 1] == e] for e in range(mine.start, mine.stop)
                      for s in sources for t in [_tokens(r, counts_all[r]) for r in s]])
    assert torch.equal(grouped.detach().cpu(), want)
    assert torch.equal(counts.cpu(), counts_all[:, mine].sum(0))
    assert torch.equal(out.detach().cpu(), 2 * x.detach().cpu())  # both slices' identity
    sent = C.bytes_sent()
    out.sum().backward()
    assert torch.equal(x.grad.cpu(), torch.full(x.shape, 2.0))
    ep_rows = counts_all[[0, 2] if etp_rank == 0 else [1, 3]][:, mine].sum().item()
    return sum(reads.per_iteration[-1].values()), sent["moe_etp_gather"], ep_rows * H * 4


def test_dispatch_combine_over_ep_and_etp():
    for host_reads, gathered, ep_rows_bytes in run_distributed(_exchange_with_etp, 4, 5,
                                                               timeout=180):
        assert host_reads == 1  # the EP and ETP split sizes in one read
        assert gathered == ep_rows_bytes  # each rank sends what it received to its ETP peer
