"""The trainer client's micro-batches (trainer_client/plans/apply.py: the planner's padding and shards,
the Bridge drop-in's path) through Transformer Engine's THD/CP attention on a GPU: four ranks on one
GPU (DP2 x CP2, the dev build's dynamic-CP groups), a GPTModel on Megatron-Core's Transformer Engine
layer spec in bf16, one dynamic-CP step with CP1, CP2 and CP4 groups, lengths that are not
multiples of 2 x CP, both layouts (tests/support/client_units_attention.py, which the CPU twin
tests/trainer_client/attention/test_cp_attention_client.py runs on the stand-in). Loss, token losses and gradients equal
whole samples within the bf16 tolerance (tests/trainer_client/transformer_engine/support.py); a shard rotated by
one rank misses it."""

from __future__ import annotations

from functools import partial

import pytest

from tests.support.attention_parity import beyond
from tests.support.attention_ranks import run_attention_ranks
from tests.support.client_units_attention import WORLD, client_units_rank
from tests.trainer_client.transformer_engine.support import DEADLINE_SECONDS, TOLERANCE, record_measurements, require_transformer_engine

pytestmark = [pytest.mark.attention, pytest.mark.timeout(DEADLINE_SECONDS + 60)]


VARIANTS = [("zigzag", "none"), ("contiguous", "none"), ("zigzag", "rotated")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every variant's records, by "layout-plant", in rank order (one run of the ranks)."""
    require_transformer_engine()
    per_rank = run_attention_ranks(partial(client_units_rank, "transformer-engine", VARIANTS), WORLD, tmp_path_factory.mktemp("ranks"),
                                   DEADLINE_SECONDS, on_gpu=True)
    record_measurements("client_units", per_rank)
    assert all("raised" not in r for r in per_rank), per_rank
    return {f"{layout}-{plant}": [r[f"{layout}-{plant}"] for r in per_rank] for layout, plant in VARIANTS}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_client_units_through_transformer_engine_train_as_whole_samples(runs, layout):
    per_rank = runs[f"{layout}-none"]
    assert {size for r in per_rank for size in r["cp_sizes"]} == {1, 2, 4}, per_rank
    assert sum(r["padded_in_groups"] for r in per_rank) > 0, per_rank
    for rank, r in enumerate(per_rank):
        assert beyond(r["worst"], TOLERANCE) == [], (layout, rank, r)


def test_a_shard_rotated_by_one_rank_misses_the_tolerance(runs):
    assert all(beyond(r["worst"], TOLERANCE) for r in runs["zigzag-rotated"]), runs["zigzag-rotated"]
