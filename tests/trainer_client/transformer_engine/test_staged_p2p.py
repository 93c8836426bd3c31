"""The stand-in for NCCL's point-to-point (tests/trainer_client/transformer_engine/staged_p2p.py) on two real gloo
ranks, on any machine: it stages CPU tensors too when asked, so its staging path runs here.

- a batch that lists the send first on both peers, as Megatron-Core's batched pipeline exchange
  does, with messages larger than a socket's buffer: it completes (no send waits on a receive that
  cannot start), and each rank receives the other's values, dtype and shape;
- lone sends and receives in rank-parity order, as Transformer Engine's ring issues them;
- a receive buffer that is a leaf requiring grad (Megatron-Core's pipeline allocates those);
- a receive into a buffer of the wrong size fails loudly (gloo aborts the rank), never truncated;
- Megatron-Core's DDP coalescing manager runs each all-reduce on its own inside, and is restored after."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

WORLD = 2
BIG = 4 * 2**20  # elements: 8 MiB of bf16, past any socket buffer


def _rank(rank: int, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from tests.trainer_client.transformer_engine.staged_p2p import CpuStagedPointToPointStandIn

    init_gloo(rank, WORLD, os.path.join(out_dir, "store"))
    peer = 1 - rank
    record: dict = {}
    try:
        with CpuStagedPointToPointStandIn(stage_cpu_tensors=True):
            mine = torch.full((BIG,), float(rank + 1), dtype=torch.bfloat16)
            theirs = torch.empty(BIG, dtype=torch.bfloat16)
            ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]  # send first, on both
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            record["batch"] = [float(theirs[0]), float(theirs[-1]), str(theirs.dtype)]
            grid = torch.arange(6.0).reshape(2, 3) + 10 * rank
            leaf = torch.zeros(2, 3, requires_grad=True)
            if rank % 2 == 0:
                dist.isend(grid, peer).wait()
                dist.irecv(leaf, peer).wait()
            else:
                dist.irecv(leaf, peer).wait()
                dist.isend(grid, peer).wait()
            record["lone"] = leaf.detach().tolist()
            from megatron.core.distributed import param_and_grad_buffer

            summed = torch.ones(3) * (rank + 1)
            with param_and_grad_buffer._coalescing_manager(None, async_ops=False) as handle:
                dist.all_reduce(summed)
            handle.wait()
            record["coalesced"] = summed.tolist()
        from megatron.core.distributed import param_and_grad_buffer

        record["restored"] = param_and_grad_buffer._coalescing_manager is torch.distributed._coalescing_manager
    finally:
        write_rank_result(out_dir, rank, record)
        dist.destroy_process_group()


def test_staged_point_to_point_moves_what_nccl_would(tmp_path):
    run_ranks(_rank, (str(tmp_path),), WORLD, deadline_seconds=120)
    records = read_rank_results(tmp_path, WORLD)
    for rank, record in enumerate(records):
        peer = 1 - rank
        assert record["batch"] == [float(peer + 1), float(peer + 1), "torch.bfloat16"], record
        assert record["lone"] == (torch.arange(6.0).reshape(2, 3) + 10 * peer).tolist(), record
        assert record["coalesced"] == [3.0, 3.0, 3.0] and record["restored"], record


def _wrong_size_rank(rank: int, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    from tests.trainer_client.transformer_engine.staged_p2p import CpuStagedPointToPointStandIn

    init_gloo(rank, WORLD, os.path.join(out_dir, "store"))
    # gloo aborts this process on purpose: its message and Python's fault report would read as a
    # crash in the test log, so this rank reports neither.
    import faulthandler

    faulthandler.disable()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    with CpuStagedPointToPointStandIn(stage_cpu_tensors=True):
        sent, short = torch.ones(1024), torch.empty(512)
        dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, 1 - rank), dist.P2POp(dist.irecv, short, 1 - rank)])


def test_a_receive_of_the_wrong_size_fails_the_ranks(tmp_path):
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        run_ranks(_wrong_size_rank, (str(tmp_path),), WORLD, deadline_seconds=120)
