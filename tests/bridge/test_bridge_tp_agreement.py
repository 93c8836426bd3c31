"""The TP ranks of one step agree before any of them runs it (2 real gloo ranks as one TP group):
when one TP rank cannot plan the step, every TP rank raises; when they hold different plans, every
TP rank refuses. The planner of each rank is a stand-in (`StepPlannerStandIn`, named as such) that
returns a plan id or raises, so the test controls what each TP rank's own planning gave."""

from __future__ import annotations

import json
import types

import torch.distributed as dist

from tests.megatron_init import run_ranks

WORLD = 2


class StepPlannerStandIn:
    """Stands in for the read-ahead StepPlanner: its next step has a given plan id, or it raises."""

    def __init__(self, plan_id: str | None, error: Exception | None = None):
        self.plan_id, self.error = plan_id, error

    def next_step(self):
        if self.error is not None:
            raise self.error
        return types.SimpleNamespace(plan=types.SimpleNamespace(plan_id=self.plan_id))


def _rank(rank: int, store_path: str, out: str, case: str) -> None:
    from trainer_client.megatron import DataGroups
    from trainer_client.megatron_bridge.schedule import PlannedIterator

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    world = dist.group.WORLD
    planned = PlannedIterator.__new__(PlannedIterator)  # its planner is set below, not built
    planned.groups = DataGroups(dp_cp=world, dp=world, tp=world, pp=None)
    if case == "one_fails":
        planned.planner = StepPlannerStandIn("a", ValueError("no plan here") if rank == 1 else None)
    else:
        planned.planner = StepPlannerStandIn("a" if rank == 0 else "b")
    try:
        planned._agreed_over_tp()
        outcome = "ran"
    except Exception as error:  # noqa: BLE001 - the test records what each rank raised
        outcome = f"{type(error).__name__}: {error}"
    with open(f"{out}/rank{rank}.json", "w") as handle:
        json.dump(outcome, handle)


def _outcomes(tmp_path, case: str) -> list[str]:
    run_ranks(_rank, (str(tmp_path / "store"), str(tmp_path), case), WORLD, 120)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_one_tp_rank_that_cannot_plan_stops_every_tp_rank(tmp_path):
    ok, failed = _outcomes(tmp_path, "one_fails")
    assert failed == "ValueError: no plan here", failed
    assert ok.startswith("PlanMismatchError: TP rank 1 could not plan this step (ValueError: no plan here)"), ok


def test_tp_ranks_with_different_plans_all_refuse(tmp_path):
    outcomes = _outcomes(tmp_path, "differ")
    assert all(o.startswith("PlanMismatchError: the TP ranks hold different plans") for o in outcomes), outcomes
