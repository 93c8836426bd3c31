"""Two trainer clients in one process, one with `scheduler_implementation: upstream` and one with
`exact`, each plan with their own setting: no client's constructor changes what another plans
with. Which code ran is observed by counting calls of the exact path's entry point (a spy that
calls the real function); the two plans are the same, byte for byte, as the differential corpus
says they must be."""

from __future__ import annotations

from unittest import mock

import pytest

from batch_planner.convert import plan_to_proto
from batch_planner.exact import dynamic_cp, hybrid_cp
from batch_planner.exact.verified import SchedulerImplementation, exact_path_status
from batch_planner.request import SchedulerKind
from batch_planner.schedulers import discover_schedulers
from trainer_client import BatchPlannerClient, PlannerClientConfig

LENGTHS = (3000, 1200, 800, 640, 333, 100, 64, 17, 2048, 950)
ENTRY = {SchedulerKind.DYNAMIC_CP: dynamic_cp, SchedulerKind.HYBRID_CP: hybrid_cp}


@pytest.mark.parametrize("scheduler", [SchedulerKind.DYNAMIC_CP, SchedulerKind.HYBRID_CP])
def test_two_clients_each_plan_with_their_own_implementation(scheduler):
    if not discover_schedulers()[scheduler].available:
        pytest.skip(f"{scheduler.value}: {discover_schedulers()[scheduler].reason}")
    if not exact_path_status(scheduler, SchedulerImplementation.EXACT).active:
        pytest.skip(f"{scheduler.value}: {exact_path_status(scheduler, SchedulerImplementation.EXACT).reason}")

    def client(implementation: str) -> BatchPlannerClient:
        config = PlannerClientConfig(
            max_seqlen_per_dp_cp_rank=1024, context_parallel_size=2, scheduler=scheduler.value,
            scheduler_implementation=implementation, job=f"implementations-{implementation}",
        )
        return BatchPlannerClient(config, dp_cp_size=8, rank=0)

    exact, upstream = client("exact"), client("upstream")  # the upstream client made last
    module = ENTRY[scheduler]
    with mock.patch.object(module, "get_groups_and_subsamples", wraps=module.get_groups_and_subsamples) as spy:
        exact_plan = exact.plan_step(0, LENGTHS)
        after_exact = spy.call_count
        upstream_plan = upstream.plan_step(0, LENGTHS)
        after_upstream = spy.call_count
        exact.plan_step(1, LENGTHS[1:])
        after_exact_again = spy.call_count
    assert (after_exact, after_upstream, after_exact_again) == (1, 1, 2)
    assert plan_to_proto(exact_plan).SerializeToString() == plan_to_proto(upstream_plan).SerializeToString()
    exact.close()
    upstream.close()
