"""A step's input as the seam reads it (trainer_client/dropin/step_input.py): `LocalBatch.problem`
refuses a batch the planner could not plan (empty, a sample of length < 1, samples whose fields
disagree) on the trainer side, naming the sample; `agree_on_step` on 4 real gloo ranks (DP2 x CP2,
the seam's `dpxcp_groups`) hands one DP rank's refusal to every rank at that step, and the next step
reads on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result
from trainer_client.dropin import LocalBatch


def _sample(length: int, **extra) -> dict[str, torch.Tensor]:
    return {"tokens": torch.arange(length), "labels": torch.arange(length) + 1, **extra}


def test_a_good_batch_has_no_problem():
    batch = LocalBatch.of([_sample(3), _sample(1), _sample(17)])
    assert batch.problem() is None
    assert (batch.rows, batch.padded, batch.original) == ([3, 1, 17], [3, 1, 17], [3, 1, 17])


def test_a_zero_length_sample_is_refused_naming_its_index_and_length():
    batch = LocalBatch.of([_sample(5), _sample(4), _sample(0), _sample(0)])
    assert batch.problem() == "sub-sample 2 has length 0; every sample needs at least one token (drop empty samples from the data)"


@pytest.mark.parametrize("padded", [[8, 0, 8], [8, -4, 8]])
def test_a_planned_length_below_one_is_refused_whatever_the_tokens_held(padded):
    """The length the planner is asked for is `padded` (packing: padded_seq_len), not the rows held."""
    batch = LocalBatch.of([_sample(8), _sample(8), _sample(8)], padded=padded)
    assert batch.problem().startswith(f"sub-sample 1 has length {padded[1]}; every sample needs at least one token")


def test_a_stage_that_holds_no_tokens_plans_with_the_lengths_it_was_given():
    """A middle pipeline stage keeps only the lengths of its samples (no per-token field): it holds
    no rows and is not refused for that."""
    lengths = {"original_seq_len": torch.tensor([5]), "padded_seq_len": torch.tensor([8])}
    batch = LocalBatch.of([dict(lengths), dict(lengths)], padded=[8, 8], original=[5, 5])
    assert batch.rows == [0, 0] and batch.problem() is None


def test_an_empty_batch_and_disagreeing_fields_are_refused():
    assert LocalBatch.of([]).problem() == "the local batch is empty (no sub-sample of non-zero length)"
    assert LocalBatch.of([_sample(3), {"tokens": torch.arange(2)}]).problem() == (
        "sub-sample 1 has fields ['tokens'], sub-sample 0 has ['labels', 'tokens']"
    )
    ragged = {"tokens": torch.arange(4), "labels": torch.arange(3)}
    assert LocalBatch.of([_sample(3), ragged]).problem() == "sub-sample 1: field 'labels' has 3 tokens, the others 4"


WORLD, CP = 4, 2


def _rank(rank: int, store_path: str, out: str) -> None:
    from trainer_client.dropin import agree_on_step, dpxcp_groups

    init_gloo(rank, WORLD, store_path)
    groups, _ = dpxcp_groups(CP)
    dp_rank = groups.dp.rank()
    # Step 0: DP rank 1 (DPxCP ranks 2 and 3, CP siblings that load the same samples) holds an empty sample.
    bad = LocalBatch.of([_sample(6), _sample(0 if dp_rank == 1 else 4)])
    first = agree_on_step(0, bad, None, groups)
    second = agree_on_step(1, LocalBatch.of([_sample(6 + dp_rank), _sample(2)]), None, groups)
    write_rank_result(out, rank, {"error": first.error, "layout": first.layout is not None,
                                  "next": list(second.layout.padded) if second.layout else second.error})
    dist.destroy_process_group()


def test_one_dp_ranks_empty_sample_stops_every_rank_at_that_step(tmp_path):
    run_ranks(_rank, (str(tmp_path / "store"), str(tmp_path)), WORLD, 120)
    records = read_rank_results(tmp_path, WORLD)
    want = "step 0: DPxCP rank 2 (DP rank 1): sub-sample 1 has length 0; every sample needs at least one token"
    for rank, record in enumerate(records):
        assert record["error"].startswith(want), (rank, record)
        assert record["layout"] is False
        assert record["next"] == [6, 2, 7, 2], (rank, record)
