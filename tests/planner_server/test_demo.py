"""`planner-demo`'s rendering of a plan: every refused auto candidate's reason is printed whole."""

from __future__ import annotations

from batch_planner.planner import plan_batch
from batch_planner.request import SchedulerKind
from planner_server.demo import render_plan
from tests.support.megatron_builds import require_scheduler
from tests.batch_planner.test_auto import auto_request


def test_a_refused_candidate_is_printed_with_its_whole_reason():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    request = auto_request(samples=96, dp=12, cp=2)  # 24 ranks: hybrid CP refuses the layout
    plan = plan_batch(request)
    shown = render_plan(plan, request)
    refused = [c for c in plan.candidates if c.not_planned_reason]
    assert refused
    for candidate in refused:
        assert f"({candidate.not_planned_reason})" in shown, candidate.name
