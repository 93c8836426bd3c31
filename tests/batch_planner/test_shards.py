"""Shard geometry by hand: which rows of a unit's padded sequences each CP rank holds, for zigzag
(per sequence) and contiguous (one interval of the unit's whole padded buffer), and what the trainer
client builds from it for a packed unit."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from batch_planner.plan import CpGroup, MicroBatch, Plan
from batch_planner.request import CapacityBound, CpLayout, SchedulerKind
from batch_planner.shards import ShardRange, unit_shard
from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.token_outputs import restore_token_outputs, token_pieces

Z, C = CpLayout.ZIGZAG, CpLayout.CONTIGUOUS

# (lengths, cp, tp, layout, {rank: [(sequence index, start, stop), ...]}), worked out by hand.
CASES = [
    # Both layouts pad to multiples of tp * 2c (Megatron-Core converts contiguous input to zigzag).
    # padded [8, 4] = 12 rows, 6 per rank: rank 1 holds the tail of sequence 0 and all of 1.
    ((5, 3), 2, 1, C, {0: [(0, 0, 6)], 1: [(0, 6, 8), (1, 0, 4)]}),
    # padded [8, 8, 8] = 24, 6 per rank: intervals that cross sequence boundaries.
    ((7, 1, 4), 4, 1, C, {0: [(0, 0, 6)], 1: [(0, 6, 8), (1, 0, 4)], 2: [(1, 4, 8), (2, 0, 2)], 3: [(2, 2, 8)]}),
    # TP 2 pads to multiples of tp * 2c = 8: [8, 8] = 16, 8 per rank.
    ((5, 3), 2, 2, C, {0: [(0, 0, 8)], 1: [(1, 0, 8)]}),
    # padded [4, 4, 12] = 20, 10 per rank: a rank may hold three pieces, or none of a sequence.
    ((3, 4, 11), 2, 1, C, {0: [(0, 0, 4), (1, 0, 4), (2, 0, 2)], 1: [(2, 2, 12)]}),
    # One sequence: contiguous is c equal chunks of it (padded 10 -> 12).
    ((10,), 2, 1, C, {0: [(0, 0, 6)], 1: [(0, 6, 12)]}),
    # zigzag pads to tp * 2c = 4: [8, 4]; chunks of 2 and 1; rank r takes r and 3 - r of each.
    ((5, 3), 2, 1, Z, {0: [(0, 0, 2), (0, 6, 8), (1, 0, 1), (1, 3, 4)], 1: [(0, 2, 6), (1, 1, 3)]}),
    # zigzag over 4 ranks, one sequence of 16: chunks of 2; the middle ranks' chunks do not touch.
    ((16,), 4, 1, Z, {0: [(0, 0, 2), (0, 14, 16)], 1: [(0, 2, 4), (0, 12, 14)], 3: [(0, 6, 10)]}),
    # CP1: the whole padded sequences (TP 2 pads 3 -> 4).
    ((3, 2), 1, 2, C, {0: [(0, 0, 4), (1, 0, 2)]}),
]


@pytest.mark.parametrize("lengths,cp,tp,layout,expected", CASES)
def test_unit_shard_by_hand(lengths, cp, tp, layout, expected):
    for rank, ranges in expected.items():
        assert unit_shard(lengths, cp, rank, tp, layout) == [ShardRange(*r) for r in ranges], rank


@pytest.mark.parametrize("lengths,cp,tp,layout,expected", CASES)
def test_every_padded_row_is_held_once_and_shards_are_equal(lengths, cp, tp, layout, expected):
    shards = [unit_shard(lengths, cp, rank, tp, layout) for rank in range(cp)]
    sizes = {sum(r.stop - r.start for r in ranges) for ranges in shards}
    assert len(sizes) == 1 and sizes.pop() % tp == 0  # equal shards, sequence-parallel divisible
    held = sorted((r.index, row) for ranges in shards for r in ranges for row in range(r.start, r.stop))
    assert len(held) == len(set(held))
    for index in range(len(lengths)):
        rows = [row for i, row in held if i == index]
        assert rows == list(range(len(rows))) and len(rows) >= lengths[index]


def _packed_plan(lengths, cp, layout) -> Plan:
    group = CpGroup(0, cp, tuple(range(len(lengths))), sum(lengths), 0)
    return Plan("by-hand", SchedulerKind.DYNAMIC_CP, "DefaultDynamicCPScheduler", "t", cp, 1, layout,
                CapacityBound.PER_RANK_SUM, (MicroBatch((group,)),))


def test_packed_contiguous_unit_tensors_by_hand():
    lengths = (3, 4, 11)  # the fourth case above: padded [4, 4, 12], 10 rows per rank
    batch = TensorDict(
        {"input_ids": torch.nested.nested_tensor([100 * i + torch.arange(n) for i, n in enumerate(lengths)], layout=torch.jagged)},
        batch_size=[3],
    )
    plan = _packed_plan(lengths, 2, C)
    P = -1  # pad token
    expected = {
        0: ([0, 1, 2, P, 100, 101, 102, 103, 200, 201], [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], [True] * 3 + [False] + [True] * 6, (4, 4, 2)),
        1: ([202, 203, 204, 205, 206, 207, 208, 209, 210, P], list(range(2, 12)), [True] * 9 + [False], (0, 0, 10)),
    }
    pieces = []
    for rank, (ids, positions, mask, counts) in expected.items():
        (unit,) = micro_batches_for_rank(plan, batch, rank, pad_token_id=P)
        assert unit.input_ids.tolist() == ids
        assert unit.position_ids.tolist() == positions
        assert unit.padding_mask.tolist() == mask
        assert unit.shard_token_counts == counts and unit.real_local_tokens == sum(mask)
        assert unit.cu_seqlens.tolist() == [0, 3, 7, 18] and unit.cu_seqlens_padded.tolist() == [0, 4, 8, 20]
        params = unit.packed_seq_params
        if hasattr(params, "cp_partition_mode"):  # the dev build's PackedSeqParams
            assert params.cp_partition_mode == "contiguous"
        pieces += token_pieces(unit, unit.input_ids.float())
    restored = restore_token_outputs(pieces, lengths)
    assert [t.long().tolist() for t in restored] == [(100 * i + torch.arange(n)).tolist() for i, n in enumerate(lengths)]


def test_padded_lengths_that_would_leave_rows_to_no_rank_are_refused():
    from batch_planner.shards import padded_unit_shard

    with pytest.raises(ValueError, match="sequence 1 is padded to 6 rows, not a multiple of 2 x CP = 4"):
        padded_unit_shard([8, 6], 2, 0, Z)
    with pytest.raises(ValueError, match="the buffer holds 9 rows, not a multiple of CP = 2"):
        padded_unit_shard([4, 5], 2, 1, C)
