"""The trainer client's micro-batches (trainer_client/plans/apply.py) through the attention model with the
CPU stand-in for Transformer Engine's THD/CP attention, on four gloo ranks (tests/support/client_units_attention.py):
every layout, lengths that are not multiples of 2 x CP, padding in every CP group. The step's loss,
every real token's loss and every gradient equal whole samples run alone; a shard rotated by one
rank of its CP group is caught. tests/trainer_client/transformer_engine/test_te_client_units.py runs the same
body through Transformer Engine on a GPU."""

from __future__ import annotations

from functools import partial

import pytest

from tests.support.attention_parity import beyond
from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks
from tests.support.client_units_attention import WORLD, client_units_rank

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

TOLERANCE = 1e-4  # fp32 on the CPU: only the order of additions differs


VARIANTS = [("zigzag", "none"), ("contiguous", "none"), ("zigzag", "rotated")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every variant's records, by "layout-plant", in rank order (one run of the ranks)."""
    require_dynamic_build()
    per_rank = run_attention_ranks(partial(client_units_rank, "cpu-standin", VARIANTS), WORLD, tmp_path_factory.mktemp("ranks"))
    assert all("raised" not in r for r in per_rank), per_rank
    return {f"{layout}-{plant}": [r[f"{layout}-{plant}"] for r in per_rank] for layout, plant in VARIANTS}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_client_units_train_as_whole_samples(runs, layout):
    per_rank = runs[f"{layout}-none"]
    assert {size for r in per_rank for size in r["cp_sizes"]} == {1, 2, 4}, per_rank
    assert sum(r["padded_in_groups"] for r in per_rank) > 0, "no CP group pads: the lengths test nothing"
    for rank, r in enumerate(per_rank):
        assert beyond(r["worst"], TOLERANCE) == [], (layout, rank, r)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_shard_rotated_by_one_rank_is_caught(runs):
    assert all(beyond(r["worst"], TOLERANCE) for r in runs["zigzag-rotated"]), runs["zigzag-rotated"]
