"""How tests start processes: the one rank launcher (`run_ranks`), the one gloo start-up of a rank
(`init_gloo`), and a free loopback port (`free_port`) for a server or tool a test starts."""

from __future__ import annotations

import socket
import time


def fork_or_spawn() -> str:
    """How multi-rank tests start their ranks. Forked on CPU: the ranks inherit the imported
    Megatron-Core (concurrent imports take minutes on a small machine). Spawned where CUDA is: a
    forked child cannot use CUDA once the parent has touched it, and the dev build's group creation
    calls torch.cuda.current_device() in every rank. (torch is imported here, not with this module:
    the deployment tests take free_port from it without torch.)"""
    import torch

    return "spawn" if torch.cuda.is_available() else "fork"


def run_ranks(fn, args: tuple, nprocs: int, deadline_seconds: float, *, start_method: str | None = None,
              on_event: tuple | None = None) -> None:
    """Runs `fn(rank, *args)` in `nprocs` processes (`start_method`, fork_or_spawn() unless given) and
    waits for all of them; a rank that raises or dies fails the test with its traceback or exit
    code; fails the test, killing the ranks, if they have not finished within `deadline_seconds`
    (a stuck collective must not hang the suite). `on_event=(event, action)`: once the ranks set
    `event` (a multiprocessing Event of that start method), `action()` runs here, once, while they
    go on (a test that stops its planner mid-run)."""
    import pytest
    import torch.multiprocessing as mp

    # Imported here so that forked ranks inherit them instead of importing them again; the compiled
    # exact path's kernels too (numba and the kernels: a few seconds of CPU in every rank whose
    # trainer client starts its in-process fallback, otherwise).
    from megatron.core import parallel_state  # noqa: F401
    import trainer_client  # noqa: F401
    from batch_planner.exact.prepare import prepare

    prepare(always=True)

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=start_method or fork_or_spawn())
    deadline = time.monotonic() + deadline_seconds
    while not context.join(timeout=1):
        if on_event is not None and on_event[0].is_set():
            action, on_event = on_event[1], None
            action()
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {nprocs} ranks did not finish within {deadline_seconds} s")


def init_gloo(rank: int, world: int, store_path: str) -> None:
    """Joins this rank to the `world` ranks' gloo process group, met through a FileStore at
    `store_path` (one per run: a test's tmp_path)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick; the caller binds it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_rank_result(out_dir, rank: int, record) -> None:
    """A rank's result, as JSON, where read_rank_results finds it (`out_dir`: the test's tmp_path)."""
    import json
    import os

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)


def read_rank_results(out_dir, world: int) -> list:
    """Every rank's write_rank_result, in rank order."""
    import json
    from pathlib import Path

    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
