"""Run a function on N CPU processes joined by a real gloo process group.

Every multi-process test goes through :func:`run_distributed`: it starts the workers (separate
processes, one thread each), gives them a free TCP port, sets torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) so code under test initialises exactly as
under torchrun, and returns each rank's return value (or raises with the failing rank's traceback).
A worker that hangs is killed after ``timeout`` seconds, so a deadlock fails the test, never CI.

On a machine without CUDA the workers are forked from a server process that imported torch and
megalite once (multiprocessing's "forkserver") rather than spawned as fresh interpreters that each
import them again: those imports cost seconds of CPU per worker, and the suite starts about a
hundred workers on two cores. The server only imports; every worker is a fork of that same
untouched state and takes the caller's environment, working directory and ``sys.path`` as they are
at the call, as a spawned worker would.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the server the workers are forked from (what nearly every worker needs anyway:
# torch.optim imports torch._dynamo on first use; pretrain.main's tokenizers are transformers')
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megalite.parallel_state",
            "megalite.training", "transformers"]


def worker_context():
    """The multiprocessing context workers are started with (forkserver on CPU, else spawn)."""
    import torch

    # A server whose imports had touched CUDA would fork workers that cannot initialise it, and
    # workers use CUDA where it is present: there, and on Windows, they are spawned afresh.
    if torch.cuda.is_available() or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(call, caller, rank, world_size, port, result_queue):
    env, cwd, path = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    })
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        fn, args, kwargs = pickle.loads(call)  # after sys.path: fn's module may be anywhere on it
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        result_queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including assertion errors, to the parent
        result_queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megalite.parallel_state import set_parallel_state, ParallelState

            set_parallel_state(ParallelState())
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout: float = 300,
                    **kwargs) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes."""
    ctx = worker_context()
    result_queue = ctx.Queue()
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    call = pickle.dumps((fn, args, kwargs))
    caller = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [ctx.Process(target=_worker, args=(call, caller, r, world_size, port, result_queue),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.time() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.time()
            if remaining <= 0:
                raise TimeoutError(f"distributed test timed out after {timeout}s; "
                                   f"finished ranks: {sorted(results)}")
            try:
                rank, ok, payload = result_queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not errors:
                    raise RuntimeError(f"ranks {dead} died without reporting (exit codes "
                                       f"{[procs[i].exitcode for i in dead]})")
                if errors:  # one rank failed: the others may wait forever on a collective
                    break
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        first = min(errors)
        raise AssertionError(f"rank {first} failed:\n{errors[first]}")
    return [results[r] for r in range(world_size)]
