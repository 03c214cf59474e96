"""Two nodes on one machine: two torchrun agents (c10d rendezvous, 2 processes each) train
TP2 x DP2 and PP2 x DP2 through pretrain.py to the same per-iteration losses and gradient norms as
one process, in fp32, for 10 Adam steps (docs/clusters.md; docs/design.md, contracts 4-5)."""

import os
import subprocess
import sys

import pytest

from dist_utils import free_port
from pretrain_utils import PRETRAIN, ROOT, STRICT, flags, read_metrics, run_main, train_losses

ITERS = 10


def run_two_nodes(argv, timeout=300):
    """Start the agents of node 0 and node 1 as a cluster's launcher would; both must exit 0."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id", "megalite-test",
         "--rdzv-endpoint", f"127.0.0.1:{port}", STRICT, PRETRAIN] + [str(a) for a in argv],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=timeout))
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    return outs


def _grad_norms(path):
    return {r["iteration"]: r["grad_norm"] for r in read_metrics(path)}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "m.jsonl"
    assert run_main(flags(train_iters=ITERS, metrics_file=path)) == 0
    return path


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]],
                         ids=["tp2xdp2", "pp2xdp2"])
def test_two_nodes_match_one_process(tmp_path, single, layout):
    metrics = tmp_path / "m.jsonl"
    out = run_two_nodes(flags(*layout, train_iters=ITERS, metrics_file=metrics))
    assert "world size 4" in out[0][0] + out[1][0]
    ref, got = train_losses(single), train_losses(metrics)
    assert sorted(got) == sorted(ref) == list(range(1, ITERS + 1))
    for it in ref:
        rel = abs(got[it] - ref[it]) / abs(ref[it])
        assert rel <= 1e-4, f"iteration {it}: {got[it]} vs one process {ref[it]} (rel {rel:.2e})"
    # the comparison is not trivial: the losses change from step to step
    assert len({round(v, 5) for v in ref.values()}) >= 8
    # the grad norm (clipping over the TP shards / the PP stages) agrees too
    gn_ref, gn_got = _grad_norms(single), _grad_norms(metrics)
    for it in ref:
        assert abs(gn_got[it] - gn_ref[it]) <= 1e-4 * gn_ref[it], (it, gn_got[it], gn_ref[it])
