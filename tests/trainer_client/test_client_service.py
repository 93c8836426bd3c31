"""The client against a real planner server: service plans equal in-process plans, fallback plans
are identical, rejected requests are not retried, and a step planned ahead finds its plan ready."""

from __future__ import annotations

import logging

import pytest

from batch_planner.distributions import sample_lengths
from batch_planner.planner import plan_batch
from tests.support.megatron_builds import best_local_scheduler
from trainer_client import BatchPlannerClient, PlannerClientConfig
from trainer_client.service.plan_source import FALLBACK, SERVICE
from trainer_client.service.rpc_client import PlanRejectedError
from tests.support.reliability_support import wait_until
from tests.support.launch import free_port

LENGTHS = sample_lengths("long_tail_16k", 64, seed=3)


def client_for(endpoint: str, **overrides) -> BatchPlannerClient:
    values = dict(planner_endpoint=endpoint, tls=False, max_seqlen_per_dp_cp_rank=8192, job="test")
    values.update(overrides)
    values.setdefault("scheduler", best_local_scheduler())  # fallback plans with this process's build
    return BatchPlannerClient(PlannerClientConfig(**values), dp_cp_size=8, rank=0)


def metric(client: BatchPlannerClient, name: str, **labels) -> float:
    return client.metrics.registry.get_sample_value(name, {"training_job": "test", **labels}) or 0.0


def test_service_plan_equals_the_in_process_plan_and_the_fallback_plan(planner, caplog):
    client = client_for(planner.address)
    try:
        service_plan = client.plan_step(0, LENGTHS)
        assert client.last_source == SERVICE
    finally:
        client.close()
    local_plan = plan_batch(client.request_for(LENGTHS))
    assert service_plan == local_plan  # same plan id, same micro-batches and CP groups

    down = client_for(f"127.0.0.1:{free_port()}", fallback_cooldown_seconds=0.0)
    caplog.set_level(logging.WARNING, logger="trainer_client")
    try:
        plans = [down.plan_step(step, LENGTHS) for step in range(3)]
    finally:
        down.close()
    assert down.last_source == FALLBACK
    assert {p.plan_id for p in plans} == {service_plan.plan_id} and plans[0] == service_plan
    assert metric(down, "batch_planner_client_fallbacks_total", reason="unavailable") == 3
    assert metric(down, "batch_planner_client_plans_total", source="fallback") == 3
    outage_logs = [r for r in caplog.records if "planning in-process until it answers again" in r.getMessage()]
    assert len(outage_logs) == 1  # once per outage, not once per step


def test_invalid_argument_is_raised_not_retried_and_not_planned_in_process(planner):
    client = client_for(planner.address, max_attempts=4)
    try:
        # A length of 0 breaks a rule the client shares with the server: refused before any RPC.
        with pytest.raises(PlanRejectedError, match=r"INVALID_ARGUMENT.*sequence_lengths: sample 1 has length 0"):
            client.plan_step(0, [1000, 0, 2000])
        assert metric(client, "batch_planner_client_rpc_latency_seconds_count") == 0
        # Longer than this server's --max-sequence-length: only the server knows its limit.
        with pytest.raises(PlanRejectedError, match=r"INVALID_ARGUMENT.*sequence_lengths"):
            client.plan_step(0, [1000, 10_000_000, 2000])
    finally:
        client.close()
    assert metric(client, "batch_planner_client_rpc_latency_seconds_count") == 1  # one attempt
    assert metric(client, "batch_planner_client_plans_total", source="fallback") == 0


def test_a_step_planned_one_step_ahead_finds_its_plan_ready_and_makes_no_rpc(planner):
    # A request big enough that planning takes visible time: 1,024 samples on 64 ranks. How much
    # wait this hides is a speed, measured in bench/ (plan-ahead wait); here the events are checked.
    lengths = [sample_lengths("long_tail_16k", 1024, seed=step) for step in range(4)]
    client = BatchPlannerClient(
        PlannerClientConfig(planner_endpoint=planner.address, tls=False, max_seqlen_per_dp_cp_rank=16384,
                            deadline_seconds=30.0, job="test", scheduler=best_local_scheduler()),
        dp_cp_size=64, rank=0,
    )
    rpcs_during_plan_step = []
    try:
        for step in range(4):
            rpcs_before = metric(client, "batch_planner_client_rpc_latency_seconds_count")
            plan = client.plan_step(step, lengths[step])
            rpcs_during_plan_step.append(metric(client, "batch_planner_client_rpc_latency_seconds_count") - rpcs_before)
            assert client.last_source == SERVICE
            assert sorted(i for mb in plan.micro_batches for g in mb.cp_groups for i in g.sample_ids) == list(range(1024))
            if step + 1 < 4:
                client.prefetch(step + 1, lengths[step + 1])
                # The "training step": it lasts until the next step's plan has come back from the
                # service and been read (decoded, checked, its groups built: the client then counts
                # it in plans_total), as a step longer than planning does.
                wait_until(lambda read=step + 2: metric(client, "batch_planner_client_plans_total", source=SERVICE) >= read,
                           60, f"step {step + 1}'s plan")
    finally:
        client.close()
    # Only the first step, which nothing planned ahead, asked the service itself and waited for it.
    assert rpcs_during_plan_step == [1, 0, 0, 0]
    assert metric(client, "batch_planner_client_rpc_latency_seconds_count") == 4
    assert metric(client, "batch_planner_client_late_plans_total") == 1
    assert metric(client, "batch_planner_client_plan_lead_seconds_count") == 4
    assert metric(client, "batch_planner_client_plan_wait_seconds_count") == 4
