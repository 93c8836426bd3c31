"""Replicas die, restart and roll while a real trainer steps, and the trainer does not notice.

Three real planners on 127.0.0.1-3, one port, behind one name that a loopback DNS of the test's own
answers as a headless Service does (reliability_support.LoopbackDns). A trainer of 4 gloo ranks
(Megatron-Core's parallel_state, CP 2 in a DPxCP group of 4) plans with plan-ahead depth 2 through
BatchPlannerClient at the client's default deadline, retry and hedge settings, and keeps stepping
while, in separate cases:

- one replica is SIGKILLed (its address stays in the name, as a node that vanished);
- one replica is SIGKILLed and started again on the same address (a container restart: the port
  opens once the workers are warm, so no call reaches it before: none is answered UNAVAILABLE);
- all three are rolled one at a time onto new addresses, as a Deployment with maxSurge 1 and
  maxUnavailable 0 does: the new pod ready, in the name, then the old one out and SIGTERMed;
- one replica's forkserver is killed under the trainer's load.

Every case: no fallback, no plan late for its step (the client's own late-plan counter and lead
histogram; step 0 is planned before the loop starts), every sample's every token trained once per
step, and every plan id equal to the in-process plan's for the same request. Every wait is on
something a process shows (the trainer's progress file, a server's metric or log, SERVING).
The trainer's figures per case go to the terminal (pytest -s) and docs/reliability.md: its
fallbacks, late plans, worst plan_step wait (the broadcast to the other ranks included), calls it
sent again (failovers), and the calls replicas answered UNAVAILABLE at once (from their logs).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from batch_planner.request import SchedulerKind
from tests.support.megatron_builds import require_scheduler
from tests.support.megatron_init import initialize_dpxcp_groups
from tests.support.launch import init_gloo, run_ranks
from tests.support.planner_process import PlannerProcess, start_planner
from tests.support.reliability_support import LoopbackDns, forkserver_pid, metric, wait_until
from tests.support.batches import token_batch

# The trainer must get every plan before its step (0.25 s apart) while replicas start (each start
# keeps a core busy for seconds): an assertion about time on the machine's cores, which beside
# ./dev test's other lane (two pytest runs on CI's two cores) it does not have. Run after the
# lanes, alone.
pytestmark = pytest.mark.alone

WORLD = 4
DEPTH = 2
STEP_SECONDS = 0.25  # each step's compute, a stand-in for the model's forward and backward
STEPS_BEFORE_FAULT = 4
STEPS_AFTER_RECOVERY = 6
WAIT_S = 240.0  # the longest any event below may take; never reached when the code is right
MAX_PER_RANK = 1024
# Planned on the workers (none inline), so that a lost forkserver or worker is on the plans' path.
FLAGS = ("--inline-max-samples", "0", "--drain-seconds", "10")
NAME = "planners.test"


def lengths_of(step: int) -> tuple[int, ...]:
    """A long-tail batch of 24 samples, different every step."""
    import random

    rng = random.Random(step)
    return tuple(min(4 * MAX_PER_RANK, int(rng.paretovariate(1.2) * 120)) for _ in range(24))


def _client_figures(registry) -> dict:
    """The trainer's own metrics, summed over labels, by sample name (and reason/scope)."""
    figures: dict = {}
    for family in registry.collect():
        for sample in family.samples:
            key = sample.name
            extra = sample.labels.get("reason") or sample.labels.get("scope") or sample.labels.get("source")
            if sample.name == "batch_planner_client_plan_lead_seconds_bucket":
                if sample.labels["le"] != "0.0":
                    continue
            elif extra:
                key = f"{key}{{{extra}}}"
            figures[key] = figures.get(key, 0.0) + sample.value
    return figures


def _train(rank: int, world: int, store_path: str, endpoint: str, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # forked: never enter the parent's OpenMP pool
    from megatron.core import parallel_state

    from batch_planner.planner import plan_batch
    from trainer_client import BatchPlannerClient, PlannerClientConfig

    init_gloo(rank, world, store_path)
    initialize_dpxcp_groups(context_parallel_size=2)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    out = Path(out_dir)
    config = PlannerClientConfig(
        planner_endpoint=endpoint, max_seqlen_per_dp_cp_rank=MAX_PER_RANK, context_parallel_size=2,
        scheduler=SchedulerKind.DYNAMIC_CP.value, plan_ahead_depth=DEPTH, job="rollout",
    )
    client = BatchPlannerClient(config)
    report: dict = {"steps": 0, "sources": [], "mismatched_plan_ids": [], "worst_wait_seconds": 0.0}
    try:
        for step in range(DEPTH):
            client.prefetch(step, lengths_of(step))
        if client.asks:  # step 0 planned before the loop: then no step of the loop is planned late
            client.ahead._pending[0].future.exception(timeout=WAIT_S)
        step = 0
        while True:
            lengths = lengths_of(step)
            started = time.perf_counter()
            plan = client.plan_step(step, lengths)
            report["worst_wait_seconds"] = max(report["worst_wait_seconds"], time.perf_counter() - started)
            for ahead in range(step + 1, step + 1 + DEPTH):
                client.prefetch(ahead, lengths_of(ahead))
            held = []
            for unit in client.micro_batches(plan, token_batch(lengths, traceable=True)):
                ids = unit.input_ids[unit.padding_mask]
                held += list(zip((ids // 100_000).tolist(), (ids % 100_000).tolist()))
            if client.asks:
                report["sources"].append(client.last_source)
                in_process = plan_batch(client.request_for(lengths, step))
                if in_process.plan_id != plan.plan_id:
                    report["mismatched_plan_ids"].append(step)
            time.sleep(STEP_SECONDS)
            stop = rank == 0 and (out / "stop").exists()
            everyone: list = [None] * world
            dist.all_gather_object(everyone, (held, stop), group=group)
            union = sorted(t for part, _ in everyone for t in part)
            assert union == [(i, p) for i, n in enumerate(lengths) for p in range(n)], f"step {step}: tokens lost or duplicated"
            step += 1
            report["steps"] = step
            if rank == 0:
                (out / "progress.tmp").write_text(str(step))
                os.replace(out / "progress.tmp", out / "progress")
            if any(s for _, s in everyone):
                break
        if rank == 0:
            report["metrics"] = _client_figures(client.metrics.registry)
            (out / "report.json").write_text(json.dumps(report))
    finally:
        client.close()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class Cluster:
    """Three replicas on one port behind `NAME`, by address."""

    def __init__(self):
        first = start_planner(*FLAGS, workers=1)
        self.port = first.port
        self.replicas: dict[str, PlannerProcess] = {"127.0.0.1": first}
        self.started: list[PlannerProcess] = [first]  # every replica ever, gone ones included
        with ThreadPoolExecutor(2) as pool:
            for host, server in zip(("127.0.0.2", "127.0.0.3"), pool.map(self.start, ("127.0.0.2", "127.0.0.3"))):
                self.replicas[host] = server
        self.dns = LoopbackDns(list(self.replicas))
        self.next_host = 4

    @property
    def endpoint(self) -> str:
        return f"dns://127.0.0.1:{self.dns.port}/{NAME}:{self.port}"

    def start(self, host: str) -> PlannerProcess:
        server = start_planner("--host", host, *FLAGS, workers=1, port=self.port)
        self.started.append(server)
        return server

    def sent_on(self) -> int:
        """Plan calls any replica answered UNAVAILABLE (its request log): warming up, draining, no worker."""
        return sum(line.count("status=UNAVAILABLE") for server in list(self.started) for line in list(server.log_lines))

    def heal(self) -> None:
        """Every replica in the name running (a case before may have killed one)."""
        for host, server in list(self.replicas.items()):
            if server.proc.poll() is not None:
                server.stop(signal.SIGKILL)
                self.replicas[host] = self.start(host)

    def close(self) -> None:
        self.dns.close()
        for server in self.replicas.values():
            server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    started = time.monotonic()
    replicas = Cluster()
    yield replicas
    replicas.close()
    print(f"\nreplica-fault cases: {time.monotonic() - started:.0f} s in all, three replicas started included")


class Trainer:
    """The 4 ranks, stepping in the background until `stop`."""

    def __init__(self, cluster: Cluster, tmp_path: Path):
        self.out = tmp_path
        self.errors: list[BaseException] = []
        args = (WORLD, str(tmp_path / "store"), cluster.endpoint, str(tmp_path))
        self.thread = threading.Thread(target=self._run, args=(args,), daemon=True)
        self.thread.start()

    def _run(self, args) -> None:
        try:
            run_ranks(_train, args, WORLD, WAIT_S * 3)
        except BaseException as exc:  # noqa: BLE001 - re-raised by `stop` in the test's thread
            self.errors.append(exc)

    def steps(self) -> int:
        try:
            return int((self.out / "progress").read_text())
        except (OSError, ValueError):
            return 0

    def step_past(self, steps: int, what: str) -> None:
        wait_until(lambda: self.errors or self.steps() >= steps, WAIT_S, what, poll=0.05)
        if self.errors:
            raise self.errors[0]

    def stop(self) -> dict:
        (self.out / "stop").touch()
        self.thread.join(WAIT_S)
        if self.errors:
            raise self.errors[0]
        assert not self.thread.is_alive(), "the trainer did not stop"
        return json.loads((self.out / "report.json").read_text())


def run_case(cluster: Cluster, tmp_path: Path, name: str, fault) -> dict:
    cluster.heal()
    sent_on = cluster.sent_on()
    trainer = Trainer(cluster, tmp_path)
    trainer.step_past(STEPS_BEFORE_FAULT, "the trainer stepping")
    fault(trainer)
    trainer.step_past(trainer.steps() + STEPS_AFTER_RECOVERY, "the trainer stepping on after the fault")
    report = trainer.stop()
    figures = report["metrics"]
    summary = {
        "case": name,
        "steps": report["steps"],
        "fallbacks": figures.get("batch_planner_client_plans_total{fallback}", 0.0),
        "late_plans": figures.get("batch_planner_client_late_plans_total", 0.0),
        "lead_0": figures.get("batch_planner_client_plan_lead_seconds_bucket", 0.0),
        "worst_wait_ms": round(report["worst_wait_seconds"] * 1000, 1),
        "answered_unavailable": cluster.sent_on() - sent_on,
        "failovers": {k.split("{")[1][:-1]: v for k, v in figures.items() if k.startswith("batch_planner_client_failovers_total{")},
        "service_failures": {k.split("{")[1][:-1]: v for k, v in figures.items() if k.startswith("batch_planner_client_service_failures_total{")},
    }
    print(f"\n{json.dumps(summary)}")
    assert summary["fallbacks"] == 0 and set(report["sources"]) == {"service"}, summary
    assert summary["late_plans"] == 0 and summary["lead_0"] == 0, summary
    assert report["mismatched_plan_ids"] == [], report["mismatched_plan_ids"]
    assert len(report["sources"]) == report["steps"]  # every step planned and trained, once
    return summary


def _served(server: PlannerProcess) -> float:
    return metric(server, "batch_planner_requests_total", code="OK")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_replica_restarted_in_place_is_not_noticed(cluster, tmp_path):
    def restart_in_place(trainer: Trainer) -> None:
        host = "127.0.0.2"
        cluster.replicas[host].stop(signal.SIGKILL)  # the container dies; the pod keeps its address
        restarted = cluster.replicas[host] = cluster.start(host)  # its port opens once it is warm
        wait_until(lambda: _served(restarted) > 0, WAIT_S, "the restarted replica planning the trainer's steps again")

    summary = run_case(cluster, tmp_path, "restart in place", restart_in_place)
    assert summary["answered_unavailable"] == 0, summary  # no call reached the replica while it warmed up


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_replica_whose_forkserver_is_killed_is_not_noticed(cluster, tmp_path):
    def kill_forkserver(trainer: Trainer) -> None:
        server = cluster.replicas["127.0.0.1"]
        os.kill(forkserver_pid(server.proc.pid), signal.SIGKILL)
        # Its worker sees the forkserver gone at its next plan and a new forkserver is started.
        wait_until(lambda: metric(server, "batch_planner_worker_restarts_total", reason="forkserver") >= 1, WAIT_S,
                   "a new forkserver started")
        served = _served(server)
        wait_until(lambda: _served(server) > served, WAIT_S, "the replica planning on after its new forkserver")

    run_case(cluster, tmp_path, "forkserver killed", kill_forkserver)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_rolling_update_onto_new_addresses_is_not_noticed(cluster, tmp_path):
    def roll(trainer: Trainer) -> None:
        for old_host in list(cluster.replicas):
            new_host = f"127.0.0.{cluster.next_host}"
            cluster.next_host += 1
            new = cluster.start(new_host)  # maxSurge 1: the new pod first, ready
            cluster.replicas[new_host] = new
            cluster.dns.addresses = [h for h in cluster.replicas if h != old_host]  # ready pods only
            old = cluster.replicas.pop(old_host)
            assert old.stop(signal.SIGTERM, timeout=WAIT_S) == 0, old.log  # then the old one drains
            served = _served(new)
            wait_until(lambda new=new, served=served: _served(new) > served, WAIT_S, f"the trainer's plans reaching {new_host}")

    run_case(cluster, tmp_path, "rolling update", roll)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_sigkilled_replica_is_not_noticed(cluster, tmp_path):
    def kill(trainer: Trainer) -> None:
        host = list(cluster.replicas)[-1]
        cluster.replicas[host].stop(signal.SIGKILL)  # its address stays in the name
        trainer.step_past(trainer.steps() + STEPS_AFTER_RECOVERY, "the trainer stepping on two replicas")

    run_case(cluster, tmp_path, "SIGKILL", kill)
