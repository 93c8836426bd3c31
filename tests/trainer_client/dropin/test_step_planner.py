"""The seam's `StepPlanner` (trainer_client/dropin/step_planner.py) where its ranks must agree: on 2
real gloo ranks as one TP `Agreement`, a read that fails on one rank, or a data iterator that ends
on one rank or on both, ends the step the same way on both (the guards hold without `assert`, so
under `python -O` too). Reading is stood in for (`StepPlannerWithStandInReading`, named as such):
its `_next_read` raises what the case says; the agreement itself is the real one. And a step
without a batch is refused by name before the planner is asked."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

WORLD = 2


def _planner(read_outcome, group):
    from trainer_client.dropin import Agreement, StepPlanner

    class StepPlannerWithStandInReading(StepPlanner):
        """The real StepPlanner, whose read of a step is stood in for (and whose plan is a stub)."""

        def _next_read(self):
            if isinstance(read_outcome, BaseException):
                raise read_outcome
            return types.SimpleNamespace(step=0)

        def _plan_and_route(self, current):
            return types.SimpleNamespace(step=0, sample_id_groups=[[[0]]])

    return StepPlannerWithStandInReading(read_local=None, groups=None, client=None, agreements=(Agreement(group, "TP rank"),))


CASES = {
    # case: what each rank's read does (None: reads the step)
    "one_read_fails": [None, OSError("the data loader worker died")],
    "one_ends": [StopIteration(), None],
    "both_end": [StopIteration(), StopIteration()],
    "both_read": [None, None],
}


def _rank(rank: int, store_path: str, out: str) -> None:
    init_gloo(rank, WORLD, store_path)
    outcomes = {}
    for case, reads in CASES.items():
        try:
            planned = _planner(reads[rank], dist.group.WORLD).next_step()
            outcomes[case] = f"planned step {planned.step}"
        except StopIteration:
            outcomes[case] = "StopIteration"
        except Exception as error:  # noqa: BLE001 - the test records what each rank raised
            outcomes[case] = f"{type(error).__name__}: {error}"
    write_rank_result(out, rank, outcomes)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict[str, str]]:
    tmp_path = tmp_path_factory.mktemp("ranks")
    run_ranks(_rank, (str(tmp_path / "store"), str(tmp_path)), WORLD, 120)
    return read_rank_results(tmp_path, WORLD)


def test_a_read_that_fails_on_one_rank_fails_both(outcomes):
    assert [o["one_read_fails"] for o in outcomes] == [
        "OSError: TP rank 1 could not read this step: the data loader worker died", "OSError: the data loader worker died",
    ]


def test_data_that_ends_on_one_rank_alone_is_refused_on_both(outcomes):
    want = "PlanMismatchError: TP rank 0 could not read this step (its data ended, the others read on); no TP rank plans it"
    assert [o["one_ends"] for o in outcomes] == [want, want]


def test_data_that_ends_on_both_ends_the_loop_on_both(outcomes):
    assert [o["both_end"] for o in outcomes] == ["StopIteration", "StopIteration"]


def test_a_step_both_read_is_planned_on_both(outcomes):
    assert [o["both_read"] for o in outcomes] == ["planned step 0", "planned step 0"]


@pytest.mark.parametrize("read, words", [
    ({"error": "step 3: DPxCP rank 1 (DP rank 0): the local batch is empty"}, "error 'step 3: DPxCP rank 1"),
    ({"exhausted": True}, "end of the data True"),
])
def test_a_step_without_a_batch_is_refused_before_the_planner_is_asked(read, words):
    from trainer_client.dropin import StepPlanner
    from trainer_client.dropin.step_input import ReadStep
    from trainer_client.errors import UsageError

    planner = StepPlanner(read_local=None, groups=None, client=None)  # no client: asking one would fail otherwise
    with pytest.raises(UsageError, match=r"^step 3 has no batch to plan") as caught:
        planner._plan_and_route(ReadStep(3, **read))
    assert words in str(caught.value) and isinstance(caught.value, RuntimeError)
