"""The Bridge drop-in on 4 real gloo ranks (DP2 x CP2, TP2 x CP2, and DP4 with the contiguous layout on
the dev build) and on 6 (DP3 x CP2: a DPxCP that is not a power of two, dynamic CP planned batch by
batch), a real planner on loopback,
Bridge's own distributed initialisation, `train_step` with its rerun loop, `evaluate`, its GPT
forward step and loss (tests/trainer_client/megatron_bridge/dropin_ranks.py names the CPU stand-ins).

Per step and rank: the micro-batch count, each unit's tokens and positions (bitwise) and its CP
group equal the plan applied to the whole step's batch; the loss Bridge reports equals a
single-process reference over the same samples; steps are re-run in place by the rerun state
machine (a failed validation injected) and no micro-batch is read twice; evaluation runs on planned micro-batches; the planner is
killed after the first step (the second was planned ahead), the third falls back in process with the plan ids the service would
have sent, and every sample is trained exactly once."""

from __future__ import annotations

import math
import re
import time
from collections import Counter

import pytest

from tests.trainer_client.megatron_bridge import dropin_ranks as ranks
from tests.support.launch import read_rank_results, run_ranks, write_rank_result
from tests.support.planner_process import start_planner
from tests.support.reliability_support import assert_requests_of_plans, client_counts, metric

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

STEPS = 3
STOP_PLANNER_AFTER = 0  # step after which rank 0 kills the planner (the next one is planned already)
DEADLINE_SECONDS = 600
LAYOUTS = {"dp2_cp2": (1, 2, 4), "tp2_cp2": (2, 2, 4), "dp3_cp2": (1, 2, 6), "dp4_contiguous": (1, 1, 4)}  # (TP, CP, ranks)
# The TP layout also plans with min_dynamic_context_parallel_size 2 where the build has it: then
# parallel_state builds no CP group of size 1.
MIN_CP = {"dp2_cp2": None, "tp2_cp2": 2, "dp3_cp2": None, "dp4_contiguous": None}
# The contiguous layout (dev build): the model's cp_partition_mode, static CP1 as upstream allows it
# for standard attention, the dynamic groups over DP4; Megatron-Core converts the drop-in's
# contiguous shards to zigzag around attention.
MODEL = {"dp4_contiguous": {"cp_partition_mode": "contiguous"}}


@pytest.fixture(scope="module", autouse=True)
def bridge_imported_before_the_ranks_fork():
    """Bridge's modules that the ranks run, imported in this process: the forked ranks inherit them
    (each rank importing them itself costs ~14 s of CPU)."""
    from megatron.bridge.models import gpt_provider  # noqa: F401
    from megatron.bridge.training import config, eval, gpt_step, initialize, optim, state, train  # noqa: F401
    import trainer_client.megatron_bridge  # noqa: F401


@pytest.fixture(scope="module")
def running_planner():
    """One planner for the tests that leave theirs running: the pipeline tests, and on the release
    the dynamic-CP tests (they stop theirs only where the trainer plans dynamic CP in process once
    it is gone: the dev build). Each start costs two imports of Megatron-Core. Every test names a
    job of its own and reads its own job's request-log lines only (`_asked`)."""
    planner = start_planner(workers=1, without_release_overlay=True)
    yield planner
    planner.stop()


def _asked(planner, job: str, done) -> Counter:
    """The Plan requests of `job` the planner answered OK (its request log), by plan id. A planner
    that was stopped has logged them all once its output ended; one still running logs each
    after counting it in its metrics, and the lines reach this process a moment after the answers
    reach the ranks: read once every request its metrics count is in the log and `done(found)`
    holds, or after 60 s as they are (the caller's assertions say what is missing)."""
    pattern = re.compile(rf"\bplan plan_id=(\S+) .*\btraining_job={re.escape(job)} .*status=OK")
    deadline = time.monotonic() + 60
    while True:
        running = planner.proc.poll() is None
        counted = metric(planner, "batch_planner_requests_total", code="OK", training_job=job) if running else 0.0
        found = Counter(pattern.findall(planner.log))
        if (sum(found.values()) >= counted and done(found)) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _rank(rank: int, *args) -> None:
    with ranks.CudaDeviceRequestsOnCpu():
        _train_and_evaluate(rank, *args)


def _train_and_evaluate(rank: int, world: int, store_path: str, out_dir: str, tp: int, cp: int, min_cp: int | None, endpoint: str,
                        planner_pid: int, port: int, model: dict, job: str) -> None:
    import torch.distributed as dist

    model_overrides = {"min_dynamic_context_parallel_size": min_cp} if min_cp and ranks._has_dynamic_cp() else {}
    model_overrides.update(model)
    cfg, state, model, optimizer, scheduler, pgs, p2p = ranks.start_rank(
        rank, world, store_path, tp, cp, model=model_overrides,
        # Every step's (non-fatal) spiky-loss check is failed on purpose, so the state machine re-runs
        # the step in place and then continues.
        rerun_state_machine={"rerun_mode": "validate_results", "error_injection_rate": 1,
                             "error_injection_type": "transient_error", "check_for_nan_in_loss": False,
                             "check_for_spiky_loss": True},
    )
    from megatron.bridge.training import eval as bridge_eval
    from megatron.bridge.training import train as bridge_train
    from megatron.core.rerun_state_machine import RerunDataIterator

    from batch_planner.planner import plan_batch
    from trainer_client.plans.apply import micro_batches_for_rank
    from trainer_client.megatron_bridge import active, enable

    planner = {"planner_endpoint": endpoint, "deadline_seconds": 20.0, "fallback_cooldown_seconds": 0.0, "job": job}
    assert enable(cfg, planner=planner)
    dp_rank, dp = pgs.dp.rank(), pgs.dp.size()
    source = ranks.CountingIterator(dp_rank, STEPS + 2)  # more data than the steps run
    data = RerunDataIterator(source)
    step_func = ranks.forward_step(state)
    fbf = bridge_train.get_forward_backward_func(pp_size=1, vp_size=None)
    module = model[0].module  # the GPTModel inside DDP
    handed = []  # the PackedSeqParams each forward pass gave the model
    module.register_forward_pre_hook(lambda _, args, kwargs: handed.append(kwargs.get("packed_seq_params")), with_kwargs=True)
    records = []
    for step in range(STEPS):
        samples = ranks.global_samples(step, dp)
        reference = ranks.reference_loss(module, samples)
        handed.clear()
        losses, *rest = bridge_train.train_step(step_func, data, model, optimizer, scheduler, state, pgs, fbf, p2p)
        assert "lm loss" in losses, (losses, rest)
        planned = active().planned_iterator(data, ranks.MICRO_BATCHES, pgs)
        plan = planned.last_step.plan
        expected = micro_batches_for_rank(plan, ranks.full_batch(samples), pgs.dp_cp.rank(), None, pack_group_samples=True)
        client = planned.planner.client
        records.append({
            "loss": float(losses["lm loss"]), "reference": reference, "plan_id": plan.plan_id,
            "in_process_plan_id": plan_batch(client.request_for([int(s["tokens"].shape[0]) for s in samples], step)).plan_id
            if ranks._has_dynamic_cp() else None,
            "source": planned.last_step.source, "asks": client.asks, "num_samples": len(samples), "micro_batches": len(plan.micro_batches),
            "units": [ranks.unit_record(u) for u in planned.last_units],
            "handed": [ranks.params_record(p) for p in handed],
            "expected": [dict(ranks.unit_record(u), cp_group=None) for u in expected],
            "group_positions": [[list(g.ranks) for g in mb.cp_groups] for mb in plan.micro_batches],
        })
        if step == STOP_PLANNER_AFTER and ranks._has_dynamic_cp():  # 0.19 cannot plan dynamic CP in process
            if rank == 0:
                ranks.stop_planner(planner_pid, port)
            dist.barrier()
    # Evaluation through Bridge's own evaluate(), on a data iterator of its own.
    eval_source = ranks.CountingIterator(dp_rank, 1, first_step=100)
    eval_data = RerunDataIterator(eval_source)
    eval_reference = ranks.reference_loss(module, ranks.global_samples(100, dp))
    handed.clear()
    totals, _, _ = bridge_eval.evaluate(state, ranks.forward_step(state), eval_data, model, None, cfg, verbose=False,
                                        p2p_communicator=p2p, pg_collection=pgs)
    evaluated = active().planned_iterator(eval_data, ranks.MICRO_BATCHES, pgs)
    checksum = float(sum(p.double().sum() for p in module.parameters()))
    write_rank_result(out_dir, rank, {
        "steps": records, "reads": source.reads, "reruns": planned.reruns, "handed_out": planned.steps,
        "eval": {"loss": float(totals["lm loss"]), "reference": eval_reference, "steps": evaluated.steps,
                 "units": len(evaluated.last_units), "reads": eval_source.reads,
                 "handed": [ranks.params_record(p) for p in handed],
                 "expected": [ranks.params_record(u.packed_seq_params) for u in evaluated.last_units]},
        "checksum": checksum, "dp_cp_ranks": dist.get_process_group_ranks(pgs.dp_cp), "dp_rank": dp_rank,
        "sent_again": sum(client_counts(p.planner.client.metrics)["sent_again"] for p in (planned, evaluated)),
    })
    from trainer_client.megatron_bridge import disable

    disable()


@pytest.mark.timeout(DEADLINE_SECONDS + 120)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dynamic_cp_through_bridge_train_step(layout, tmp_path, request):
    tp, cp, world = LAYOUTS[layout]
    if layout in MODEL and not ranks._has_dynamic_cp():
        pytest.skip("the contiguous layout needs the dev build's cp_partition_mode (0.19 reads every CP shard as zigzag)")
    stops = _trainer_has_dynamic_cp()  # rank 0 kills the planner after the first step (a planner of its own)
    planner = start_planner(workers=1, without_release_overlay=True) if stops else request.getfixturevalue("running_planner")
    job = f"bridge-{layout}"
    try:
        run_ranks(_rank, (world, str(tmp_path / "store"), str(tmp_path), tp, cp, MIN_CP[layout], planner.address,
                          planner.proc.pid, planner.port, MODEL.get(layout, {}), job),
                  world, DEADLINE_SECONDS)
    finally:
        if stops:
            planner.stop()
    if stops:
        assert planner.output_closed.wait(60), "the planner's output did not end"  # every request's log line read
    results = read_rank_results(tmp_path, world)
    for rank, result in enumerate(results):
        for step, record in enumerate(result["steps"]):
            where = f"{layout} rank {rank} step {step}"
            assert len(record["units"]) == record["micro_batches"], where
            for got, want in zip(record["units"], record["expected"]):
                assert {k: v for k, v in got.items() if k != "cp_group"} == {k: v for k, v in want.items() if k != "cp_group"}, where
            _check_cp_groups(record, result["dp_cp_ranks"], where)
            _check_handed(record, where)
            assert record["loss"] == pytest.approx(record["reference"], rel=1e-5), where
            if _trainer_has_dynamic_cp():
                assert record["plan_id"] == record["in_process_plan_id"], where
        # Steps were re-run (the injector fails a validation once per rank and step, at random); each
        # rerun got its step again and nothing was read twice, the read-ahead included.
        assert 0 < result["reruns"] <= STEPS and result["handed_out"] == STEPS, (rank, result["reruns"], result["handed_out"])
        assert result["reads"] == [[s, result["dp_rank"], m] for s in range(STEPS + 1) for m in range(ranks.MICRO_BATCHES)], rank
        assert result["eval"]["steps"] == 1 and result["eval"]["units"] > 0, result["eval"]
        assert result["eval"]["handed"] == result["eval"]["expected"], rank  # eval's forward got the planned units
        assert result["eval"]["loss"] == pytest.approx(result["eval"]["reference"], rel=1e-5), result["eval"]
    assert len({r["reruns"] for r in results}) == 1, [r["reruns"] for r in results]  # the state machine reruns all
    sources = [r["source"] for r in results[0]["steps"]]
    assert sources[0] == "service" and sources[-1] == ("fallback" if _trainer_has_dynamic_cp() else "service"), sources
    # One rank asks the planner for the whole job: rank 0 of TP rank 0's DPxCP group. With TP2 the
    # other TP rank's DPxCP group (led by rank 1) gets its answer over TP, where it came from too.
    # The planner's request log: each plan asked for once (without the sharing, once per TP rank),
    # plus one answer for each call sent again (a busy machine's hedge), every step served by the
    # service among them.
    served = {r["plan_id"] for r in results[0]["steps"] if r["source"] == "service"}
    asked = _asked(planner, job, lambda found: served <= set(found))
    assert asked, planner.log
    assert_requests_of_plans(sum(asked.values()), len(asked), sum(r["sent_again"] for r in results))
    assert served <= set(asked), (asked, results[0]["steps"])
    assert [r["asks"] for result in results for r in result["steps"]] == [rank == 0 for rank in range(world) for _ in range(STEPS)]
    for rank, result in enumerate(results):
        if result["dp_cp_ranks"][0] == rank:  # leads its DPxCP group
            assert [r["source"] for r in result["steps"]] == sources, (rank, result["steps"])
    _check_every_sample_once(results)
    padded = [u for r in results for record in r["steps"] for u in record["units"]
              if u["cp_size"] > 1 and u["cu_seqlens_padded"][-1] > u["cu_seqlens"][-1]]
    assert padded, "no CP group pads: the lengths test nothing"
    for result in results:  # replicas of one DPxCP group hold the same weights after the updates
        peers = [results[r]["checksum"] for r in result["dp_cp_ranks"]]
        assert max(peers) - min(peers) < 1e-9 * max(1.0, abs(peers[0])), peers


def _trainer_has_dynamic_cp() -> bool:
    """The dev build plans dynamic CP in process (the fallback); a release (0.19) trainer cannot."""
    return ranks._has_dynamic_cp()


def _check_handed(record: dict, where: str) -> None:
    """What Bridge's forward step gave the model: each planned unit's own PackedSeqParams (its CP
    group, size and cu_seqlens), in order, once per run of the step (the first run and its reruns)."""
    handed, units = record["handed"], record["units"]
    assert handed and len(handed) % len(units) == 0, (where, len(handed), len(units))
    for k, got in enumerate(handed):
        unit = units[k % len(units)]
        assert got["cp_group"] == unit["cp_group"] and got["local_cp_size"] == unit["cp_size"], (where, k, got, unit)
        assert got["cu_seqlens_q"] == unit["cu_seqlens"] and got["cu_seqlens_q_padded"] == unit["cu_seqlens_padded"], where


def _check_cp_groups(record: dict, dp_cp_ranks: list[int], where: str) -> None:
    """Each unit's process group is parallel_state's group of exactly the plan's ranks."""
    for index, unit in enumerate(record["units"]):
        positions = next(g for g in record["group_positions"][index] if dp_cp_ranks.index(unit["cp_group"][0]) in g)
        assert unit["cp_group"] == [dp_cp_ranks[p] for p in positions], (where, index, unit["cp_group"], positions)
        assert unit["cp_size"] == len(positions), where


def _check_every_sample_once(results: list[dict]) -> None:
    """Per step and DPxCP group: each global sample is in exactly one CP group, led by one rank."""
    groups = {tuple(r["dp_cp_ranks"]) for r in results}
    for group in groups:
        for step in range(STEPS):
            led = [i for r in group for u in results[r]["steps"][step]["units"] if u["cp_rank"] == 0 for i in u["sample_ids"]]
            assert sorted(led) == list(range(results[group[0]]["steps"][step]["num_samples"])), (group, step, sorted(led))


PIPELINE_STEPS = 2


def _pipeline_job(vpp: int | None, mtp: int | None) -> str:
    return f"bridge-pipeline-vpp{vpp or 1}-mtp{mtp or 0}"


def _pipeline_rank(rank: int, *args) -> None:
    with ranks.CudaDeviceRequestsOnCpu():
        _train_pipeline(rank, *args)


def _train_pipeline(rank: int, world: int, store_path: str, out_dir: str, endpoint: str, vpp: int | None, mtp: int | None) -> None:
    """DP2 x CP2 x PP2 through Bridge's train_step (Megatron-Core's 1F1B schedule between the two
    stages; with `vpp`, the interleaved one over two virtual stages; with `mtp`, that many MTP
    layers on the last stage), the attention stand-in (with RoPE on the dev build), a real planner."""
    import torch.distributed as dist

    from tests.support.attention_parity import _clear_mtp_tracker, _mtp_losses

    # MTP at loss scale 0: Megatron-Core scales each forward's MTP loss by that forward's own token
    # count (tests/support/attention_model.py), so only then do the weights, and the next step's loss,
    # equal a whole-sample run's.
    model_fields = {"model": {"mtp_num_layers": mtp, "mtp_loss_scaling_factor": 0.0}} if mtp else {}
    cfg, state, model, optimizer, scheduler, pgs, p2p = ranks.start_rank(rank, world, store_path, 1, 2, pp=2, vpp=vpp, **model_fields)
    from megatron.bridge.training import train as bridge_train
    from megatron.core.rerun_state_machine import RerunDataIterator

    from trainer_client.plans.apply import micro_batches_for_rank
    from trainer_client.megatron_bridge import active, disable, enable

    assert enable(cfg, planner={"planner_endpoint": endpoint, "deadline_seconds": 20.0, "job": _pipeline_job(vpp, mtp)})
    dp_rank, dp = pgs.dp.rank(), pgs.dp.size()
    data = RerunDataIterator(ranks.CountingIterator(dp_rank, PIPELINE_STEPS + 1))
    fbf = bridge_train.get_forward_backward_func(pp_size=2, vp_size=vpp)
    modules = [chunk.module for chunk in model]
    records = []
    for step in range(PIPELINE_STEPS):
        samples = ranks.global_samples(step, dp)
        reference = ranks.pipeline_reference_loss(modules, samples)
        _clear_mtp_tracker()
        losses, *_ = bridge_train.train_step(ranks.forward_step(state), data, model, optimizer, scheduler, state, pgs, fbf, p2p)
        mtp_ran = _mtp_losses()
        planned = active().planned_iterator(data, ranks.MICRO_BATCHES, pgs)
        plan = planned.last_step.plan
        expected = micro_batches_for_rank(plan, ranks.full_batch(samples), pgs.dp_cp.rank(), None, pack_group_samples=True)
        records.append({
            "loss": float(losses["lm loss"]) if "lm loss" in losses else None, "reference": reference,
            "plan_id": plan.plan_id, "source": planned.last_step.source, "micro_batches": len(plan.micro_batches),
            "mtp": None if mtp_ran is None else mtp_ran.tolist(),
            "units": [ranks.unit_record(u) for u in planned.last_units],
            "expected": [dict(ranks.unit_record(u), cp_group=None) for u in expected],
        })
    write_rank_result(out_dir, rank, {"steps": records, "stage": pgs.pp.rank(), "dp_cp_ranks": dist.get_process_group_ranks(pgs.dp_cp),
                                      "sent_again": client_counts(planned.planner.client.metrics)["sent_again"]})
    disable()


@pytest.mark.timeout(DEADLINE_SECONDS + 120)
@pytest.mark.parametrize("vpp,mtp", [(None, None), (2, None), (None, 1)], ids=["pp2", "pp2-vpp2", "pp2-mtp"])
def test_pipeline_stages_through_bridge_train_step(tmp_path, vpp, mtp, running_planner):
    """Every stage trains the planned micro-batches; the last stage's loss equals the pipeline over
    whole samples at CP1 (the attention stand-in with RoPE: a wrong CP group, chunk or position
    changes it; learned positions on 0.19); the stages hold one plan a step, and each stage's DPxCP
    group asks the planner once. With two virtual stages each chunk gets its own iterator over the
    step's units (Bridge's make_data_iterator_list), and the plan is made with the micro-batch group
    (a micro-batch count the interleaved schedule takes). Virtual stages need the dev build's
    VPP-aware scheduler: 0.19 refuses them (the transformer's VPP row). With one MTP layer (dev
    build; 0.19 refuses MTP, its MTP row), the last stage runs it on every step's planned units (its stage receives all four fields); its
    loss is not compared: Bridge's forward step hands the model no loss mask, so Megatron-Core's
    MTP counts every row, padding included, and the padding depends on the CP group."""
    if vpp and not _trainer_has_dynamic_cp():
        pytest.skip("0.19 has no VPP-aware packing scheduler: the refusal table refuses virtual stages there")
    if mtp and not _trainer_has_dynamic_cp():
        pytest.skip("0.19 rolls MTP's packed input over the static CP group: the refusal table refuses MTP there")
    world = 8
    planner = running_planner
    run_ranks(_pipeline_rank, (world, str(tmp_path / "store"), str(tmp_path), planner.address, vpp, mtp), world, DEADLINE_SECONDS)
    results = read_rank_results(tmp_path, world)
    assert sorted(r["stage"] for r in results) == [0] * 4 + [1] * 4
    for rank, result in enumerate(results):
        for step, record in enumerate(result["steps"]):
            where = f"pp2 rank {rank} (stage {result['stage']}) step {step}"
            assert len(record["units"]) == record["micro_batches"], where
            for got, want in zip(record["units"], record["expected"]):
                assert {k: v for k, v in got.items() if k != "cp_group"} == {k: v for k, v in want.items() if k != "cp_group"}, where
            if result["stage"] == 1:
                assert record["loss"] == pytest.approx(record["reference"], rel=1e-5), (where, record["loss"], record["reference"])
            if mtp and result["stage"] == 1:  # [loss sum, token count] of the one MTP layer
                assert record["mtp"] and record["mtp"][1] > 0 and math.isfinite(record["mtp"][0]), (where, record["mtp"])
            else:
                assert record["mtp"] is None, (where, record["mtp"])
    for step in range(PIPELINE_STEPS):  # one plan a step on every rank of both stages
        assert len({r["steps"][step]["plan_id"] for r in results}) == 1, step
        # Each stage's DPxCP group got it from the service (the client's 20 s deadline: a busy
        # machine's slow answer is waited for, never planned in process), on the rank that leads it.
        for rank, result in enumerate(results):
            leads = result["dp_cp_ranks"][0] == rank
            assert result["steps"][step]["source"] == ("service" if leads else None), (rank, result["stage"], step, result["steps"][step]["source"])
    # Each stage's DPxCP group asked once a step, the step read ahead after the last one included,
    # plus one answer for each call sent again (a busy machine's hedge).
    asked = _asked(planner, _pipeline_job(vpp, mtp), lambda found: len(found) >= PIPELINE_STEPS + 1)
    assert len(asked) == PIPELINE_STEPS + 1 and min(asked.values()) >= 2, asked
    assert_requests_of_plans(sum(asked.values()), 2 * (PIPELINE_STEPS + 1), sum(r["sent_again"] for r in results))
