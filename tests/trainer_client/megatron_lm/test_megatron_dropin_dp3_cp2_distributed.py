"""Dynamic CP on a DPxCP that is not a power of two, end to end: 6 gloo ranks (DP3 x CP2) through the
Megatron-LM drop-in (`wrap_data_iterator`, `default_dynamic_cp`), Megatron-Core's parallel_state
initialised with its dynamic-CP groups, and a real planner on loopback.

Four steps: three whose batches Megatron-Core's dynamic-CP scheduler plans validly, and one chosen
(by planning candidate batches in this process) so that upstream's plan is not valid on 6 ranks.
The three get upstream's dynamic-CP plans, the fourth the named substitute; every sample of every
step is trained exactly once (each rank receives exactly its groups' tokens, bitwise); every CP
group handed to the model (`local_cp_size` of each packed micro-batch) is a process group
parallel_state built, over the ranks the plan gives it. (Planted once: a server that serves
upstream's plan unchecked hands the model a CP4 group on ranks 0-3 at the fourth step, and this
test fails there, naming it.)
"""

from __future__ import annotations

import random
import warnings

import torch
import torch.distributed as dist

from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from tests.support.dropin_support import MAX_SEQLEN_PER_RANK, megatron_config, packed_sample
from tests.support.megatron_builds import require_scheduler
from tests.support.megatron_init import initialize_dpxcp_groups, is_dynamic_build
from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

DP, CP = 3, 2
ITEMS = 2  # num_microbatches: packed samples each DP rank reads per step
VALID_STEPS = 3


def _step_lengths(seed: int) -> list[list[list[int]]]:
    """[dp_rank][item] -> the sub-sample lengths of that packed sample (all within one CP2 group's
    budget, so both dynamic CP and its substitute can hold every one)."""
    rng = random.Random(f"dp3-cp2:{seed}")
    return [[[rng.randint(16, 2 * MAX_SEQLEN_PER_RANK) for _ in range(rng.randint(1, 3))] for _ in range(ITEMS)] for _ in range(DP)]


def _global_lengths(seed: int) -> tuple[int, ...]:
    return tuple(n for per_rank in _step_lengths(seed) for item in per_rank for n in item)


def _request(seed: int) -> PlanRequest:
    return PlanRequest.of(_global_lengths(seed), DP, CP, MAX_SEQLEN_PER_RANK, scheduler=SchedulerKind.DYNAMIC_CP)


def _choose_seeds() -> tuple[list[int], str]:
    """Three seeds whose batches get upstream's own plan, then one that gets the substitute."""
    valid, failing, reason = [], None, ""
    for seed in range(500):
        substitution = plan_batch(_request(seed)).substitution
        if substitution is None and len(valid) < VALID_STEPS:
            valid.append(seed)
        elif substitution is not None and failing is None:
            failing, reason = seed, substitution.reason.value
        if len(valid) == VALID_STEPS and failing is not None:
            return [*valid, failing], reason
    raise AssertionError("no batch of the first 500 made upstream fail on DP3 x CP2")


def _oracle(step: int, seed: int) -> list[torch.Tensor]:
    """Every sub-sample's tokens, in Megatron-Core's global id order (DP rank, then position)."""
    out = []
    for dp_rank, per_rank in enumerate(_step_lengths(seed)):
        for index, lengths in enumerate(per_rank):
            sample = packed_sample(step, dp_rank, index, lengths)
            cu = sample["cu_seqlens"].tolist()
            out += [sample["tokens"][a:b] for a, b in zip(cu, cu[1:])]
    return out


def _rank(rank: int, store_path: str, endpoint: str, out_dir: str, seeds: list[int]) -> None:
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state

    from trainer_client.plans.megatron import DataGroups
    from trainer_client.megatron_lm import closing_wrapped, last_planned_step, wrap_data_iterator

    init_gloo(rank, DP * CP, store_path)
    initialize_dpxcp_groups(CP)
    groups = DataGroups.of()
    dp_rank = parallel_state.get_data_parallel_rank()
    me = groups.dp_cp.rank()
    dp_cp_ranks = dist.get_process_group_ranks(groups.dp_cp)
    data = iter([
        packed_sample(step, dp_rank, index, lengths)
        for step, seed in enumerate(seeds) for index, lengths in enumerate(_step_lengths(seed)[dp_rank])
    ])
    config = megatron_config(sequence_packing_scheduler="default_dynamic_cp")
    planner = {"planner_endpoint": endpoint, "tls": False, "deadline_seconds": 30.0}
    steps = []
    with closing_wrapped():
        for step, seed in enumerate(seeds):
            iterator, count, _, _ = wrap_data_iterator(data, config, ITEMS, planner=planner)
            planned = last_planned_step(data)
            oracle = _oracle(step, seed)
            micro_batches = []
            for index in range(count):
                packed = next(iterator)
                ids = planned.sample_id_groups[index][me]
                group_ranks = [r for r, held in enumerate(planned.sample_id_groups[index]) if ids[0] in held]
                local_cp = int(packed["local_cp_size"])
                try:
                    built = dist.get_process_group_ranks(parallel_state.get_dynamic_data_context_parallel_groups(group_size=local_cp))
                except KeyError:
                    built = None  # parallel_state has no group of this size
                micro_batches.append({
                    "ids": list(ids),
                    "group": [dp_cp_ranks[r] for r in group_ranks],
                    "local_cp_size": local_cp,
                    "built_group": built,
                    "tokens_exact": torch.equal(packed["tokens"].reshape(-1), torch.cat([oracle[i] for i in ids])),
                })
            substitution = planned.plan.substitution
            steps.append({
                "source": planned.source,
                "scheduler": planned.plan.scheduler.value,
                "substitution": None if substitution is None else substitution.reason.value,
                "samples": len(oracle),
                "micro_batches": micro_batches,
            })
    write_rank_result(out_dir, rank, {"dp_cp_rank": me, "steps": steps})
    dist.barrier()
    dist.destroy_process_group()


def test_six_ranks_dp3_cp2_dynamic_cp_plans_and_one_substitute_every_sample_once_every_group_built(tmp_path, planner):
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    assert is_dynamic_build()
    seeds, reason = _choose_seeds()
    run_ranks(_rank, (str(tmp_path / "store"), planner.address, str(tmp_path), seeds), DP * CP, deadline_seconds=300)
    results = read_rank_results(tmp_path, DP * CP)

    for step in range(len(seeds)):
        views = [r["steps"][step] for r in results]
        first = next(r["steps"][step] for r in results if r["dp_cp_rank"] == 0)
        assert first["source"] == "service", (step, first["source"])  # it asks; the others receive its answer
        # Every sample trained once: each micro-batch's CP groups (the ranks holding the same ids)
        # hold disjoint samples whose union is the batch, and every rank got its groups' tokens.
        trained: list[int] = []
        count = len(views[0]["micro_batches"])
        for index in range(count):
            groups = {tuple(v["micro_batches"][index]["group"]): v["micro_batches"][index]["ids"] for v in views}
            for ranks, ids in groups.items():
                assert all(views[r]["micro_batches"][index]["ids"] == ids for r in ranks), (step, index, ranks)
                trained += ids
        assert sorted(trained) == list(range(views[0]["samples"])), (step, sorted(trained))
        for v in views:
            for mb in v["micro_batches"]:
                assert mb["tokens_exact"], (step, mb)
                # The group handed to the model exists in parallel_state, over the plan's ranks.
                assert mb["local_cp_size"] == len(mb["group"]), (step, mb)
                assert mb["built_group"] == mb["group"], (step, mb)
        expected = (None, "dynamic_cp") if step < VALID_STEPS else (reason, "static_packing")
        assert {(v["substitution"], v["scheduler"]) for v in views} == {expected}, step
    sizes = {mb["local_cp_size"] for r in results for s in r["steps"][:VALID_STEPS] for mb in s["micro_batches"]}
    assert sizes - {1}, f"the dynamic-CP steps used no CP size above 1: {sizes}"
