"""Run a function on N CPU processes joined by a real gloo process group.

Every multi-process test goes through :func:`run_distributed`: it spawns the workers (fresh
interpreters, one thread each), gives them a free TCP port, sets torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) so code under test initialises exactly as
under torchrun, and returns each rank's return value (or raises with the failing rank's traceback).
A worker that hangs is killed after ``timeout`` seconds, so a deadlock fails the test, never CI.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, result_queue, args, kwargs):
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    })
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
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
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, result_queue, args, kwargs),
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
