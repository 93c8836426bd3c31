"""Per-sample side data travels with its sample, one process, rank by rank:
a 3-D per-token field and a scalar field land in their sample's micro-batch, padded along the
sequence only; router-replay routes are aligned to the input; per-token outputs of any trailing
shape come back whole and in sample order."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from batch_planner.distributions import sample_lengths
from batch_planner.planner import plan_batch
from batch_planner.request import CpLayout, PlanRequest
from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.batch import unbind_batch
from trainer_client.plans.outputs import OutputRestoreError, order_outputs
from trainer_client.plans.side_data import RouterReplayAlignmentError, align_router_replay, attach_router_replay
from trainer_client.plans.token_outputs import restore_token_outputs, token_pieces
from tests.support.batches import token_batch

LAYERS, TOPK = 3, 2


def _routes(i: int, n: int) -> torch.Tensor:
    # Every entry says where it came from: sample, position, layer, k.
    p = torch.arange(n).view(n, 1, 1)
    layer = torch.arange(LAYERS).view(1, LAYERS, 1)
    k = torch.arange(TOPK).view(1, 1, TOPK)
    return (i * 10_000_000 + p * 100 + layer * 10 + k).to(torch.int64) + 1  # +1: padding (0) is distinguishable


def _batch(lengths) -> TensorDict:
    return token_batch(
        lengths, first=1,
        routes=torch.nested.nested_tensor([_routes(i, n) for i, n in enumerate(lengths)], layout=torch.jagged),
        temperature=0.5 + torch.arange(len(lengths), dtype=torch.float64) / 100,
    )


# (lengths, DP, CP, budget): 4 ranks give CP sizes 1, 2 and 4; 2 ranks CP 1 and 2; 8 ranks up to 8.
CASES = [
    ((3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1), 4, 1, 1024),
    ((2000, 7, 900, 1100, 33, 1500), 2, 1, 1024),
    (sample_lengths("long_tail_16k", 24, seed=3), 4, 2, 4096),
    ((5000, 3000, 2500, 100, 90, 80, 70, 60, 50, 40, 30, 20), 8, 1, 1024),
]


@pytest.mark.parametrize("layout", [CpLayout.ZIGZAG, CpLayout.CONTIGUOUS])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("packed", [False, True])
def test_three_dimensional_token_field_and_scalar_travel_with_their_sample(layout, case, packed):
    lengths, dp, cp, budget = CASES[case]
    tp = 2 if case == 2 else 1
    plan = plan_batch(PlanRequest.of(tuple(lengths), dp, cp, budget, tensor_parallel_size=tp, cp_layout=layout))
    sizes_used = set(plan.sample_cp_sizes().values())
    assert len(sizes_used) > 1, sizes_used  # a dynamic mix, not a static CP size
    batch = unbind_batch(_batch(lengths))
    pieces = []
    for rank in range(plan.dp_cp_size):
        for mb in micro_batches_for_rank(plan, batch, rank, pack_group_samples=packed):
            routes = mb.token_fields["routes"]
            assert routes.shape == (mb.local_tokens, LAYERS, TOPK)  # padded along the sequence only
            sample_of_token = mb.per_token(torch.tensor(mb.sample_ids))[mb.padding_mask]
            position = mb.position_ids[mb.padding_mask]
            # Decode the entries: each real row is its sample's row at its position, all layers and k.
            expected = (sample_of_token * 10_000_000 + position * 100).view(-1, 1, 1) + _routes(0, 1)
            assert torch.equal(routes[mb.padding_mask], expected)
            assert bool((routes[~mb.padding_mask] == 0).all())
            # The scalar field: one row per sample of the unit, in its order.
            temperature = mb.sample_fields["temperature"]
            assert torch.equal(temperature, 0.5 + torch.tensor(mb.sample_ids, dtype=torch.float64) / 100)
            # A per-token output with trailing shape, computed from the shard, comes back whole.
            output = routes.to(torch.float64) * mb.per_token(temperature).view(-1, 1, 1)
            pieces += token_pieces(mb, output)
    restored = restore_token_outputs(pieces, lengths)
    assert len(restored) == len(lengths)
    for i, out in enumerate(restored):
        assert torch.equal(out, _routes(i, lengths[i]).to(torch.float64) * (0.5 + i / 100))


def test_per_sample_outputs_of_any_shape_come_back_in_order():
    shapes = [(), (3,), (2, 5), (7, 1, 2)]
    items = [(i, torch.full(shapes[i % 4], float(i)), (i * 7) % 4) for i in reversed(range(9))]
    ordered = order_outputs(items, 9)
    assert [o.shape for o in ordered] == [torch.Size(shapes[i % 4]) for i in range(9)]
    assert [float(o.flatten()[0]) if o.numel() else float(o) for o in ordered] == [float(i) for i in range(9)]


def test_token_outputs_that_miss_or_repeat_a_token_are_refused():
    lengths = (10, 6)
    plan = plan_batch(PlanRequest.of(lengths, 2, 1, 8))
    batch = unbind_batch(_batch(lengths))
    pieces = [p for r in range(2) for mb in micro_batches_for_rank(plan, batch, r) for p in token_pieces(mb, mb.input_ids)]
    assert [t.tolist() for t in restore_token_outputs(pieces, lengths)] == [list(range(1, 11)), list(range(1, 7))]
    with pytest.raises(OutputRestoreError, match=r"sample 0 cover .* every token must come back exactly once"):
        restore_token_outputs(pieces + [p for p in pieces if p.sample_id == 0][:1], lengths)
    with pytest.raises(OutputRestoreError, match=r"missing for sample ids \[1\]"):
        restore_token_outputs([p for p in pieces if p.sample_id == 0], lengths)
    with pytest.raises(ValueError, match="per-token output has 3 rows"):
        token_pieces(micro_batches_for_rank(plan, batch, 0)[0], torch.zeros(3))


def test_router_replay_routes_get_one_ignored_placeholder_row_and_shard_with_their_sample():
    lengths = (9, 4, 12, 1)
    recorded = [_routes(i, n - 1) for i, n in enumerate(lengths)]  # one row fewer than the input
    recorded[1] = _routes(1, 4)  # already aligned (e.g. recomputed in a forward pass): kept as is
    aligned, valid = align_router_replay(recorded, lengths)
    assert [a.shape[0] for a in aligned] == list(lengths)
    assert torch.equal(aligned[0][:8], recorded[0]) and bool((aligned[0][8] == 0).all())
    assert [v.tolist().count(False) for v in valid] == [1, 0, 1, 1] and not bool(valid[2][-1])
    batch = attach_router_replay(_batch(lengths).exclude("routes"), recorded)
    plan = plan_batch(PlanRequest.of(lengths, 2, 1, 8, cp_layout=CpLayout.ZIGZAG))
    assert 2 in plan.sample_cp_sizes().values()
    seen_invalid = []
    for rank in range(2):
        for mb in micro_batches_for_rank(plan, batch, rank):
            mask = mb.token_fields["routed_experts_valid"]
            assert mask.dtype == torch.bool and mb.token_fields["routed_experts"].shape == (mb.local_tokens, LAYERS, TOPK)
            sample_of_token = mb.per_token(torch.tensor(mb.sample_ids))
            # Ignored rows: exactly the last input token of each sample recorded one row short.
            invalid = mb.padding_mask & ~mask
            seen_invalid += list(zip(sample_of_token[invalid].tolist(), mb.position_ids[invalid].tolist()))
            assert not bool(mask[~mb.padding_mask].any())  # padding is never a valid route
    assert sorted(seen_invalid) == [(0, 8), (2, 11), (3, 0)]


def test_router_replay_length_mismatch_names_the_sample_and_both_lengths():
    with pytest.raises(RouterReplayAlignmentError, match=r"sample 1 has 2 recorded route rows but 5 input tokens; expected 4"):
        align_router_replay([torch.zeros(3, 2), torch.zeros(2, 2)], [4, 5])
    with pytest.raises(RouterReplayAlignmentError, match=r"sample uid-b has 7 recorded route rows but 5 input tokens"):
        align_router_replay([torch.zeros(3, 2), torch.zeros(7, 2)], [4, 5], sample_names=["uid-a", "uid-b"])
    with pytest.raises(RouterReplayAlignmentError, match="1 samples of recorded routes for 2 input samples"):
        align_router_replay([torch.zeros(3, 2)], [4, 5])
