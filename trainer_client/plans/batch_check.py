"""Is this the batch the plan was made for? The one check wherever a plan meets a batch
(docs/trainer-client.md, "Errors": "The batch is the planned batch").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from batch_planner.plan import Plan
from trainer_client.plans.batch import BatchMismatchError, lengths_key


def check_batch_is_planned(planned: Sequence[int], actual: Sequence[int], step: int | None = None) -> None:
    """Raises BatchMismatchError unless `actual` (the batch's per-sample lengths, in sample order)
    equals `planned` (those the plan was made for), naming the first sample that differs, its
    planned and actual length, and the step. One tuple comparison when they match."""
    planned, actual = tuple(planned), tuple(actual)
    if actual == planned:
        return
    where = f"step {step}: " if step is not None else ""
    if len(actual) != len(planned):
        raise BatchMismatchError(
            f"{where}the plan was made for {len(planned)} samples but the batch holds {len(actual)}; "
            "apply a plan to the batch it was made for"
        )
    index = next(i for i, (p, a) in enumerate(zip(planned, actual)) if p != a)
    raise BatchMismatchError(
        f"{where}sample {index} of the batch has length {actual[index]}, the plan was made for length "
        f"{planned[index]}: this is not the batch the plan was made for (another step's batch, or the "
        "samples in another order?); apply a plan to the batch it was made for"
    )


@dataclass(frozen=True)
class _Planned:
    lengths: tuple[int, ...]
    step: int | None
    key: bytes  # lengths_key(lengths): the usual check is one comparison of bytes


class PlannedBatches:
    """The lengths and step of the last `keep` plans handed out, by plan id (a plan id is a digest
    of the request, its lengths included: equal ids, equal lengths)."""

    def __init__(self, keep: int):
        self.keep = keep
        self._by_id: OrderedDict[str, _Planned] = OrderedDict()

    def record(self, plan: Plan, lengths: tuple[int, ...], step: int | None = None) -> None:
        self._by_id[plan.plan_id] = _Planned(lengths, step, lengths_key(lengths))
        self._by_id.move_to_end(plan.plan_id)
        while len(self._by_id) > self.keep:
            self._by_id.popitem(last=False)

    def check(self, plan: Plan, lengths: Sequence[int], key: bytes = b"") -> None:
        """BatchMismatchError unless `lengths` are those `plan` was made for; a plan not among the
        last `keep` handed out cannot be checked and is refused too. `key`: the lengths'
        `lengths_key` where known (GlobalBatch.lengths_bytes): then equal lengths cost one
        comparison of bytes, and the lengths are walked only to name a difference."""
        planned = self._by_id.get(plan.plan_id)
        if planned is None:
            raise BatchMismatchError(
                f"plan {plan.plan_id} is not one of the last {self.keep} plans this client handed out, so the "
                "batch cannot be checked against it: apply the plan plan_step returned for this batch"
            )
        if key and key == planned.key:
            return
        check_batch_is_planned(planned.lengths, lengths, planned.step)
