"""A planned step as execution units (trainer_client/dropin/units.py) on 4 real gloo ranks (DP2 x CP2,
the seam's `dpxcp_groups`, its `StepPlanner` planning in-process with dynamic CP): `rank_units` gives
each rank one packed unit per micro-batch, whose CP group is the process group of its ranks; every
real token of the global batch is in exactly one rank's units, each exactly where the unit's
cu_seqlens say; `packed_seq_params_on` moves the unit's cu_seqlens, q and kv sharing one copy, and
leaves the unit as it was."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

WORLD, CP = 4, 2
MAX_SEQLEN_PER_RANK = 64
# Each DP rank's samples: long ones that need a CP group of 2 or 4, short ones that share a rank.
LENGTHS = {0: [5, 120, 17, 33], 1: [200, 3, 11, 64, 9]}


def _samples(dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Token i of the global batch holds i + 1 (0 is the padding the plan adds)."""
    start = sum(sum(LENGTHS[d]) for d in range(dp_rank))
    samples = []
    for length in LENGTHS[dp_rank]:
        ids = torch.arange(start, start + length) + 1
        samples.append({"tokens": ids, "labels": ids * 10, "loss_mask": torch.ones(length)})
        start += length
    return samples


def _rank(rank: int, store_path: str, out: str) -> None:
    from trainer_client.dropin import (
        DerivedSettings, LocalBatch, StepPlanner, dpxcp_groups, packed_seq_params_on, planner_config, rank_units,
    )

    init_gloo(rank, WORLD, store_path)
    groups, cp_group_for = dpxcp_groups(CP)
    derived = DerivedSettings(MAX_SEQLEN_PER_RANK, CP, 1, scheduler="dynamic_cp", padding="megatron_core", cp_layout="zigzag")
    steps = iter([_samples(groups.dp.rank())])
    planner = StepPlanner.start(lambda: LocalBatch.of(next(steps)), groups, planner_config({}, derived, "the test's loop"))
    try:
        step = planner.next_step()
    finally:
        planner.close()
    units = rank_units(step, groups.dp_cp.rank(), cp_group_for)
    record: dict = {"micro_batches": len(step.plan.micro_batches), "units": []}
    for unit in units:
        params = unit.packed_seq_params
        moved = packed_seq_params_on(unit, torch.device("meta"))
        tokens = unit.token_fields["tokens"]
        cu = unit.cu_seqlens_padded.tolist()
        record["units"].append({
            "micro_batch": unit.micro_batch_index, "samples": list(unit.sample_ids), "cp_size": unit.local_cp_size,
            "cp_group_ranks": list(unit.cp_group_ranks),
            "process_group_ranks": dist.get_process_group_ranks(params.cp_group) if params.cp_group is not None else None,
            "tokens": [int(t) for t in tokens[unit.padding_mask]],
            "padding_is_zero": bool((tokens[~unit.padding_mask] == 0).all()),
            "labels_follow": bool((unit.token_fields["labels"] == tokens * 10).all()),
            "shard_rows": int(tokens.shape[0]), "cu_padded_total": cu[-1], "cp": unit.local_cp_size,
            "moved_device": [getattr(moved, n).device.type for n in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")],
            "q_kv_shared": [params.cu_seqlens_q is params.cu_seqlens_kv, moved.cu_seqlens_q is moved.cu_seqlens_kv],
            "q_kv_padded_shared": [params.cu_seqlens_q_padded is params.cu_seqlens_kv_padded,
                                   moved.cu_seqlens_q_padded is moved.cu_seqlens_kv_padded],
            "rest_kept": moved.cp_group is params.cp_group and moved.max_seqlen_q == params.max_seqlen_q and moved.qkv_format == params.qkv_format,
            "unit_left_alone": unit.packed_seq_params is params and params.cu_seqlens_q.device.type == "cpu",
        })
    try:
        rank_units(step, WORLD, cp_group_for)
        record["outside"] = "no error"
    except Exception as error:  # noqa: BLE001 - the test records what each rank raised
        record["outside"] = f"{type(error).__name__}: {error}"
    write_rank_result(out, rank, record)
    dist.destroy_process_group()


def test_every_real_token_is_in_one_ranks_units_with_the_cp_group_of_its_ranks(tmp_path):
    run_ranks(_rank, (str(tmp_path / "store"), str(tmp_path)), WORLD, 180)
    records = read_rank_results(tmp_path, WORLD)
    total = sum(sum(lengths) for lengths in LENGTHS.values())
    trained: list[int] = []
    sizes = set()
    for rank, record in enumerate(records):
        assert [u["micro_batch"] for u in record["units"]] == list(range(record["micro_batches"])), (rank, record)
        for unit in record["units"]:
            sizes.add(unit["cp_size"])
            assert rank in unit["cp_group_ranks"] and len(unit["cp_group_ranks"]) == unit["cp_size"], (rank, unit)
            assert unit["process_group_ranks"] == unit["cp_group_ranks"], (rank, unit)
            assert unit["padding_is_zero"] and unit["labels_follow"], (rank, unit)
            assert unit["shard_rows"] * unit["cp"] == unit["cu_padded_total"], (rank, unit)  # each rank holds 1/CP of the padded tokens
            assert unit["moved_device"] == ["meta"] * 4, (rank, unit)
            assert unit["q_kv_shared"] == unit["q_kv_padded_shared"] == [True, True], (rank, unit)  # one copy each
            assert unit["rest_kept"] and unit["unit_left_alone"], (rank, unit)
            # CP ranks of one group split a sample's tokens between them: the group's share is counted once.
            trained += unit["tokens"]
        assert record["outside"] == "InvalidArgumentError: rank 4 is outside the plan's DPxCP group of 4 ranks", record["outside"]
    assert sorted(trained) == list(range(1, total + 1)), "a real token is in no unit or in two"
    assert max(sizes) > 1 and min(sizes) == 1, f"the plan has no CP groups of different sizes: {sizes}"
