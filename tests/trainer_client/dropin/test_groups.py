"""The seam's `dpxcp_groups` (trainer_client/dropin/groups.py) on 4 real gloo ranks: for CP 1, 2 and 4,
each rank's DPxCP, DP and CP groups are the ranks Megatron-Core's order gives them, and each group
really joins those ranks (an all-reduce of the ranks' ids over it); a CP size that does not divide
the world is refused on every rank before any group is made, and a CP group of a size the world
has none of is refused by name."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

WORLD = 4


def _members(group) -> list[int]:
    """The ranks an all-reduce over `group` reaches, each rank adding its bit."""
    bits = torch.tensor([1 << dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(bits, group=group)
    return [r for r in range(WORLD) if int(bits) >> r & 1]


def _rank(rank: int, store_path: str, out: str) -> None:
    from trainer_client.dropin import dpxcp_groups

    init_gloo(rank, WORLD, store_path)
    record: dict = {}
    for cp in (1, 2, 4):
        groups, cp_group_for = dpxcp_groups(cp)
        record[cp] = {
            "dp_cp": dist.get_process_group_ranks(groups.dp_cp), "dp": dist.get_process_group_ranks(groups.dp),
            "dp_reached": _members(groups.dp), "tp_pp": [groups.tp, groups.pp],
            "cp": {size: dist.get_process_group_ranks(cp_group_for(size)) for size in (1, 2, 4)},
            "cp_reached": {size: _members(cp_group_for(size)) for size in (1, 2, 4)},
        }
        try:
            cp_group_for(3)
            record[cp]["size 3"] = "no error"
        except Exception as error:  # noqa: BLE001 - the test records what each rank raised
            record[cp]["size 3"] = f"{type(error).__name__}: {error}"
    refused = []
    for bad in (3, 0, -2, 8, 2.0, True):
        try:
            dpxcp_groups(bad)
            refused.append("no error")
        except Exception as error:  # noqa: BLE001
            refused.append(f"{type(error).__name__}: {error}")
    record["refused"] = refused
    # The world still works after the refusals: no rank was left inside a collective.
    record["after"] = _members(dist.group.WORLD)
    write_rank_result(out, rank, record)
    dist.destroy_process_group()


def test_each_rank_gets_the_groups_of_megatrons_order(tmp_path):
    run_ranks(_rank, (str(tmp_path / "store"), str(tmp_path)), WORLD, 120)
    records = read_rank_results(tmp_path, WORLD)
    for rank, record in enumerate(records):
        for cp in (1, 2, 4):
            got = record[str(cp)]
            dp = list(range(rank % cp, WORLD, cp))  # the ranks of this CP position: one per DP rank
            assert got["dp_cp"] == list(range(WORLD)), (rank, cp, got)
            assert got["dp"] == dp and got["dp_reached"] == dp, (rank, cp, got)
            assert got["tp_pp"] == [None, None]
            for size in (1, 2, 4):
                block = list(range(rank - rank % size, rank - rank % size + size))  # the aligned block holding this rank
                assert got["cp"][str(size)] == block and got["cp_reached"][str(size)] == block, (rank, cp, size, got)
            assert got["size 3"] == "ProcessGroupError: no CP group of size 3 in a DPxCP world of 4 ranks; its sizes: [1, 2, 4]"
        assert record["after"] == list(range(WORLD))
        allowed = "is not allowed; allowed: a divisor of the world size 4 (DP = world / CP)"
        assert record["refused"] == [f"InvalidArgumentError: cp_size: {bad} {allowed}" for bad in ("3", "0", "-2", "8", "2.0", "True")], record["refused"]
