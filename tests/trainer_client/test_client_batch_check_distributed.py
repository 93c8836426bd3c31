"""4 real gloo ranks with Megatron-Core's parallel_state and a real planner: a plan applied to a
batch it was not made for (the batch rotated by one sample, or the next step's batch, as a
plan-ahead slip would) is refused by micro_batches on every rank with the same error, before any
unit is built; the planned batch then applies. Lengths one rank alone gets wrong are refused on
every rank by plan_step (no rank waits in a collective the others left)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_init import initialize_dpxcp_groups
from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result
from tests.support.batches import token_batch

WORLD = 4
JOIN_DEADLINE_SECONDS = 240
STEP0 = (3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1)
STEP1 = (2000, 1024, 1800, 700, 60, 301, 900, 97, 1000, 64, 333, 9)


def _run_rank(rank: int, store_path: str, endpoint: str, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # forked: never enter the parent's OpenMP pool
    from megatron.core import parallel_state

    from trainer_client import BatchMismatchError, BatchPlannerClient, PlannerClientConfig
    from trainer_client.service.rpc_client import PlanRejectedError

    init_gloo(rank, WORLD, store_path)
    initialize_dpxcp_groups(context_parallel_size=2)
    report: dict = {}
    try:
        config = PlannerClientConfig(
            planner_endpoint=endpoint, tls=False, max_seqlen_per_dp_cp_rank=1024, context_parallel_size=2,
            scheduler="hybrid_cp",
        )
        client = BatchPlannerClient(config)  # DPxCP group and CP groups from parallel_state
        plan = client.plan_step(0, STEP0)
        client.prefetch(1, STEP1)  # the next step is planned ahead meanwhile
        for name, lengths in (("rotated", STEP0[1:] + STEP0[:1]), ("next_step", STEP1)):
            try:
                client.micro_batches(plan, token_batch(lengths))
                report[name] = "applied"
            except BatchMismatchError as error:
                report[name] = str(error)
        report["planned"] = len(client.micro_batches(plan, token_batch(STEP0)))
        report["source"] = client.last_source
        client.plan_step(1, STEP1)
        # One rank's lengths break the rule (floats): it raises, and so does every other rank.
        mine = STEP0 if rank != WORLD - 1 else [float(n) for n in STEP0]
        try:
            client.plan_step(2, mine)
            report["one_bad"] = "planned"
        except PlanRejectedError as error:
            report["one_bad"] = str(error)
        client.close()
        write_rank_result(out_dir, rank, report)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_batch_the_plan_was_not_made_for_is_refused_on_every_rank(planner, tmp_path):
    run_ranks(_run_rank, (str(tmp_path / "store"), planner.address, str(tmp_path)), WORLD, JOIN_DEADLINE_SECONDS)
    reports = read_rank_results(tmp_path, WORLD)
    errors = [(r["rotated"], r["next_step"]) for r in reports]
    assert all(e == errors[0] for e in errors), errors  # the same error on every rank
    report = reports[0]
    assert report["rotated"] == (
        "step 0: sample 0 of the batch has length 1500, the plan was made for length 3000: this is not the batch "
        "the plan was made for (another step's batch, or the samples in another order?); apply a plan to the "
        "batch it was made for"
    )
    assert report["next_step"].startswith("step 0: sample 0 of the batch has length 2000, the plan was made for length 3000")
    assert all(r["planned"] > 0 for r in reports)  # the planned batch applies on every rank
    assert report["source"] == "service"  # rank 0 asked the planner; the others received its plan
    for r in reports:  # refused where the bad lengths were, and on every other rank (none waits)
        assert "sequence_lengths: sample 0 has value 3000.0 (float)" in r["one_bad"], r["one_bad"]
    assert "rank 3 of the DPxCP group could not plan" in reports[0]["one_bad"]
