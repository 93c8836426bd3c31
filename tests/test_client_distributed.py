"""Four real processes, gloo, Megatron-Core's own parallel_state (hybrid CP) and a real planner:
the plan is asked once and broadcast, every rank applies it with Megatron-Core's CP groups, the
union of real tokens is the batch, CP members agree, and outputs come back in sample order."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.megatron_init import cpu_init_unsupported_reason, initialize_dpxcp_groups

WORLD = 4
# With 4 ranks of 1,024 tokens: 3,000 needs CP4, 1,500-1,800 CP2, the rest CP1.
LENGTHS = (3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1)


def _batch():
    from tensordict import TensorDict

    return TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(
                [i * 100_000 + torch.arange(n) for i, n in enumerate(LENGTHS)], layout=torch.jagged
            ),
        },
        batch_size=[len(LENGTHS)],
    )


def _run_rank(rank: int, store_path: str, endpoint: str, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state

    from trainer_client import BatchPlannerClient, PlannerClientConfig
    from trainer_client.broadcast import PlanMismatchError
    from trainer_client.outputs import OutputRestoreError

    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    initialize_dpxcp_groups(context_parallel_size=2)
    cp_sizes_seen: set[int] = set()
    try:
        for step, (layout, tp, who_asks) in enumerate(
            [("zigzag", 1, "leader"), ("contiguous", 1, "all_ranks"), ("zigzag", 2, "leader"), ("contiguous", 2, "leader")]
        ):
            config = PlannerClientConfig(
                planner_endpoint=endpoint, tls=False, max_seqlen_per_dp_cp_rank=1024, cp_layout=layout,
                tensor_parallel_size=tp, who_asks=who_asks, context_parallel_size=2,
            )
            client = BatchPlannerClient(config)  # DPxCP group and CP groups from parallel_state
            assert client.dp_cp_size == WORLD and client.rank == rank
            plan = client.plan_step(step, LENGTHS)
            # Only the asking rank(s) called the service.
            asked = client.metrics.registry.get_sample_value(
                "batch_planner_client_plans_total", {"training_job": "unnamed", "source": "service"}
            ) or 0
            assert asked == (1 if (who_asks == "all_ranks" or rank == 0) else 0)
            units = client.micro_batches(plan, _batch())
            held: list[tuple[int, int]] = []
            outputs = {}
            for mb in units:
                size = mb.local_cp_size
                cp_sizes_seen.add(size)
                if size == 1:
                    assert mb.cp_group is None and mb.packed_seq_params.cp_group is None
                else:
                    # The very group Megatron-Core's parallel_state built for this size.
                    assert mb.cp_group is parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)
                    assert dist.get_process_group_ranks(mb.cp_group) == list(mb.cp_group_ranks)
                    assert mb.packed_seq_params.cp_group is mb.cp_group and mb.packed_seq_params.local_cp_size == size
                    # Members agree on group, size, leader and sample (and the collective does not hang).
                    mine = torch.tensor([size, mb.cp_group_ranks[0], mb.micro_batch_index, mb.sample_ids[0]])
                    theirs = [torch.zeros_like(mine) for _ in range(size)]
                    dist.all_gather(theirs, mine, group=mb.cp_group)
                    assert all(torch.equal(t, mine) for t in theirs), (theirs, mine)
                    assert mb.is_cp_leader == (dist.get_rank(mb.cp_group) == 0)
                ids = mb.input_ids[mb.padding_mask]
                held += list(zip((ids // 100_000).tolist(), (ids % 100_000).tolist()))
                assert mb.local_tokens % tp == 0 and mb.real_local_tokens == len(ids)
                if mb.is_cp_leader:
                    outputs[mb.sample_ids[0]] = torch.full((2, 3), float(mb.sample_ids[0]))
            everyone: list = [None] * WORLD
            dist.all_gather_object(everyone, held)
            union = sorted(t for part in everyone for t in part)
            assert union == [(i, p) for i, n in enumerate(LENGTHS) for p in range(n)], "tokens lost or duplicated"
            restored = client.restore_outputs(plan, outputs)
            assert [int(o[0, 0]) for o in restored] == list(range(len(LENGTHS)))
            if step == 0:
                # A rank that drops a sample's output: every rank raises, naming it.
                dropped = {k: v for k, v in outputs.items() if k != 0}
                with pytest.raises(OutputRestoreError, match=r"missing sample ids \[0\]"):
                    client.restore_outputs(plan, dropped)
            client.close()
        # One rank holds another batch (the plan was prefetched for rank 0's): every rank refuses.
        config = PlannerClientConfig(planner_endpoint=endpoint, tls=False, max_seqlen_per_dp_cp_rank=1024, context_parallel_size=2)
        client = BatchPlannerClient(config)
        lengths = LENGTHS if rank != 3 else (*LENGTHS[:-1], 2)
        client.prefetch(99, lengths)
        with pytest.raises(PlanMismatchError, match="ranks of the DPxCP group hold different batches"):
            client.plan_step(99, lengths)
        client.close()
        if rank == 0:
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump({"cp_sizes": sorted(cp_sizes_seen)}, f)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_four_gloo_ranks_apply_a_broadcast_plan_with_megatron_cp_groups(planner, tmp_path):
    if reason := cpu_init_unsupported_reason():
        pytest.skip(reason)
    mp.spawn(_run_rank, args=(str(tmp_path / "store"), planner.address, str(tmp_path)), nprocs=WORLD, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert {1, 2, 4} <= set(result["cp_sizes"])
