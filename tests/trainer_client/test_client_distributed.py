"""Real gloo processes (4 and 8, TP 1 and 2) with Megatron-Core's own parallel_state and a real
planner: hybrid-CP and dynamic-CP plans are asked once and broadcast, every rank applies them with
the process group parallel_state built for each CP size (CP1 included on the dev build), every rank
gets exactly its samples, CP members agree on group, size and leader, the union of real tokens is
the batch for zigzag and contiguous, and outputs come back in sample order."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from batch_planner.request import SchedulerKind
from tests.support.megatron_builds import require_scheduler
from tests.support.megatron_init import initialize_dpxcp_groups, parallel_state_cp_group
from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result
from tests.support.batches import token_batch

MAX_PER_RANK = 1024
JOIN_DEADLINE_SECONDS = 240
# Each plan's deadline: every plan must come from the service (the test checks last_source), and on a
# busy machine the client's default of 2 s ran out (the plan then falls back in process).
PLAN_DEADLINE_SECONDS = 30.0
# Per DPxCP size: samples that need every CP size up to the whole group at 1,024 tokens per rank.
LENGTHS = {
    4: (3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1),
    8: (7000, 3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1, 2047, 1025, 5, 640, 4000),
}


def _steps(schedulers: list[str]):
    for scheduler in schedulers:
        for layout, who_asks in (("zigzag", "leader"), ("contiguous", "all_ranks")):
            yield scheduler, layout, who_asks


def _check_unit(mb, size: int, parallel_state_group) -> None:
    # The very group Megatron-Core's parallel_state built for this size (None for CP1 on 0.19).
    assert mb.cp_group is parallel_state_group, (size, mb.cp_group, parallel_state_group)
    assert mb.packed_seq_params.cp_group is mb.cp_group and mb.packed_seq_params.local_cp_size == size
    if mb.cp_group is None:
        assert size == 1 and mb.is_cp_leader
        return
    assert dist.get_process_group_ranks(mb.cp_group) == [_global_rank(r) for r in mb.cp_group_ranks]
    # Members agree on size, leader, micro-batch and samples (and the collective does not hang).
    mine = torch.tensor([size, mb.cp_group_ranks[0], mb.micro_batch_index, len(mb.sample_ids), *mb.sample_ids[:1]])
    theirs = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(theirs, mine, group=mb.cp_group)
    assert all(torch.equal(t, mine) for t in theirs), (theirs, mine)
    assert mb.is_cp_leader == (dist.get_rank(mb.cp_group) == 0)


_DP_CP_RANKS: list[int] = []


def _global_rank(dp_cp_rank: int) -> int:
    return _DP_CP_RANKS[dp_cp_rank]


def _run_rank(rank: int, world: int, tp: int, store_path: str, endpoint: str, out_dir: str, schedulers: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # forked: never enter the parent's OpenMP pool
    from megatron.core import parallel_state

    from trainer_client import BatchPlannerClient, PlannerClientConfig
    from trainer_client.service.broadcast import PlanMismatchError
    from trainer_client.plans.outputs import OutputRestoreError

    init_gloo(rank, world, store_path)
    initialize_dpxcp_groups(context_parallel_size=2, tensor_model_parallel_size=tp)
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    _DP_CP_RANKS[:] = dist.get_process_group_ranks(dp_cp)
    dp_cp_size = len(_DP_CP_RANKS)
    lengths = LENGTHS[dp_cp_size]
    report: dict = {"cp_sizes": [], "steps": 0}
    try:
        for step, (scheduler, layout, who_asks) in enumerate(_steps(schedulers)):
            config = PlannerClientConfig(
                planner_endpoint=endpoint, tls=False, max_seqlen_per_dp_cp_rank=MAX_PER_RANK, cp_layout=layout,
                tensor_parallel_size=tp, who_asks=who_asks, context_parallel_size=2, scheduler=scheduler,
                deadline_seconds=PLAN_DEADLINE_SECONDS,
            )
            client = BatchPlannerClient(config)  # DPxCP group and CP groups from parallel_state
            assert client.dp_cp_size == dp_cp_size
            me = client.rank
            plan = client.plan_step(step, lengths)
            assert plan.scheduler.value == scheduler and client.last_source in (None, "service")
            units = client.micro_batches(plan, token_batch(lengths, traceable=True))
            # Exactly this rank's samples, in plan order.
            expected = [i for mb in plan.micro_batches for i in mb.group_of_rank(me).sample_ids]
            assert [i for mb in units for i in mb.sample_ids] == expected
            held: list[tuple[int, int]] = []
            outputs = {}
            for mb in units:
                size = mb.local_cp_size
                report["cp_sizes"].append(size)
                _check_unit(mb, size, parallel_state_cp_group(size))
                ids = mb.input_ids[mb.padding_mask]
                held += list(zip((ids // 100_000).tolist(), (ids % 100_000).tolist()))
                assert mb.local_tokens % tp == 0 and mb.real_local_tokens == len(ids)
                if mb.is_cp_leader:
                    outputs.update({i: torch.full((2, 3), float(i)) for i in mb.sample_ids})
            if tp > 1:  # TP peers of a DPxCP rank get the same shards
                tp_group = parallel_state.get_tensor_model_parallel_group()
                mine = [sorted(held)]
                peers: list = [None] * tp
                dist.all_gather_object(peers, mine[0], group=tp_group)
                assert all(p == mine[0] for p in peers)
            everyone: list = [None] * dp_cp_size
            dist.all_gather_object(everyone, held, group=dp_cp)
            union = sorted(t for part in everyone for t in part)
            assert union == [(i, p) for i, n in enumerate(lengths) for p in range(n)], "tokens lost or duplicated"
            restored = client.restore_outputs(plan, outputs)
            assert [int(o[0, 0]) for o in restored] == list(range(len(lengths)))
            if step == 0:
                # A rank that drops a sample's output: every rank raises, naming it.
                dropped = {k: v for k, v in outputs.items() if k != 0}
                with pytest.raises(OutputRestoreError, match=r"missing sample ids \[0\]"):
                    client.restore_outputs(plan, dropped)
                # An output that cannot be pickled (a lambda on each rank that leads a sample):
                # every rank raises, naming it, rather than one rank raising while the rest wait.
                unpicklable = {k: (lambda: None) if k == min(outputs, default=None) else v for k, v in outputs.items()}
                with pytest.raises(TypeError, match=r"the output of sample \d+, a function, cannot be pickled .* \(on rank \d+"):
                    client.restore_outputs(plan, unpicklable)
                # An output that cannot be copied to the CPU (a meta tensor): the same, on every rank.
                uncopyable = {k: torch.empty(2, device="meta") if k == min(outputs, default=None) else v for k, v in outputs.items()}
                with pytest.raises(RuntimeError, match=r"could not be read or copied to the CPU .* \(on rank \d+"):
                    client.restore_outputs(plan, uncopyable)
            client.close()
            report["steps"] += 1
        # One rank holds another batch (the plan was prefetched for rank 0's): every rank refuses.
        config = PlannerClientConfig(
            planner_endpoint=endpoint, tls=False, max_seqlen_per_dp_cp_rank=MAX_PER_RANK, context_parallel_size=2,
            scheduler=schedulers[0],
        )
        client = BatchPlannerClient(config)
        mine = lengths if client.rank != dp_cp_size - 1 else (*lengths[:-1], 2)
        client.prefetch(99, mine)
        with pytest.raises(PlanMismatchError, match="ranks of the DPxCP group hold different batches"):
            client.plan_step(99, mine)
        client.close()
        write_rank_result(out_dir, rank, report)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _spawn(world: int, tp: int, tmp_path, endpoint: str, schedulers: list[str]) -> list[dict]:
    run_ranks(_run_rank, (world, tp, str(tmp_path / "store"), endpoint, str(tmp_path), schedulers), world, JOIN_DEADLINE_SECONDS)
    return read_rank_results(tmp_path, world)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("world,tp", [(4, 1), (8, 1), (8, 2)])
def test_gloo_ranks_apply_broadcast_plans_with_megatron_cp_groups(planner, tmp_path, world, tp):
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    reports = _spawn(world, tp, tmp_path, planner.address, [SchedulerKind.HYBRID_CP.value, SchedulerKind.DYNAMIC_CP.value])
    assert all(r["steps"] == 4 for r in reports)
    dp_cp = world // tp
    seen = {c for r in reports for c in r["cp_sizes"]}
    assert {1, 2, dp_cp} <= seen, seen  # CP1, a partial group and the whole DPxCP group all ran


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_hybrid_cp_plans_on_any_build(planner, tmp_path):
    """The release leg's check: 0.19's hybrid groups run hybrid-CP plans (dynamic CP needs the dev build)."""
    reports = _spawn(4, 1, tmp_path, planner.address, [SchedulerKind.HYBRID_CP.value])
    assert all(r["steps"] == 2 for r in reports)
    assert {1, 2, 4} <= {c for r in reports for c in r["cp_sizes"]}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_dynamic_cp_plans_from_a_dev_build_planner_run_on_release_hybrid_groups(tmp_path):
    """A planner pod on the dev build, trainers on the 0.19 release: packed dynamic-CP plans run on
    the release's hybrid groups. Only the release leg (./dev test-release) has the two builds."""
    from batch_planner.schedulers import discover_schedulers

    if discover_schedulers()[SchedulerKind.DYNAMIC_CP].available:
        pytest.skip("this process runs the dev build; the release leg (./dev test-release) runs this with 0.19.2")
    from tests.support.planner_process import start_planner

    server = start_planner(workers=1, without_release_overlay=True)
    try:
        reports = _spawn(4, 1, tmp_path, server.address, [SchedulerKind.DYNAMIC_CP.value])
    finally:
        server.stop()
    assert all(r["steps"] == 2 for r in reports)
    assert {1, 2, 4} <= {c for r in reports for c in r["cp_sizes"]}
