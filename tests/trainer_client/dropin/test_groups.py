"""The seam's `dpxcp_groups` (trainer_client/dropin/groups.py) on 4 real gloo ranks: for CP 1, 2 and 4,
each rank's DPxCP, DP and CP groups are the ranks Megatron-Core's order gives them, and each group
really joins those ranks (an all-reduce of the ranks' ids over it); in worlds with TP and pipeline
stages, every group is the one Megatron-Core's own RankGenerator gives this rank; a size that does
not fit the world is refused on every rank before any group is made, naming the setting, and a CP
group of a size the world has none of is refused by name. `RankLayout` lists the groups in
Megatron-Core's order for every layout of 4 to 24 ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

import itertools

import pytest

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result
from trainer_client.dropin.groups import RankLayout

WORLD = 4
# (TP, CP, PP) worlds of 4 ranks with TP or pipeline stages.
MODEL_PARALLEL = ((2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4), (4, 1, 1))


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
    for tp, cp, pp in MODEL_PARALLEL:
        groups, cp_group_for = dpxcp_groups(cp, tp_size=tp, pp_size=pp)
        named = {"dp_cp": groups.dp_cp, "dp": groups.dp, "tp": groups.tp, "pp": groups.pp}
        record[f"tp{tp}-cp{cp}-pp{pp}"] = {
            "ranks": {name: None if g is None else dist.get_process_group_ranks(g) for name, g in named.items()},
            "reached": {name: None if g is None else _members(g) for name, g in named.items()},
            "cp": {size: _members(cp_group_for(size)) for size in (1, 2, 4) if size <= cp * (WORLD // (tp * cp * pp))},
        }
    refused = []
    for bad in [(3,), (0,), (-2,), (8,), (2.0,), (True,), (4, 2, 1), (1, 3, 1), (1, 1, 3), (2, 2, 2), (1, 0, 1), (1, 1, 2.0)]:
        cp, tp, pp = (*bad, 1, 1)[:3]
        try:
            dpxcp_groups(cp, tp_size=tp, pp_size=pp)
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
            assert got["size 3"] == "ProcessGroupError: no CP group of size 3 in a DPxCP group of 4 ranks; its sizes: [1, 2, 4]"
        assert record["after"] == list(range(WORLD))
        allowed = "is not allowed; allowed: a divisor of the world size 4 (DP = world / CP)"
        assert record["refused"] == [f"InvalidArgumentError: cp_size: {bad} {allowed}" for bad in ("3", "0", "-2", "8", "2.0", "True")] + [
            "InvalidArgumentError: cp_size: 4 is not allowed; allowed: a divisor of world / (TP x PP) = 2 (DP = world / (TP x CP x PP))",
            "InvalidArgumentError: tp_size: 3 is not allowed; allowed: a divisor of the world size 4",
            "InvalidArgumentError: pp_size: 3 is not allowed; allowed: a divisor of the world size 4",
            "InvalidArgumentError: cp_size: 2 is not allowed; allowed: a divisor of world / (TP x PP) = 1 (DP = world / (TP x CP x PP))",
            "InvalidArgumentError: tp_size: 0 is not allowed; allowed: a divisor of the world size 4",
            "InvalidArgumentError: pp_size: 2.0 is not allowed; allowed: a divisor of the world size 4",
        ], record["refused"]
        for tp, cp, pp in MODEL_PARALLEL:
            got, want = record[f"tp{tp}-cp{cp}-pp{pp}"], _megatron_groups(rank, tp, cp, pp)
            assert got["ranks"] == got["reached"] == want, (rank, tp, cp, pp, got, want)
            for size, reached in got["cp"].items():  # aligned blocks of this rank's DPxCP group
                position = want["dp_cp"].index(rank)
                first = position - position % int(size)
                assert reached == sorted(want["dp_cp"][first:first + int(size)]), (rank, tp, cp, pp, size, got)


def _megatron_groups(rank: int, tp: int, cp: int, pp: int) -> dict:
    """This rank's groups as Megatron-Core's own RankGenerator orders them (None: a size of 1, as dpxcp_groups gives)."""
    from megatron.core.parallel_state import RankGenerator

    generator = RankGenerator(tp=tp, ep=1, dp=WORLD // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")

    def mine(token: str) -> list[int]:
        return next(list(ranks) for ranks in generator.get_ranks(token) if rank in ranks)

    return {"dp_cp": mine("dp-cp"), "dp": mine("dp"), "tp": mine("tp") if tp > 1 else None, "pp": mine("pp") if pp > 1 else None}


@pytest.mark.parametrize("world", [4, 8, 12, 16, 24])
def test_the_layout_lists_every_group_as_megatron_core_orders_it(world):
    from megatron.core.parallel_state import RankGenerator

    layouts = [(tp, cp, pp) for tp, cp, pp in itertools.product((1, 2, 3, 4), repeat=3) if world % (tp * cp * pp) == 0]
    assert len(layouts) > 5
    for tp, cp, pp in layouts:
        layout = RankLayout.of(world, cp, tp, pp)
        generator = RankGenerator(tp=tp, ep=1, dp=layout.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        for token, ours in (("dp-cp", layout.dp_cp_groups()), ("dp", layout.dp_groups()), ("tp", layout.tp_groups()),
                            ("pp", layout.pp_groups())):
            assert ours == [list(ranks) for ranks in generator.get_ranks(token)], (world, tp, cp, pp, token)
