"""Applying a plan on one process, rank by rank: shards, padding masks, cu_seqlens, per-sample fields,
output order. (The multi-process version with real process groups is test_client_distributed.py.)"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from batch_planner.padding import padded_length
from batch_planner.planner import plan_batch
from batch_planner.request import CpLayout, PlanRequest
from batch_planner.shards import unit_shard
from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.batch import BatchMismatchError, unbind_batch
from trainer_client.plans.outputs import OutputRestoreError, order_outputs

# With 4 ranks of 1,024 tokens: 3,000 needs CP4, 1,500-1,800 CP2, the rest CP1.
LENGTHS = (3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1)



def shard_positions(length: int, cp_size: int, cp_rank: int, tensor_parallel_size: int, layout: CpLayout) -> list[int]:
    """Positions (in the padded sequence) of the tokens rank `cp_rank` holds of one sequence."""
    return [p for r in unit_shard([length], cp_size, cp_rank, tensor_parallel_size, layout) for p in range(r.start, r.stop)]

def make_batch(lengths, routes=True) -> TensorDict:
    """Token value = sample id * 100,000 + position, so a shard tells where its tokens came from."""
    fields = {
        "input_ids": torch.nested.nested_tensor(
            [i * 100_000 + torch.arange(n) for i, n in enumerate(lengths)], layout=torch.jagged
        ),
        "temperature": torch.arange(len(lengths), dtype=torch.float32) / 10,
    }
    if routes:  # a per-token field with trailing dims [layers, topk], as recorded MoE routes
        fields["routes"] = torch.nested.nested_tensor(
            [torch.full((n, 2, 3), i, dtype=torch.int32) for i, n in enumerate(lengths)], layout=torch.jagged
        )
    return TensorDict(fields, batch_size=[len(lengths)])


@pytest.mark.parametrize("layout", [CpLayout.ZIGZAG, CpLayout.CONTIGUOUS])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_real_token_lands_on_exactly_one_rank(layout, tp):
    request = PlanRequest.of(LENGTHS, 4, 1, 1024, tensor_parallel_size=tp, cp_layout=layout)
    plan = plan_batch(request)
    assert {1, 2, 4} <= set(plan.sample_cp_sizes().values())
    batch = unbind_batch(make_batch(LENGTHS))
    seen: list[tuple[int, int]] = []
    led: list[int] = []
    for rank in range(4):
        for mb in micro_batches_for_rank(plan, batch, rank):
            c = mb.local_cp_size
            assert mb.is_cp_leader == (rank == mb.cp_group_ranks[0]) and len(mb.cp_group_ranks) == c
            padded = [padded_length(n, c, tp, layout) for n in mb.sequence_lengths]
            # Each shard is 1/c of the padded sequence, a multiple of TP (sequence parallel).
            assert mb.local_tokens == sum(padded) // c and mb.local_tokens % tp == 0
            assert mb.real_local_tokens == int(mb.padding_mask.sum())
            assert mb.cu_seqlens.tolist() == [0, *torch.tensor(mb.sequence_lengths).cumsum(0).tolist()]
            assert mb.cu_seqlens_padded.tolist() == [0, *torch.tensor(padded).cumsum(0).tolist()]
            params = mb.packed_seq_params
            assert params.qkv_format == "thd" and params.local_cp_size == c and params.cp_group is None
            assert params.max_seqlen_q == max(padded) and params.cu_seqlens_kv_padded is mb.cu_seqlens_padded
            ids = mb.input_ids[mb.padding_mask]
            sample_of_token = ids // 100_000
            positions = ids % 100_000
            assert torch.equal(positions, mb.position_ids[mb.padding_mask])
            assert bool((mb.input_ids[~mb.padding_mask] == 0).all())  # pad_token_id
            # The 3-D field is sharded like input_ids and padded along the sequence only.
            routes = mb.token_fields["routes"]
            assert routes.shape == (mb.local_tokens, 2, 3)
            assert torch.equal(routes[mb.padding_mask][:, 0, 0].long(), sample_of_token)
            assert torch.equal(mb.sample_fields["temperature"], torch.tensor(mb.sample_ids) / 10)
            seen += list(zip(sample_of_token.tolist(), positions.tolist()))
            if mb.is_cp_leader:
                led += list(mb.sample_ids)
    expected = [(i, p) for i, n in enumerate(LENGTHS) for p in range(n)]
    assert sorted(seen) == expected  # union = the batch's tokens, none twice
    assert sorted(led) == list(range(len(LENGTHS)))


def test_zigzag_takes_chunks_r_and_2c_minus_1_minus_r():
    # 10 tokens on CP2, TP1: padded to 12, chunks of 3: rank 0 gets chunks 0 and 3, rank 1 chunks 1 and 2.
    assert shard_positions(10, 2, 0, 1, CpLayout.ZIGZAG) == [0, 1, 2, 9, 10, 11]
    assert shard_positions(10, 2, 1, 1, CpLayout.ZIGZAG) == [3, 4, 5, 6, 7, 8]
    assert shard_positions(10, 2, 1, 1, CpLayout.CONTIGUOUS) == [6, 7, 8, 9, 10, 11]  # padded to 12 too
    assert shard_positions(5, 1, 0, 2, CpLayout.ZIGZAG) == [0, 1, 2, 3, 4, 5]


def test_hybrid_cp_runs_each_sample_of_a_group_as_its_own_unit_and_packing_packs_them():
    plan = plan_batch(PlanRequest.of(LENGTHS, 4, 1, 1024))
    batch = unbind_batch(make_batch(LENGTHS, routes=False))
    for rank in range(4):
        units = micro_batches_for_rank(plan, batch, rank)
        assert all(len(u.sample_ids) == 1 for u in units)
        per_mb = [len(mb.group_of_rank(rank).sample_ids) for mb in plan.micro_batches]
        assert [u.micro_batch_index for u in units if u.last_of_micro_batch] == list(range(len(per_mb)))
        packed = micro_batches_for_rank(plan, batch, rank, pack_group_samples=True)
        assert [len(u.sample_ids) for u in packed] == per_mb
        assert packed[0].cu_seqlens.numel() == per_mb[0] + 1


def test_batch_that_does_not_match_the_plan_is_refused():
    plan = plan_batch(PlanRequest.of(LENGTHS, 4, 1, 1024))
    with pytest.raises(BatchMismatchError, match="the plan covers 12 samples but the batch holds 11"):
        micro_batches_for_rank(plan, make_batch(LENGTHS[:11]), 0)
    bad = make_batch(LENGTHS, routes=False)
    bad["routes"] = torch.nested.nested_tensor([torch.zeros(n + (i == 3)) for i, n in enumerate(LENGTHS)], layout=torch.jagged)
    with pytest.raises(BatchMismatchError, match="field 'routes' of sample 3 has 701 tokens, its input_ids has 700"):
        micro_batches_for_rank(plan, bad, 0)
    dense = TensorDict({"input_ids": torch.zeros(2, 5)}, batch_size=[2])
    with pytest.raises(BatchMismatchError, match="input_ids must be a jagged NestedTensor"):
        micro_batches_for_rank(plan, dense, 0)


def test_outputs_come_back_in_order_or_the_error_names_the_ids():
    items = [(2, "c", 1), (0, "a", 0), (1, "b", 3)]
    assert order_outputs(items, 3) == ["a", "b", "c"]
    with pytest.raises(OutputRestoreError, match=r"missing sample ids \[1\]"):
        order_outputs([(2, "c", 1), (0, "a", 0)], 3)
    with pytest.raises(OutputRestoreError, match=r"duplicated sample ids \[0\] \(reported by ranks \{0: \[0, 2\]\}\)"):
        order_outputs(items + [(0, "a", 2)], 3)
