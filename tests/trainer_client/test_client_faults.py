"""Fault tests against a real planner process of our own: too-large request (RESOURCE_EXHAUSTED),
planner frozen past the deadline (SIGSTOP), planner killed mid-run, planner restarted on the same
port. The loop keeps stepping, every step's samples come back exactly once, the fallback metric
counts each outage, and the client returns to the service."""

from __future__ import annotations

import signal
import time

from batch_planner.distributions import sample_lengths
from tests.support.planner_process import start_planner
from tests.support.reliability_support import wait_until
from tests.support.megatron_builds import best_local_scheduler
from trainer_client import BatchPlannerClient, PlannerClientConfig
from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.batch import unbind_batch
from trainer_client.plans.outputs import order_outputs
from trainer_client.service.plan_source import FALLBACK, SERVICE

RANKS = 4
COOLDOWN = 0.3
SERVER_FLAGS = ("--max-receive-message-bytes", "2048")


def fallbacks(client: BatchPlannerClient, reason: str) -> float:
    return client.metrics.registry.get_sample_value(
        "batch_planner_client_fallbacks_total", {"training_job": "faults", "reason": reason}
    ) or 0.0


def run_step(client: BatchPlannerClient, step: int) -> str:
    """One training step: plan (the next one ahead), apply on every rank, restore outputs."""
    import torch
    from tensordict import TensorDict

    lengths = sample_lengths("long_tail_16k", 32, seed=step)
    plan = client.plan_step(step, lengths)
    client.prefetch(step + 1, sample_lengths("long_tail_16k", 32, seed=step + 1))
    batch = unbind_batch(TensorDict(
        {"input_ids": torch.nested.nested_tensor([torch.zeros(n, dtype=torch.long) for n in lengths], layout=torch.jagged)},
        batch_size=[len(lengths)],
    ))
    outputs = [
        (sample_id, sample_id, rank)
        for rank in range(RANKS)
        for mb in micro_batches_for_rank(plan, batch, rank)
        if mb.is_cp_leader
        for sample_id in mb.sample_ids
    ]
    assert order_outputs(outputs, len(lengths)) == list(range(len(lengths)))  # none lost or duplicated
    return client.last_source


def steps_until(client: BatchPlannerClient, first_step: int, source: str, limit_s: float) -> int:
    """Keeps training until a step's plan came from `source`; returns the next step number."""
    step, deadline = first_step, time.monotonic() + limit_s
    while run_step(client, step) != source:
        assert time.monotonic() < deadline, f"no plan from the {source} within {limit_s} s"
        step += 1
        if source == SERVICE:  # the next step asks the service only once the fallback cooldown is over
            wait_until(lambda: service_asked_again(client), limit_s, "the fallback cooldown to end")
    return step + 1


def service_asked_again(client: BatchPlannerClient) -> bool:
    """Whether the client's next plan asks the service (it plans in-process during the cooldown)."""
    source = client.source
    return source._outage_reason is None or time.monotonic() >= source._retry_service_at


def test_training_survives_a_slow_a_dead_and_a_restarted_planner():
    server = start_planner(*SERVER_FLAGS, workers=1)
    config = PlannerClientConfig(
        planner_endpoint=server.address, tls=False, max_seqlen_per_dp_cp_rank=8192, job="faults",
        scheduler=best_local_scheduler(),  # in-process fallback plans with this process's build
        # 5 s: the deadline covers the client's two calls (the failover to the next replica) and
        # gRPC's attempts of each, also on a loaded machine; the frozen planner still outlasts it.
        deadline_seconds=5.0, max_attempts=2, initial_backoff_seconds=0.05,
        fallback_cooldown_seconds=COOLDOWN, max_reconnect_backoff_seconds=0.5,
    )
    client = BatchPlannerClient(config, dp_cp_size=RANKS, rank=0)
    try:
        step = steps_until(client, 0, SERVICE, limit_s=30)

        # A request over the server's message limit: RESOURCE_EXHAUSTED, retried, then planned
        # in-process within the attempts' time.
        started = time.monotonic()
        big = client.plan_step(1000, sample_lengths("long_tail_16k", 1500, seed=1))
        assert client.last_source == FALLBACK and sum(len(g.sample_ids) for mb in big.micro_batches for g in mb.cp_groups) == 1500
        assert fallbacks(client, "resource_exhausted") == 1
        assert time.monotonic() - started < config.max_attempts * config.deadline_seconds + 10

        # Frozen planner: accepts connections, never answers -> deadline, fallback, then back.
        server.proc.send_signal(signal.SIGSTOP)
        try:
            # The next step asks the frozen service, not the circuit the oversized request opened.
            wait_until(lambda: service_asked_again(client), 30, "the fallback cooldown to end")
            step = steps_until(client, step, FALLBACK, limit_s=30)
            for _ in range(2):  # the loop keeps stepping during the outage
                run_step(client, step)
                step += 1
            assert fallbacks(client, "deadline_exceeded") >= 1
        finally:
            server.proc.send_signal(signal.SIGCONT)
        step = steps_until(client, step, SERVICE, limit_s=30)

        # Planner killed mid-run: UNAVAILABLE, fallback, the loop keeps stepping.
        port = server.port
        server.stop(signal.SIGKILL)
        wait_until(lambda: service_asked_again(client), 30, "the fallback cooldown to end")
        step = steps_until(client, step, FALLBACK, limit_s=30)
        run_step(client, step)
        step += 1
        assert fallbacks(client, "unavailable") >= 1

        # Planner restarted on the same address: the client returns to it.
        server = start_planner(*SERVER_FLAGS, workers=1, port=port)
        steps_until(client, step, SERVICE, limit_s=60)
        assert client.metrics.registry.get_sample_value(
            "batch_planner_client_plans_total", {"training_job": "faults", "source": "fallback"}
        ) >= 4
    finally:
        client.close()
        server.stop(signal.SIGKILL)
