"""`share_over_tp` (trainer_client/service/broadcast.py) on 2 real gloo ranks as one TP group: a TP rank whose
batch was refused before planning (no request) hands on its own refusal; one that passes no
refusal either gets a UsageError naming the call to hand on, not an `assert` (which `python -O`
drops, returning None where every caller expects a plan or an error)."""

from __future__ import annotations

import torch.distributed as dist

from tests.support.launch import init_gloo, read_rank_results, run_ranks, write_rank_result

WORLD = 2


def _rank(rank: int, store_path: str, out: str) -> None:
    from trainer_client.service.broadcast import share_over_tp
    from trainer_client.errors import PlanRejectedError

    init_gloo(rank, WORLD, store_path)
    outcomes = []
    for rank_one_holds in (PlanRejectedError("INVALID_ARGUMENT", "sample 2 has length 0"), None):
        own = PlanRejectedError("INVALID_ARGUMENT", "sequence_lengths: sample 0 is too long") if rank == 0 else rank_one_holds
        outcome, payload, source = share_over_tp(own, None, b"", None, dist.group.WORLD)
        outcomes.append([f"{type(outcome).__name__}: {outcome}", payload.decode(), source])
    write_rank_result(out, rank, outcomes)
    dist.destroy_process_group()


def test_a_rank_without_a_request_hands_on_its_refusal_or_a_usage_error(tmp_path):
    run_ranks(_rank, (str(tmp_path / "store"), str(tmp_path)), WORLD, 120)
    first, second = read_rank_results(tmp_path, WORLD)
    rejected = "PlanRejectedError: the batch planner rejected the request (INVALID_ARGUMENT): "
    assert first == [[rejected + "sequence_lengths: sample 0 is too long", "", None]] * 2
    assert second[0] == [rejected + "sample 2 has length 0", "", None]
    assert second[1] == ["UsageError: share_over_tp: a rank without a request must pass the refusal of its batch as `own`, got None", "", None]
