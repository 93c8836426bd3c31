"""The ranks' agreement digest covers every planning option (the same canonical form as the plan
id): two real gloo ranks whose requests differ only in micro_batch_group_size refuse to agree. And
a failure of the asking rank that is not a planning error (here a bug in its in-process planning)
is raised on both ranks, naming it, rather than on the asking rank while the other waits."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from batch_planner.identity import canonical_request
from batch_planner.planner import plan_batch
from batch_planner.request import PlanningOptions, PlanRequest, SchedulerKind
from tests.megatron_init import FORK_OR_SPAWN, run_ranks
from trainer_client.broadcast import canonical_digest

LENGTHS = (4096, 2048, 1024, 512, 512, 256, 128, 64)


def _request(group_size: int | None) -> PlanRequest:
    return PlanRequest.of(LENGTHS, 2, 1, 4096, scheduler=SchedulerKind.STATIC_PACKING, micro_batch_group_size=group_size)


def test_the_digest_covers_every_option_of_the_canonical_request():
    base = _request(None)
    assert set(canonical_request(base)) == {"lengths", "dp", *PlanningOptions.names()}
    assert canonical_digest(base) == canonical_digest(_request(None))
    assert canonical_digest(base) != canonical_digest(_request(2))
    assert canonical_digest(base) != canonical_digest(base.replace(max_seqs_per_micro_batch=3))


def _run_rank(rank: int, store_path: str, out_dir: str) -> None:
    from trainer_client.broadcast import PlanMismatchError, agree_on_plan
    from trainer_client.config import WhoAsks

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        request = _request(None if rank == 0 else 2)  # the only difference between the ranks
        # The asking rank's plan (any plan: the digest of each rank's own request is what differs).
        own = plan_batch(PlanRequest.of(LENGTHS, 2, 1, 4096)) if rank == 0 else None
        try:
            agree_on_plan(own, request, None, WhoAsks.LEADER)
            outcome = "agreed"
        except PlanMismatchError as error:
            outcome = str(error)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(outcome, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_two_ranks_differing_only_in_micro_batch_group_size_refuse_to_agree(tmp_path):
    mp.start_processes(_run_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True, start_method=FORK_OR_SPAWN)
    for rank in range(2):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "hold different batches" in outcome, (rank, outcome)


def _run_rank_whose_leader_fails(rank: int, store_path: str, out_dir: str) -> None:
    import trainer_client.plan_source as plan_source
    from trainer_client import BatchPlannerClient, PlannerClientConfig
    from trainer_client.plan_source import PlannerUnavailableError

    def broken_plan_batch(request):
        raise RuntimeError("a bug in the fallback")

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        plan_source.plan_batch = broken_plan_batch  # no endpoint: the asking rank plans in-process
        client = BatchPlannerClient(PlannerClientConfig(max_seqlen_per_dp_cp_rank=4096, job="agreement"), dist.group.WORLD)
        try:
            client.plan_step(0, LENGTHS)
            outcome = "planned"
        except PlannerUnavailableError as error:
            outcome = str(error)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(outcome, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_failure_of_the_asking_rank_that_is_not_a_planning_error_is_raised_on_every_rank(tmp_path):
    run_ranks(_run_rank_whose_leader_fails, (str(tmp_path / "store"), str(tmp_path)), 2, 120)
    for rank in range(2):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "could not plan this step: RuntimeError: a bug in the fallback" in outcome, (rank, outcome)
