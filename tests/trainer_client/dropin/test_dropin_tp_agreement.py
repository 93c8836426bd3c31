"""The TP ranks of one step agree before any of them runs it (2 real gloo ranks as one TP group,
the seam's StepPlanner with a TP `Agreement`, as the Bridge drop-in builds it): when one TP
rank cannot plan the step, every TP rank raises the same error; when they hold different plans,
every TP rank refuses. Reading and planning are stood in for (`StepPlannerWithStandInPlanning`,
named as such): its step has a given plan or raises, so the test controls what each TP rank's
own planning gave; the agreement itself is the real one."""

from __future__ import annotations

import types

import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

WORLD = 2


def _planner(plan_id: str | None, error: Exception | None, group):
    from trainer_client.dropin import Agreement, StepPlanner

    class StepPlannerWithStandInPlanning(StepPlanner):
        """The real StepPlanner, whose read and plan of a step are stood in for."""

        def _next_read(self):
            return types.SimpleNamespace(step=0)

        def _plan_and_route(self, current):
            if error is not None:
                raise error
            return types.SimpleNamespace(step=0, sample_id_groups=[[[ord(plan_id)]]])

    return StepPlannerWithStandInPlanning(read_local=None, groups=None, client=None, agreements=(Agreement(group, "TP rank"),))


def _rank(rank: int, store_path: str, out: str, case: str) -> None:
    init_gloo(rank, WORLD, store_path)
    world = dist.group.WORLD
    if case == "one_fails":
        planner = _planner("a", ValueError("no plan here") if rank == 1 else None, world)
    else:
        planner = _planner("a" if rank == 0 else "b", None, world)
    try:
        planner.next_step()
        outcome = "ran"
    except Exception as error:  # noqa: BLE001 - the test records what each rank raised
        outcome = f"{type(error).__name__}: {error}"
    write_rank_result(out, rank, outcome)
    dist.destroy_process_group()


def _outcomes(tmp_path, case: str) -> list[str]:
    run_ranks(_rank, (str(tmp_path / "store"), str(tmp_path), case), WORLD, 120)
    return read_rank_results(tmp_path, WORLD)


def test_one_tp_rank_that_cannot_plan_stops_every_tp_rank(tmp_path):
    ok, failed = _outcomes(tmp_path, "one_fails")
    assert failed == "ValueError: no plan here", failed
    assert ok == "ValueError: TP rank 1 could not plan this step: no plan here", ok


def test_tp_ranks_with_different_plans_all_refuse(tmp_path):
    outcomes = _outcomes(tmp_path, "differ")
    assert all(o.startswith("PlanMismatchError: the TP ranks hold different plans") for o in outcomes), outcomes
