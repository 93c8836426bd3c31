"""Sharing the planner's answer over TP (BatchPlannerClient's tp_group), on 4 real gloo ranks as
Megatron-Core's parallel_state lays out TP2 x CP2 and a real planner: TP rank 0's DPxCP group asks
once per step for both TP ranks, every rank holds the same plan, a refusal and an unreachable
planner reach every rank, a TP rank whose batch differs from TP rank 0's refuses the plan made for
another batch on every rank of its DPxCP group, and a group that is not the TP group of the leading
ranks is refused on every rank. Before a step is planned the TP ranks agree that each read it
(`agree_on_read`, 2 gloo ranks): all plan it, or all raise."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_init import initialize_dpxcp_groups
from tests.support.launch import free_port, init_gloo, read_rank_results, run_ranks, write_rank_result
from tests.support.planner_process import PlannerProcess
from tests.support.reliability_support import sample_value
from tests.planner_server.test_planner_metrics import scrape

WORLD, TP, CP = 4, 2, 2
MAX_PER_RANK = 1024
STEPS = 3
# Hybrid CP (every build has it) on DPxCP 2: any sample up to 2 x 1,024 tokens fits.
LENGTHS = (1500, 700, 500, 301, 900, 97, 1000, 64, 333, 1)
TOO_LONG = (5000, *LENGTHS)  # more than DPxCP x max_seqlen_per_dp_cp_rank: the server refuses it
JOBS = {"leader": "tp-sharing-leader", "all_ranks": "tp-sharing-all-ranks", "refused": "tp-sharing-refused"}
JOIN_DEADLINE_SECONDS = 240


def _config(endpoint: str, job: str, who_asks: str = "leader", **overrides):
    from trainer_client import PlannerClientConfig

    return PlannerClientConfig(
        planner_endpoint=endpoint, tls=False, max_seqlen_per_dp_cp_rank=MAX_PER_RANK, context_parallel_size=CP,
        tensor_parallel_size=TP, scheduler="hybrid_cp", who_asks=who_asks, job=job, **overrides,
    )


def _outcome(client, step: int, lengths) -> str:
    """What plan_step gave this rank: the plan's id, or the error it raised."""
    try:
        return client.plan_step(step, lengths).plan_id
    except Exception as error:  # noqa: BLE001 - the test compares what each rank got
        return f"{type(error).__name__}: {error}"


def _steps(client) -> list[dict]:
    """STEPS steps planned one ahead, as a drop-in plans them: what each rank held."""
    held = []
    client.prefetch(0, LENGTHS[0:])
    for step in range(STEPS):
        lengths = LENGTHS[step:]
        plan = client.plan_step(step, lengths)
        if step + 1 < STEPS:
            client.prefetch(step + 1, LENGTHS[step + 1:])
        client.check_planned_batch(plan, lengths)
        held.append({"plan_id": plan.plan_id, "samples": sum(len(g.sample_ids) for mb in plan.micro_batches for g in mb.cp_groups),
                     "source": client.last_source})
    return held


def _run_rank(rank: int, store_path: str, endpoint: str, unreachable: str, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # forked: never enter the parent's OpenMP pool
    from megatron.core import parallel_state

    from trainer_client import BatchPlannerClient
    from trainer_client.service.rpc_client import PlanRejectedError

    init_gloo(rank, WORLD, store_path)
    initialize_dpxcp_groups(context_parallel_size=CP, tensor_model_parallel_size=TP)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    report: dict = {"tp_rank": dist.get_rank(tp_group)}
    try:
        for who_asks in ("leader", "all_ranks"):
            client = BatchPlannerClient(_config(endpoint, JOBS[who_asks], who_asks), tp_group=tp_group)
            report[who_asks] = {"dp_cp_rank": client.rank, "leads": client.leads, "asks": client.asks, "steps": _steps(client)}
            client.close()
        # A batch the planner refuses: every rank raises the refusal TP rank 0's DPxCP group received.
        client = BatchPlannerClient(_config(endpoint, JOBS["refused"]), tp_group=tp_group)
        client.prefetch(0, TOO_LONG)
        with pytest.raises(PlanRejectedError) as refused:
            client.plan_step(0, TOO_LONG)
        report["refused"] = [refused.value.code, str(refused.value)]
        client.close()
        # TP rank 1 reads another batch than TP rank 0: its DPxCP group refuses the plan made for TP
        # rank 0's batch (every rank of it), and TP rank 0's trains its own.
        client = BatchPlannerClient(_config(endpoint, JOBS["leader"]), tp_group=tp_group)
        report["differs"] = _outcome(client, 0, LENGTHS if report["tp_rank"] == 0 else LENGTHS[1:])
        client.close()
        # No planner, and fallback off: TP rank 0's failure reaches every rank.
        client = BatchPlannerClient(_config(unreachable, JOBS["leader"], fallback=False, deadline_seconds=1.0), tp_group=tp_group)
        report["unavailable"] = _outcome(client, 0, LENGTHS)
        client.close()
        # The DPxCP group is not the TP group of the leading ranks: refused on every rank, by name.
        with pytest.raises(ValueError, match=r"tp_group: TP ranks \[0\] lead their DPxCP groups and \[1\] do not"):
            BatchPlannerClient(_config(endpoint, JOBS["leader"]), tp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        report["mixed_group_refused"] = True
        write_rank_result(out_dir, rank, report)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _requests(text: str, job: str, code: str = "OK") -> float:
    return sample_value(text, "batch_planner_requests_total", scheduler="hybrid_cp", code=code, training_job=job)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp_rank_0_asks_once_per_step_for_every_tp_rank(planner: PlannerProcess, tmp_path):
    before = scrape(planner.metrics_url)
    unreachable = f"127.0.0.1:{free_port()}"
    run_ranks(_run_rank, (str(tmp_path / "store"), planner.address, unreachable, str(tmp_path)), WORLD, JOIN_DEADLINE_SECONDS)
    after = scrape(planner.metrics_url)
    reports = read_rank_results(tmp_path, WORLD)

    # parallel_state's TP2 x CP2: global rank = TP rank + 2 x CP rank. Ranks 0 and 1 lead the DPxCP
    # groups of TP ranks 0 and 1; only rank 0 asks, rank 1 gets its answer over TP.
    leader = [r["leader"] for r in reports]
    assert [(r["leads"], r["asks"]) for r in leader] == [(True, True), (True, False), (False, False), (False, False)]
    for step in range(STEPS):
        held = [r["steps"][step] for r in leader]
        assert len({h["plan_id"] for h in held}) == 1, held  # one plan for every rank of every TP rank
        assert all(h["samples"] == len(LENGTHS) - step for h in held)  # every sample planned once
        assert [h["source"] for h in held] == ["service", "service", None, None]  # the leaders know where it came from
    # STEPS, and the differing batch's step once (TP rank 0's): never once per TP rank.
    assert _requests(after, JOBS["leader"]) - _requests(before, JOBS["leader"]) == STEPS + 1

    # who_asks=all_ranks: every rank leads, so each TP group shares its TP rank 0's answer.
    every = [r["all_ranks"] for r in reports]
    assert [r["asks"] for r in every] == [r["tp_rank"] == 0 for r in reports]
    assert all(len({r["steps"][step]["plan_id"] for r in every}) == 1 for step in range(STEPS))
    assert _requests(after, JOBS["all_ranks"]) - _requests(before, JOBS["all_ranks"]) == STEPS * WORLD // TP

    refused = {tuple(r["refused"]) for r in reports}
    assert len(refused) == 1, refused  # the same refusal on every rank
    code, message = refused.pop()
    assert code == "INVALID_ARGUMENT" and "sample 0 has length 5000" in message, message
    assert _requests(after, JOBS["refused"], "INVALID_ARGUMENT") - _requests(before, JOBS["refused"], "INVALID_ARGUMENT") == 1
    assert all(r["mixed_group_refused"] for r in reports)

    differs = [r["differs"] for r in reports]
    assert differs[0] == differs[2] == leader[0]["steps"][0]["plan_id"], differs  # TP rank 0's DPxCP group: its plan
    for rank in (1, 3):  # TP rank 1's DPxCP group: leader and member alike
        assert differs[rank].startswith("PlanMismatchError: this TP rank's batch differs from TP rank 0's"), differs[rank]
    unavailable = {r["unavailable"] for r in reports}
    assert len(unavailable) == 1 and unavailable.pop().startswith("PlannerUnavailableError: "), [r["unavailable"] for r in reports]


# What each of 2 TP ranks' reads of a step gave (None: read), per case: `agree_on_read`, which the
# Bridge drop-in runs before it plans a step, so that no TP rank enters the TP broadcast alone.
READS = {
    "both_read": (None, None),
    "both_ended": ("end", "end"),
    "one_ended": (None, "end"),
    "one_failed": ("bad", None),
}


def _read_agreement_rank(rank: int, store_path: str, out_dir: str) -> None:
    from trainer_client.dropin import DropInInputError, agree_on_read

    init_gloo(rank, 2, store_path)
    outcomes = {}
    try:
        for case, reads in READS.items():
            failure = {None: None, "end": StopIteration(), "bad": DropInInputError("step 1: sample 3 has no tokens")}[reads[rank]]
            try:
                agree_on_read(failure, dist.group.WORLD)
                outcomes[case] = "plans"
            except StopIteration:
                outcomes[case] = "StopIteration"
            except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
                outcomes[case] = f"{type(error).__name__}: {error}"
        with open(os.path.join(out_dir, f"reads{rank}.json"), "w") as f:
            json.dump(outcomes, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp_ranks_plan_a_step_all_or_none(tmp_path):
    run_ranks(_read_agreement_rank, (str(tmp_path / "reads-store"), str(tmp_path)), 2, JOIN_DEADLINE_SECONDS)
    first, second = (json.loads((tmp_path / f"reads{r}.json").read_text()) for r in range(2))
    assert first["both_read"] == second["both_read"] == "plans"
    assert first["both_ended"] == second["both_ended"] == "StopIteration"
    # A rank whose data ended while the other read on: an error on both, not StopIteration on one.
    ended = "PlanMismatchError: TP rank 1 could not read this step (its data ended, the others read on); no TP rank plans it"
    assert first["one_ended"] == second["one_ended"] == ended
    # A rank whose read failed: its own error on it, and the same error on every other rank, naming it.
    assert first["one_failed"] == "DropInInputError: step 1: sample 3 has no tokens"
    assert second["one_failed"] == "DropInInputError: TP rank 0 could not read this step: step 1: sample 3 has no tokens"
