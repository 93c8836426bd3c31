"""Every "fail together" call site, on 4 real gloo ranks, with one rank failing: every rank raises an
error of the same class carrying the failed rank's message (trainer_client.plans.together), and none
waits for ever in a collective the failed rank never entered. A case that returns its error
instead of raising it (`share_over_tp`, which hands it on to its DPxCP group) is checked the same
way on what it returns; `agree_on_step`'s agreed error is what the step planner raises later."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

WORLD = 4
FAILING = 2  # the rank that fails in every case (rank 0 where only the asking rank can fail)
LENGTHS = (700, 300, 512, 90, 1024, 33)
DEADLINE_SECONDS = 180


class _ConstructorOfItsOwn(Exception):
    """An error whose constructor takes other arguments than its message (cannot be rebuilt from args)."""

    def __init__(self, code: int, detail: str):
        super().__init__(f"{detail} ({code})")


def _plan():
    from batch_planner.planner import plan_batch
    from batch_planner.request import PlanningOptions, PlanRequest, SchedulerKind

    options = PlanningOptions(max_seqlen_per_dp_cp_rank=1024, context_parallel_size=1, scheduler=SchedulerKind.HYBRID_CP)
    request = PlanRequest(LENGTHS, WORLD, options, "fail-together")
    return plan_batch(request), request


def _cases(rank: int):
    """(name, a call every rank makes, in which rank FAILING, or rank 0, fails)."""
    from trainer_client.service.broadcast import agree_on_plan, share_over_tp
    from trainer_client.service.config import WhoAsks
    from trainer_client.dropin import Agreement, LocalBatch, StepPlanner, agree_on_read, agree_on_step
    from trainer_client.errors import DropInInputError, PlannerUnavailableError, PlanRejectedError
    from trainer_client.plans.megatron import DataGroups
    from trainer_client.plans.outputs import restore_outputs
    from trainer_client.plans.together import fail_together
    from trainer_client.plans.token_outputs import restore_token_outputs

    world = dist.group.WORLD
    failing = rank == FAILING
    plan, request = _plan()

    def step_planner_over_tp():
        class StepPlannerWithStandInPlanning(StepPlanner):
            """The real StepPlanner, whose read and plan of a step are stood in for."""

            def _next_read(self):
                return types.SimpleNamespace(step=0)

            def _plan_and_route(self, current):
                if failing:
                    raise ValueError("this TP rank could not route the step")
                return types.SimpleNamespace(step=0, sample_id_groups=[[[0]]])

        return StepPlannerWithStandInPlanning(read_local=None, groups=None, client=None, agreements=(Agreement(world, "TP rank"),)).next_step()

    def agreed_step():
        groups = DataGroups(dp_cp=world, dp=world, tp=world, pp=None)
        local = LocalBatch.of([{"tokens": torch.arange(5)}])
        read = agree_on_step(0, None if failing else local, "sample 3 has no tokens" if failing else None, groups)
        if read.error:
            raise DropInInputError(read.error)  # as StepPlanner raises it when the step comes

    def shared_over_tp():
        own = PlanRejectedError("INVALID_ARGUMENT", "sequence_lengths: sample 0 is too long") if rank == 0 else None
        outcome, _, _ = share_over_tp(own, request, b"", None, world)
        if isinstance(outcome, BaseException):
            raise outcome

    return {
        "fail_together": lambda: fail_together(DropInInputError("bad batch") if failing else None, world, rank),
        "fail_together_unpicklable": lambda: fail_together(_ConstructorOfItsOwn(7, "odd") if failing else None, world, rank),
        "agree_on_plan_refused_batch": lambda: agree_on_plan(
            PlanRejectedError("INVALID_ARGUMENT", "sequence_lengths: sample 1 is a float") if failing else plan if rank == 0 else None,
            None if failing else request, world, WhoAsks.LEADER,
        ),
        "agree_on_plan_asking_rank_fails": lambda: agree_on_plan(
            PlannerUnavailableError("the service failed; fallback is off") if rank == 0 else None, request, world, WhoAsks.LEADER
        ),
        "agree_on_step": agreed_step,
        "agree_on_read": lambda: agree_on_read(DropInInputError("the data iterator raised KeyError") if failing else None, world),
        "step_planner_over_tp": step_planner_over_tp,
        "restore_outputs": lambda: restore_outputs([] if failing else {}, 0, world),
        "restore_token_outputs": lambda: restore_token_outputs("not pieces" if failing else [], [3], world),
        "share_over_tp": shared_over_tp,
    }


def _run_rank(rank: int, store_path: str, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    init_gloo(rank, WORLD, store_path)
    outcomes = {}
    try:
        for name, call in _cases(rank).items():
            try:
                call()
                outcomes[name] = ["returned", ""]
            except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
                outcomes[name] = [type(error).__name__, str(error)]
        write_rank_result(out_dir, rank, outcomes)
    finally:
        dist.destroy_process_group()


# What the failed rank's own error says, per case (every rank's error carries it).
MESSAGES = {
    "fail_together": ("DropInInputError", "bad batch"),
    "agree_on_plan_refused_batch": ("PlanRejectedError", "sequence_lengths: sample 1 is a float"),
    "agree_on_plan_asking_rank_fails": ("PlannerUnavailableError", "the service failed; fallback is off"),
    "agree_on_step": ("DropInInputError", "sample 3 has no tokens"),
    "agree_on_read": ("DropInInputError", "the data iterator raised KeyError"),
    "step_planner_over_tp": ("ValueError", "this TP rank could not route the step"),
    "restore_outputs": ("ArgumentTypeError", "local_outputs: got a list"),
    "restore_token_outputs": ("ArgumentTypeError", "pieces: got a str"),
    "share_over_tp": ("PlanRejectedError", "sequence_lengths: sample 0 is too long"),
}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_every_fail_together_call_site_raises_the_same_error_on_every_rank(tmp_path):
    run_ranks(_run_rank, (str(tmp_path / "store"), str(tmp_path)), WORLD, DEADLINE_SECONDS)
    reports = read_rank_results(tmp_path, WORLD)
    for case, (kind, message) in MESSAGES.items():
        outcomes = [r[case] for r in reports]
        assert all(o[0] == kind for o in outcomes), (case, outcomes)
        assert all(message in o[1] for o in outcomes), (case, outcomes)
    # Where the failed rank's message names it, every rank's does the same words.
    assert len({tuple(r["agree_on_step"]) for r in reports}) == 1, [r["agree_on_step"] for r in reports]
    assert len({tuple(r["restore_outputs"]) for r in reports}) == 1
    assert "rank 2 of the DPxCP group could not plan" in reports[0]["agree_on_plan_refused_batch"][1]
    # An error that cannot be rebuilt on another rank: its own on the failed rank, named elsewhere.
    unpicklable = [r["fail_together_unpicklable"] for r in reports]
    assert unpicklable[FAILING] == ["_ConstructorOfItsOwn", "odd (7)"], unpicklable
    assert all(o[0] == "RankFailedError" and "_ConstructorOfItsOwn: odd (7)" in o[1] for r, o in enumerate(unpicklable) if r != FAILING)
