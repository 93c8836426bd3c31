"""The Megatron-LM drop-in on real gloo processes, Megatron-Core's parallel_state and a real planner
on loopback: each DP rank's iterator yields different packed samples; every rank receives exactly
the tokens of its samples (bitwise) in the structure Megatron-Core's consumers read; the schedule is
the one Megatron-Core's own scheduler computes in-process for the same global lengths; a step
planned in-process (planner stopped) has the same structure; bad input stops every rank at the
same step with one clear error."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.dropin_support import MAX_SEQLEN_PER_RANK, global_subsamples, local_packed_batch, megatron_config
from tests.support.launch import fork_or_spawn, init_gloo, read_rank_results, run_ranks, write_rank_result

STEPS = 3
# Static packing splits every sample over the static CP group only (max_seqlen x CP = 2,048 tokens
# here), so it plans the same batches with a larger per-rank budget than the dynamic schedulers.
MAX_SEQLEN = {"default_dynamic_cp": MAX_SEQLEN_PER_RANK, "dp_balanced": 2 * MAX_SEQLEN_PER_RANK}
PACKING_ITEMS = 2  # num_microbatches: packed samples each DP rank reads per step


def _init(rank: int, world: int, store_path: str, tp: int, cp: int) -> None:
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state

    init_gloo(rank, world, store_path)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)


def _groups():
    from trainer_client.plans.megatron import DataGroups

    return DataGroups.of()


def _planner(endpoint: str) -> dict:
    return {"planner_endpoint": endpoint, "tls": False, "deadline_seconds": 20.0, "fallback_cooldown_seconds": 0.0}


def _hybrid_iterator(dp_rank: int, steps: int = STEPS):
    return iter([local_packed_batch(step, dp_rank) for step in range(steps)])


def _packing_iterator(dp_rank: int, steps: int = STEPS):
    return iter([sample for step in range(steps) for sample in local_packed_batch(step, dp_rank, PACKING_ITEMS)[:PACKING_ITEMS]])


def _packing_global(step: int, dp_size: int) -> list[dict]:
    """The oracle for the packing path: the first PACKING_ITEMS packed samples of each DP rank."""
    out = []
    for dp_rank in range(dp_size):
        for sample in local_packed_batch(step, dp_rank, PACKING_ITEMS)[:PACKING_ITEMS]:
            cu = sample["cu_seqlens"].tolist()
            out += [{k: v[a:b] for k, v in sample.items() if k != "cu_seqlens"} for a, b in zip(cu, cu[1:]) if b > a]
    return out


def _check_hybrid_step(step, samples, id_groups, groups, oracle) -> dict:
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    seqlens = [(i, int(s["tokens"].shape[0])) for i, s in enumerate(oracle)]
    _, expected_groups = BalancedCPScheduler(MAX_SEQLEN_PER_RANK, groups.dp_cp).get_groups_and_subsamples(seqlens, None)
    assert id_groups == expected_groups, f"step {step}: the planner's schedule differs from Megatron-Core's"
    me = groups.dp_cp.rank()
    mine = sorted({i for mb in id_groups for i in mb[me]})
    assert list(samples) == mine, (list(samples), mine)  # exactly its samples, in Megatron-Core's order
    for i in mine:
        assert sorted(samples[i]) == sorted(oracle[i]), (sorted(samples[i]), sorted(oracle[i]))
        for key, value in oracle[i].items():
            assert samples[i][key].dtype == value.dtype and torch.equal(samples[i][key], value), (step, i, key)
    return {"ids": mine, "groups": id_groups, "tokens": sum(int(samples[i]["tokens"].numel()) for i in mine)}


def _run_hybrid(endpoint: str, groups, dp_rank: int) -> list[dict]:
    from trainer_client.megatron_lm import HybridCPDataLoaderWrapper

    seen = []
    with HybridCPDataLoaderWrapper(_hybrid_iterator(dp_rank), megatron_config(), planner=_planner(endpoint)) as wrapper:
        for step, (samples, id_groups) in enumerate(wrapper):
            record = _check_hybrid_step(step, samples, id_groups, groups, global_subsamples(step, groups.dp.size()))
            record.update(source=wrapper.last_step.source, traffic=vars(wrapper.last_step.traffic))
            seen.append(record)
    assert len(seen) == STEPS
    return seen


def _expected_packing_groups(scheduler: str, seqlens, groups):
    from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler, DpBalancedScheduler

    dp, cp = groups.dp.size(), groups.dp_cp.size() // groups.dp.size()
    if scheduler == "default_dynamic_cp":
        return DefaultDynamicCPScheduler(MAX_SEQLEN[scheduler], cp, dp, None, min_cp_size=1).get_groups_and_subsamples(seqlens)
    return DpBalancedScheduler(MAX_SEQLEN[scheduler], cp, dp, None).get_groups_and_subsamples(seqlens)


def _check_packing_step(step, scheduler, result, groups) -> dict:
    from megatron.core.datasets.data_schedule_utils import build_packed_microbatches

    iterator, count, total, squares = result
    oracle = _packing_global(step, groups.dp.size())
    seqlens = [(i, int(s["tokens"].shape[0])) for i, s in enumerate(oracle)]
    expected_groups = _expected_packing_groups(scheduler, seqlens, groups)
    assert count == len(expected_groups)
    assert total == float(sum(n for _, n in seqlens)) and squares == float(sum(n * n for _, n in seqlens))
    # What Megatron-Core's own packing makes of the oracle's samples for this rank's schedule.
    with_lengths = {
        i: {**s, "original_seq_len": torch.tensor([n]), "padded_seq_len": torch.tensor([n])}
        for i, (s, (_, n)) in enumerate(zip(oracle, seqlens))
    }
    expected = build_packed_microbatches(
        with_lengths, expected_groups, groups.dp_cp.rank(), torch.device("cpu"), scheduler == "default_dynamic_cp"
    )
    got = [next(iterator) for _ in range(count)]  # as Megatron-Core's consumer reads it
    assert len(got) == len(expected) == count
    for mb, (g, e) in enumerate(zip(got, expected)):
        assert sorted(g) == sorted(e), (sorted(g), sorted(e))
        for key in e:
            assert torch.equal(torch.as_tensor(g[key]), torch.as_tensor(e[key])), (step, mb, key)
    return {"count": count, "tokens": sum(int(g["tokens"].numel()) for g in got)}


def _run_packing(endpoint: str, groups, dp_rank: int, scheduler: str) -> list[dict]:
    from trainer_client.megatron_lm import closing_wrapped, last_planned_step, wrap_data_iterator

    data = _packing_iterator(dp_rank)
    config = megatron_config(sequence_packing_scheduler=scheduler, max_seqlen_per_dp_cp_rank=MAX_SEQLEN[scheduler])
    seen = []
    with closing_wrapped():
        for step in range(STEPS):
            result = wrap_data_iterator(data, config, PACKING_ITEMS, planner=_planner(endpoint))
            record = _check_packing_step(step, scheduler, result, groups)
            record.update(source=last_planned_step(data).source)
            seen.append(record)
    return seen


def _bad_inputs(endpoint: str, groups, dp_rank: int) -> dict:
    from trainer_client.megatron_lm import HybridCPDataLoaderWrapper

    def wrapper(batches):
        return HybridCPDataLoaderWrapper(iter(batches), megatron_config(), planner=_planner(endpoint))

    good = [local_packed_batch(0, dp_rank)]
    broken = [dict(s) for s in local_packed_batch(1, dp_rank)]
    if dp_rank == 1:
        broken[0]["cu_seqlens"] = torch.tensor([0, 40, 20, int(broken[0]["tokens"].numel())], dtype=torch.int32)
    empty = [] if dp_rank == 0 else local_packed_batch(0, dp_rank)
    too_long = [dict(s) for s in local_packed_batch(1, dp_rank)]
    if dp_rank == 0:
        limit = MAX_SEQLEN_PER_RANK * groups.dp_cp.size()
        too_long.append(_long_sample(limit + 1))
    cases = {"cu_seqlens": good + [broken], "empty": [empty], "too_long": good + [too_long],
             "loader": _loader_failing_on_dp_rank_1(good + [local_packed_batch(1, dp_rank)], dp_rank)}
    return {name: _first_error(wrapper(batches)) for name, batches in cases.items()}


def _loader_failing_on_dp_rank_1(batches: list, dp_rank: int):
    """The batches, but on DP rank 1 the data iterator itself raises when asked for the second."""
    yield batches[0]
    if dp_rank == 1:
        raise OSError("the data loader's worker died")
    yield from batches[1:]


def _long_sample(length: int) -> dict:
    tokens = torch.arange(length, dtype=torch.int64)
    return {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(length), "position_ids": tokens,
            "cu_seqlens": torch.tensor([0, length], dtype=torch.int32)}


def _first_error(wrapper) -> dict:
    step = 0
    with wrapper:
        try:
            while True:
                next(wrapper)
                step += 1
        except StopIteration:
            return {"step": None, "type": None, "message": "no error"}
        except Exception as error:  # noqa: BLE001 - the type is what is checked
            return {"step": step, "type": type(error).__name__, "message": str(error)}


def _rank(rank, world, store_path, endpoint, out_dir, tp, cp, stop_requested, stopped, full) -> None:
    _init(rank, world, store_path, tp, cp)
    from megatron.core import parallel_state

    groups = _groups()
    dp_rank = parallel_state.get_data_parallel_rank()
    result: dict = {"tp_rank": groups.tp.rank(), "dp_rank": dp_rank}
    if groups.tp.rank() != 0:
        result["tp_rank_nonzero"] = _non_first_tp_rank()
    else:
        result["hybrid"] = _run_hybrid(endpoint, groups, dp_rank)
        result["dynamic_cp"] = _run_packing(endpoint, groups, dp_rank, "default_dynamic_cp")
        if full:
            result["static_packing"] = _run_packing(endpoint, groups, dp_rank, "dp_balanced")
            result["bad"] = _bad_inputs(endpoint, groups, dp_rank)
    if full:
        dist.barrier()
        if rank == 0:
            stop_requested.set()
        stopped.wait(120)
        if groups.tp.rank() == 0:
            result["hybrid_fallback"] = _run_hybrid(endpoint, groups, dp_rank)
    write_rank_result(out_dir, rank, result)
    dist.barrier()
    dist.destroy_process_group()


def _non_first_tp_rank() -> dict:
    """TP ranks > 0 have no data iterator in Megatron-LM; they take part in the TP broadcasts only."""
    from trainer_client.megatron_lm import HybridCPDataLoaderWrapper, wrap_data_iterator

    wrapper = HybridCPDataLoaderWrapper(None, megatron_config())
    hybrid = [list(next(wrapper)) for _ in range(STEPS)]
    config = megatron_config(sequence_packing_scheduler="default_dynamic_cp")
    packing = [wrap_data_iterator(None, config, PACKING_ITEMS) for _ in range(STEPS)]
    return {"hybrid": hybrid, "packing": [[r[0], r[1], r[2], r[3]] for r in packing]}


def _run(world: int, tp: int, cp: int, tmp_path, planner, full: bool) -> list[dict]:
    ctx = mp.get_context(fork_or_spawn())
    stop_requested, stopped = ctx.Event(), ctx.Event()

    def stop_the_planner() -> None:  # every rank has planned with it: the rest is planned in process
        planner.stop()
        stopped.set()

    args = (world, str(tmp_path / "store"), planner.address, str(tmp_path), tp, cp, stop_requested, stopped, full)
    run_ranks(_rank, args, world, deadline_seconds=1200, on_event=(stop_requested, stop_the_planner))
    return read_rank_results(tmp_path, world)


@pytest.fixture()
def stoppable_planner():
    """A planner of this test's own (1 worker), not the session's `planner`: the four-rank test
    stops it mid-run to check the in-process fallback."""
    from tests.support.planner_process import start_planner

    server = start_planner(workers=1)
    yield server
    server.stop()


def _check_common(results: list[dict]) -> None:
    lanes = [r for r in results if r["tp_rank"] == 0]
    for name in ("hybrid", "dynamic_cp"):
        # Rank 0 of the DPxCP group asked the service for every step.
        assert [s["source"] for s in lanes[0][name]] == ["service"] * STEPS
    for r in lanes:
        for s in r["hybrid"]:
            assert s["traffic"]["received_bytes"] < s["traffic"]["global_batch_bytes"]


def test_four_ranks_dp2_cp2_hybrid_and_packing_with_fallback_and_bad_input(tmp_path, stoppable_planner):
    results = _run(4, 1, 2, tmp_path, stoppable_planner, full=True)
    _check_common(results)
    first = results[0]
    assert [s["source"] for s in first["hybrid_fallback"]] == ["fallback"] * STEPS
    for r in results:
        # Planned in-process with the planner stopped: the same schedule, the same samples.
        assert [(s["ids"], s["groups"]) for s in r["hybrid_fallback"]] == [(s["ids"], s["groups"]) for s in r["hybrid"]]
    bad = [r["bad"] for r in results]
    for case, step, error_type, phrase in (
        ("cu_seqlens", 1, "DropInInputError", "cu_seqlens decreases"),
        ("empty", 0, "DropInInputError", "local batch is empty"),
        ("too_long", 1, "PlanRejectedError", str(MAX_SEQLEN_PER_RANK * 4 + 1)),
        # The iterator's own error on one rank (read one step ahead): every rank stops, none waits.
        ("loader", 1, "DropInInputError", "the data iterator raised OSError: the data loader's worker died"),
    ):
        got = {(b[case]["step"], b[case]["type"], b[case]["message"]) for b in bad}
        assert len(got) == 1, (case, got)  # every rank: the same step, the same error
        (got_step, got_type, message), = got
        assert (got_step, got_type) == (step, error_type), (case, got)
        assert phrase in message, (case, message)


def test_eight_ranks_dp4_cp2_hybrid_and_dynamic_cp(tmp_path, planner):
    _check_common(_run(8, 1, 2, tmp_path, planner, full=False))


def test_eight_ranks_tp2_dp2_cp2_other_tp_ranks_get_what_megatron_core_gives(tmp_path, planner):
    results = _run(8, 2, 2, tmp_path, planner, full=False)
    _check_common(results)
    others = [r for r in results if r["tp_rank"] != 0]
    assert len(others) == 4
    for r in others:
        got = r["tp_rank_nonzero"]
        assert got["hybrid"] == [[None, None]] * STEPS  # what Megatron-Core's wrapper yields there
        # No iterator, and the micro-batch count and FLOPs sums of TP rank 0 (broadcast in the TP group).
        lane = next(x for x in results if x["tp_rank"] == 0 and x["dp_rank"] == r["dp_rank"])
        assert [p[0] for p in got["packing"]] == [None] * STEPS
        assert [p[1] for p in got["packing"]] == [s["count"] for s in lane["dynamic_cp"]]
