"""How the attention model's multi-rank tests run: `run_attention_ranks(body, world, tmp_path)`
runs `body(rank)` on `world` gloo ranks (tests/support/launch.py's run_ranks: forked on CPU, with a
deadline) and returns each rank's record (the dict `body` returned, or {"raised": ...}) in rank
order. `body` initialises parallel_state as its test needs; it is destroyed afterwards.

On the CPU (the default) `body` runs inside `CudaDeviceRequestsOnCpu`, with tests/support/megatron_init.py's
CPU stand-ins for CUDA calls. With `on_gpu=True` (tests/trainer_client/transformer_engine) every rank runs on the
one GPU (spawned), inside the stand-in for NCCL's point-to-point
(tests/trainer_client/transformer_engine/staged_p2p.py), since gloo moves no CUDA tensor point to point."""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

DEADLINE_SECONDS = 240


def require_dynamic_build() -> None:
    """Skips the test, saying why, on a Megatron-Core build without dynamic CP: the reference runs
    at CP1 on the dev build's size-1 group, and the layouts need cp_partition_mode."""
    import pytest

    from tests.support.megatron_init import is_dynamic_build

    if not is_dynamic_build():
        pytest.skip("needs the Megatron-LM dev build's dynamic-CP groups (size 1 for the reference) and cp_partition_mode")


def run_attention_ranks(body: Callable[[int], dict], world: int, tmp_path, deadline_seconds: float = DEADLINE_SECONDS,
                        on_gpu: bool = False) -> list[dict]:
    run_ranks(_rank, (body, str(tmp_path), world, on_gpu), world, deadline_seconds)
    return read_rank_results(tmp_path, world)


def _rank(rank: int, body: Callable[[int], dict], out_dir: str, world: int, on_gpu: bool = False) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # forked: never enter the parent's OpenMP pool
    from megatron.core import parallel_state

    if on_gpu:
        from tests.trainer_client.transformer_engine.staged_p2p import CpuStagedPointToPointStandIn

        torch.cuda.set_device(0)
        context = CpuStagedPointToPointStandIn()
    else:
        from tests.support.cuda_requests_on_cpu import CudaDeviceRequestsOnCpu
        from tests.support.megatron_init import _stand_in_for_cuda_calls_on_cpu

        _stand_in_for_cuda_calls_on_cpu()
        context = CudaDeviceRequestsOnCpu()
    init_gloo(rank, world, os.path.join(out_dir, "store"))
    record: dict = {}
    try:
        with context:
            record = body(rank)
    except Exception as error:  # the test reports it with the rank; the rank still fails
        record = {"raised": f"{type(error).__name__}: {error}"}
        raise
    finally:
        write_rank_result(out_dir, rank, record)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
