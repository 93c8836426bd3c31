"""verl's Megatron-engine contract on real gloo ranks, Megatron-Core's parallel_state (dev build,
dynamic CP groups), a real planner server on loopback and the installed verl 0.9.1:

- every rank's micro-batches from `trainer_client.verl.DynamicCPScheduler` equal, key by key and
  tensor by tensor, those of verl's own `DynamicCPScheduler.schedule` on the same batch (4 and 8
  ranks, TP 1 and 2, zigzag and contiguous, `min_local_rows` set and unset), with the plans served
  by the service, and again with the service down (in-process fallback);
- verl's `postprocess_dynamic_cp_batch` restores every sample's output in order from them;
- the RL shape: old log-probs, reference log-probs and 2 epochs over 4 mini-batches ask the
  service for 4 plans, not 16 (the client's metrics); the plan cache is bounded; `auto` runs
  only dynamic-CP candidates, whose plans run through the same contract.
"""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_init import initialize_dpxcp_groups
from tests.support.launch import init_gloo, run_ranks

MAX_SEQLEN = 64  # tokens per DPxCP rank: small, so long samples span several CP ranks
MIN_LOCAL_ROWS = 96  # larger than most short groups' buffers: the padding past it is exercised
DEADLINE = 240.0


def _init(rank: int, world: int, store_path: str, tp: int, cp: int, pp: int = 1):
    warnings.simplefilter("ignore")
    init_gloo(rank, world, store_path)
    initialize_dpxcp_groups(cp, tp, pp)
    from megatron.core import parallel_state as mpu

    group = mpu.get_data_parallel_group(with_context_parallel=True)
    return group, mpu.get_data_parallel_world_size(), mpu.get_context_parallel_world_size()


def _sample(job: str, source: str, planner) -> float:
    value = planner.metrics.registry.get_sample_value(
        "batch_planner_client_plans_total", {"training_job": planner.metrics.job, "source": source}
    )
    return value or 0.0


def _fallback_reasons(planners) -> dict[str, float]:
    """Why plans were made in-process, by `fallbacks_total`'s reason: what a failed count says."""
    reasons: dict[str, float] = {}
    for p in planners:
        for metric in p.metrics.fallbacks.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    reasons[sample.labels["reason"]] = reasons.get(sample.labels["reason"], 0.0) + sample.value
    return reasons


def _schedule_both(batch, group, dp, cp, tp, layout, min_rows, where):
    from verl.utils.dynamic_cp_scheduler import DynamicCPScheduler as VerlScheduler
    from verl.utils.dynamic_cp_scheduler import postprocess_dynamic_cp_batch

    from tests.trainer_client.verl.support import assert_same_micro_batches, fake_outputs
    from trainer_client.verl import DynamicCPScheduler

    theirs = VerlScheduler(MAX_SEQLEN, dp, cp).schedule(batch, group, tp_size=tp, cp_layout=layout, min_local_rows=min_rows)
    ours = DynamicCPScheduler(MAX_SEQLEN, dp, cp).schedule(batch, group, tp_size=tp, cp_layout=layout, min_local_rows=min_rows)
    assert_same_micro_batches(ours, theirs, where)
    restored = _assert_outputs_restored(ours, batch, group, where)
    reference = postprocess_dynamic_cp_batch(fake_outputs(theirs), len(batch), group)
    assert restored["loss"] == reference["loss"] and restored["metrics"] == reference["metrics"], where
    return ours


def _assert_outputs_restored(ours, batch, group, where: str) -> dict:
    """verl's `postprocess_dynamic_cp_batch` gives every sample's output back, in order, from our
    micro-batches; returns what it restored."""
    from verl.utils.dynamic_cp_scheduler import postprocess_dynamic_cp_batch

    from tests.trainer_client.verl.support import fake_outputs

    restored = postprocess_dynamic_cp_batch(fake_outputs(ours), len(batch), group)
    expected = [t.float() * 0.5 for t in batch["input_ids"].unbind()]
    got = restored["model_output"]["log_probs"].unbind()
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)), f"{where}: outputs"
    return restored


def _equality_rank(rank: int, world: int, store_path: str, tp: int, cp: int, source: str) -> None:
    from tests.trainer_client.verl.support import long_tail, mini_batch
    from trainer_client.verl import closing_planners, planners

    with closing_planners():
        group, dp, cpw = _init(rank, world, store_path, tp, cp)
        cases = list(itertools.product(("zigzag", "contiguous"), (None, MIN_LOCAL_ROWS)))
        for case, (layout, min_rows) in enumerate(cases):
            lengths = long_tail(5 * group.size(), MAX_SEQLEN * group.size(), seed=100 * world + 10 * tp + case)
            batch = mini_batch(lengths, seed=case)
            where = f"rank {rank}, world {world} TP{tp} CP{cpw}, {layout}, min_local_rows={min_rows}"
            _schedule_both(batch, group, dp, cpw, tp, layout, min_rows, where)
        asked = sum(_sample(p.metrics.job, source, p) for p in planners())
        other = sum(_sample(p.metrics.job, "fallback" if source == "service" else "service", p) for p in planners())
        if group.rank() == 0:  # the asking rank: one plan per distinct mini-batch, all from `source`
            assert (asked, other) == (len(cases), 0.0), (
                f"rank {rank}: plans from {source} {asked}, other {other} (fallbacks by reason: {_fallback_reasons(planners())})"
            )
        else:
            assert (asked, other) == (0.0, 0.0), f"rank {rank} asked the planner but is not its group's asking rank"
        if source == "fallback" and group.rank() == 0:
            fallbacks = planners()[0].metrics.registry.get_sample_value(
                "batch_planner_client_fallbacks_total", {"training_job": planners()[0].metrics.job, "reason": "unavailable"}
            )
            assert fallbacks and fallbacks >= 1, fallbacks
    dist.destroy_process_group()


def _use_service(monkeypatch, address: str, tmp_path=None) -> None:
    """The drop-in's ranks find the planner at `address`, through the environment. With `tmp_path`, a
    config file gives each plan a deadline that 8 ranks and the planner sharing 2 cores cannot run
    past (the default 2 s can: the plan is then the fallback's, which these tests count as a failure)."""
    monkeypatch.setenv("BATCH_PLANNER_ENDPOINT", address)
    monkeypatch.delenv("BATCH_PLANNER_CONFIG", raising=False)
    if tmp_path is not None:
        config = tmp_path / "planner.yaml"
        config.write_text("batch_planner:\n  deadline_seconds: 60.0\n")
        monkeypatch.setenv("BATCH_PLANNER_CONFIG", str(config))


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,cp", [(4, 1, 2), (4, 2, 2), (8, 1, 4), (8, 2, 2)])
def test_micro_batches_equal_verls_own_where_the_service_plans(world, tp, cp, tmp_path, planner, monkeypatch):
    _use_service(monkeypatch, planner.address, tmp_path)
    run_ranks(_equality_rank, (world, str(tmp_path / "store"), tp, cp, "service"), world, DEADLINE)


@pytest.mark.slow
def test_micro_batches_equal_verls_own_when_planned_in_process(tmp_path, monkeypatch):
    # Nothing listens there: every plan is the in-process fallback (Megatron-Core in this process).
    _use_service(monkeypatch, "127.0.0.1:9")
    run_ranks(_equality_rank, (4, str(tmp_path / "store"), 1, 2, "fallback"), 4, DEADLINE)


def _pipeline_rank(rank: int, world: int, store_path: str) -> None:
    """DP2 x CP2 x PP2: verl's engine schedules each mini-batch on every rank of every pipeline
    stage, each stage over its own DPxCP group; every stage's micro-batches equal verl's own, and
    each stage's group asks the planner once per mini-batch."""
    from megatron.core import parallel_state as mpu

    from tests.trainer_client.verl.support import long_tail, mini_batch
    from trainer_client.verl import closing_planners, planners

    with closing_planners():
        group, dp, cp = _init(rank, world, store_path, 1, 2, pp=2)
        stage = mpu.get_pipeline_model_parallel_rank()
        for case in range(2):
            batch = mini_batch(long_tail(5 * group.size(), MAX_SEQLEN * group.size(), seed=700 + case), seed=700 + case)
            _schedule_both(batch, group, dp, cp, 1, "zigzag", None, f"rank {rank}, pipeline stage {stage}, mini-batch {case}")
        asked = sum(_sample(p.metrics.job, "service", p) for p in planners())
        assert asked == (2.0 if group.rank() == 0 else 0.0), f"rank {rank} (stage {stage}): {asked} plans from the service"
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_pipeline_stage_gets_verls_own_micro_batches(tmp_path, planner, monkeypatch):
    _use_service(monkeypatch, planner.address, tmp_path)
    run_ranks(_pipeline_rank, (8, str(tmp_path / "store")), 8, DEADLINE)


def _rl_rank(rank: int, world: int, store_path: str, auto_config: str) -> None:
    from batch_planner.request import SchedulerKind
    from tests.trainer_client.verl.support import long_tail, mini_batch
    from trainer_client import BatchPlannerClient
    from trainer_client.verl import DynamicCPScheduler, closing_planners

    with closing_planners():
        group, dp, cp = _init(rank, world, store_path, 1, 2)
        minis = [mini_batch(long_tail(12, 3 * MAX_SEQLEN, seed=50 + i), seed=50 + i) for i in range(4)]
        # As soon as the rollout batch exists: every mini-batch's plan at once.
        DynamicCPScheduler(MAX_SEQLEN, dp, cp).prefetch(minis, group, tp_size=1)
        passes = ["old_log_prob", "ref_log_prob", "update epoch 0", "update epoch 1"]
        for name in passes:
            for index, batch in enumerate(minis):  # verl builds a new scheduler for every call
                _schedule_both(batch, group, dp, cp, 1, "zigzag", None, f"rank {rank}, {name}, mini-batch {index}")
        planner = DynamicCPScheduler(MAX_SEQLEN, dp, cp).planner(group, tp_size=1)
        job = planner.metrics.job
        registry = planner.metrics.registry
        service = registry.get_sample_value("batch_planner_client_plans_total", {"training_job": job, "source": "service"}) or 0
        waits = registry.get_sample_value("batch_planner_client_plan_wait_seconds_count", {"training_job": job})
        assert waits == 16, f"rank {rank}: {waits} schedule calls"
        if group.rank() == 0:
            assert service == 4, f"the service was asked for {service} plans, not 4"
            assert (planner.ahead.hits, planner.ahead.misses) == (16, 0), (planner.ahead.hits, planner.ahead.misses)
        else:
            assert service == 0, f"rank {rank} asked the service"

        # Bounded: 2 plans kept; a third mini-batch pushes the first out, which is then asked again.
        with BatchPlannerClient(planner.config, group=group, cp_groups=None, plan_cache_size=2) as small:
            for batch in [*minis[:3], minis[0]]:
                small.plan(batch["input_ids"].offsets().diff().tolist(), cache=True)
            if group.rank() == 0:
                asked = small.metrics.registry.get_sample_value(
                    "batch_planner_client_plans_total", {"training_job": small.metrics.job, "source": "service"}
                )
                assert (small.ahead.cached(), asked) == (2, 4), (small.ahead.cached(), asked)

        # auto: restricted to dynamic CP through auto_schedulers; its plans run through verl's contract.
        os.environ["BATCH_PLANNER_CONFIG"] = auto_config
        scheduler = DynamicCPScheduler(MAX_SEQLEN, dp, cp)
        auto = scheduler.planner(group, tp_size=1)
        assert auto.config.scheduler is SchedulerKind.AUTO
        assert auto._options.auto_schedulers == (SchedulerKind.DYNAMIC_CP,)
        for batch in minis:
            _assert_outputs_restored(scheduler.schedule(batch, group, tp_size=1), batch, group, f"rank {rank}, auto")
    dist.destroy_process_group()


@pytest.mark.slow
def test_rl_loop_plans_each_mini_batch_once(tmp_path, planner, monkeypatch):
    _use_service(monkeypatch, planner.address)
    auto = tmp_path / "auto.yaml"
    auto.write_text("batch_planner:\n  scheduler: auto\n  deadline_seconds: 20.0\n")
    run_ranks(_rl_rank, (4, str(tmp_path / "store"), str(auto)), 4, DEADLINE)


def _all_ranks(flag: bool, group) -> bool:
    """Whether `flag` holds on every rank of `group`."""
    value = torch.tensor([1 if flag else 0])
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def _dp3_cp2_rank(rank: int, world: int, store_path: str) -> None:
    """DPxCP 6: where verl's own plan runs (it returns one, and every CP group it hands the model
    is one parallel_state built), ours equals it; where it would fail (verl raises, or a group of
    a size parallel_state does not build on 6 ranks), ours is the named substitute, every group
    it hands the model exists, and every sample's output comes back in order."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dynamic_cp_scheduler import DynamicCPScheduler as VerlScheduler

    from tests.support.megatron_init import parallel_state_cp_group
    from tests.trainer_client.verl.support import assert_same_micro_batches, long_tail, mini_batch
    from trainer_client.verl import DynamicCPScheduler, closing_planners

    with closing_planners():
        def built(size: int) -> bool:
            try:
                parallel_state_cp_group(size)
                return True
            except KeyError:
                return False

        group, dp, cp = _init(rank, world, store_path, 1, 2)
        same = substituted = 0
        for seed in range(16):
            # Half the batches within one CP2 group's budget (upstream's plan mostly runs), half up to the
            # whole group's (upstream needs a CP4 or CP8 group that 6 ranks do not have).
            lengths = long_tail(5 * world, MAX_SEQLEN * (2 if seed % 2 else world), seed=600 + seed)
            batch = mini_batch(lengths, seed=seed)
            where = f"rank {rank}, DP{dp} x CP{cp}, batch {seed}"
            try:
                theirs = VerlScheduler(MAX_SEQLEN, dp, cp).schedule(batch, group, tp_size=1)
                runs = all(built(tu.get_non_tensor_data(mb, "local_cp_size", None)) for mb in theirs)
            except (AssertionError, IndexError, RuntimeError) as failed:  # upstream's failure, the same on every rank
                theirs, runs = None, False
                where += f" (verl raised {type(failed).__name__})"
            runs = _all_ranks(runs, group)
            ours = DynamicCPScheduler(MAX_SEQLEN, dp, cp).schedule(batch, group, tp_size=1)
            plan = DynamicCPScheduler(MAX_SEQLEN, dp, cp).planner(group, tp_size=1).plan(lengths, cache=True)  # the cached plan
            if runs:
                assert plan.substitution is None, f"{where}: {plan.substitution}"
                assert_same_micro_batches(ours, theirs, where)
                same += 1
            else:
                assert plan.substitution is not None and plan.scheduler.value == "static_packing", where
                assert all(built(tu.get_non_tensor_data(mb, "local_cp_size", None)) for mb in ours), where
                substituted += 1
            _assert_outputs_restored(ours, batch, group, where)
        assert same >= 3 and substituted >= 1, (same, substituted)
    dist.destroy_process_group()


@pytest.mark.slow
def test_dpxcp_6_equals_verls_own_where_it_runs_and_serves_the_substitute_where_it_would_fail(tmp_path, planner, monkeypatch):
    _use_service(monkeypatch, planner.address, tmp_path)
    run_ranks(_dp3_cp2_rank, (6, str(tmp_path / "store")), 6, DEADLINE)
