"""The ranks' agreement digest covers every planning option (the same canonical form as the plan
id): two real gloo ranks whose requests differ only in micro_batch_group_size refuse to agree. And
a failure of the asking rank that is not a planning error (here a bug in its in-process planning)
is raised on both ranks, naming it, rather than on the asking rank while the other waits."""

from __future__ import annotations


import pytest
import torch.distributed as dist

from batch_planner.identity import canonical_request
from batch_planner.planner import plan_batch
from batch_planner.request import PaddingRule, PlanningOptions, PlanRequest, SchedulerKind
from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result
from trainer_client.service.broadcast import canonical_digest

LENGTHS = (4096, 2048, 1024, 512, 512, 256, 128, 64)


def _request(group_size: int | None) -> PlanRequest:
    return PlanRequest.of(LENGTHS, 2, 1, 4096, scheduler=SchedulerKind.STATIC_PACKING, micro_batch_group_size=group_size)


def test_the_digest_covers_every_option_of_the_canonical_request():
    base = _request(None)
    assert set(canonical_request(base)) == {"lengths", "dp", *PlanningOptions.names()}
    verl = base.replace(padding=PaddingRule.VERL, min_local_rows=8)
    assert canonical_digest(base) == canonical_digest(_request(None))
    assert canonical_digest(base) != canonical_digest(_request(2))
    assert canonical_digest(base) != canonical_digest(base.replace(max_seqs_per_micro_batch=3))
    assert canonical_digest(base) != canonical_digest(verl) != canonical_digest(verl.replace(min_local_rows=16))


def _on_two_ranks(tmp_path, outcome_of) -> list[str]:
    """What `outcome_of(rank)` (a module-level function) says on each of two real gloo ranks."""
    run_ranks(_rank_main, (str(tmp_path / "store"), str(tmp_path), outcome_of), 2, 120)
    return read_rank_results(tmp_path, 2)


def _rank_main(rank: int, store_path: str, out_dir: str, outcome_of) -> None:
    init_gloo(rank, 2, store_path)
    try:
        outcome = outcome_of(rank)
        write_rank_result(out_dir, rank, outcome)
    finally:
        dist.destroy_process_group()


def _agreement_of_different_batches(rank: int) -> str:
    from trainer_client.service.broadcast import PlanMismatchError, agree_on_plan
    from trainer_client.service.config import WhoAsks

    request = _request(None if rank == 0 else 2)  # the only difference between the ranks
    # The asking rank's plan (any plan: the digest of each rank's own request is what differs).
    own = plan_batch(PlanRequest.of(LENGTHS, 2, 1, 4096)) if rank == 0 else None
    try:
        agree_on_plan(own, request, None, WhoAsks.LEADER)
        return "agreed"
    except PlanMismatchError as error:
        return str(error)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_two_ranks_differing_only_in_micro_batch_group_size_refuse_to_agree(tmp_path):
    for rank, outcome in enumerate(_on_two_ranks(tmp_path, _agreement_of_different_batches)):
        assert "hold different batches" in outcome, (rank, outcome)


def _plan_step_whose_leader_fails(rank: int) -> str:
    import trainer_client.service.plan_source as plan_source
    from trainer_client import BatchPlannerClient, PlannerClientConfig
    from trainer_client.service.plan_source import PlannerUnavailableError

    def broken_plan_batch(request, **_):
        raise RuntimeError("a bug in the fallback")

    plan_source.plan_batch = broken_plan_batch  # no endpoint: the asking rank plans in-process
    client = BatchPlannerClient(PlannerClientConfig(max_seqlen_per_dp_cp_rank=4096, job="agreement"), dist.group.WORLD)
    try:
        client.plan_step(0, LENGTHS)
        return "planned"
    except PlannerUnavailableError as error:
        return str(error)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_failure_of_the_asking_rank_that_is_not_a_planning_error_is_raised_on_every_rank(tmp_path):
    for rank, outcome in enumerate(_on_two_ranks(tmp_path, _plan_step_whose_leader_fails)):
        assert "could not plan this step: RuntimeError: a bug in the fallback" in outcome, (rank, outcome)
