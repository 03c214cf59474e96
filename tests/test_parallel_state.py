"""Process groups from torchrun's environment, and the conjugate collective pairs."""

import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megalite import collectives as C
from megalite.parallel_state import get_parallel_state, initialize_model_parallel
from megalite.tensor_parallel import mappings as M


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
                                 seq_length=8, vocab_size=50))
    logits = model(torch.randint(0, 50, (3, 8)))
    assert logits.shape == (3, 8, 50)
