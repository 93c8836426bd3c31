"""One rank asks, all ranks agree: share a step's plan over the DPxCP process group.

Rank 0 asks and broadcasts the plan as serialized PlanResponse bytes, or its error (with
`who_asks=all_ranks` every rank plans for itself); every rank then all-gathers (plan id, digest of
its own request) and raises PlanMismatchError unless all hold the same plan for the same batch: a
rank that trains another plan than its peers would hang the job in its first CP collective.
`share_over_tp` hands TP rank 0's answer to the other TP ranks first (docs/trainer-client.md, "Usage").
"""

from __future__ import annotations

import hashlib
import json
import torch.distributed as dist

from batch_planner.convert import plan_from_proto, plan_to_proto
from batch_planner.plan import Plan
from batch_planner.identity import canonical_request
from batch_planner.request import PlanRequest
from batch_planner.v1 import planner_pb2 as pb
from trainer_client.plans.batch import lengths_key
from trainer_client.service.config import WhoAsks
from trainer_client.plans.distributed import is_distributed
from trainer_client.errors import PlanMismatchError, PlannerUnavailableError, PlanRejectedError, UsageError
from trainer_client.plans.together import fail_together, share_from_first


# What a rank may hold instead of a plan; every rank of the group raises it.
RankError = PlanRejectedError | PlannerUnavailableError | PlanMismatchError | UsageError


def canonical_digest(request: PlanRequest) -> str:
    """A short fingerprint of everything the plan id covers of a request (`canonical_request`),
    cheap for thousands of samples: the lengths are hashed as an int64 array's bytes, not as text."""
    canonical = canonical_request(request)
    digest = hashlib.blake2b(lengths_key(canonical.pop("lengths")), digest_size=8)
    digest.update(json.dumps(canonical, sort_keys=True).encode())
    return digest.hexdigest()


def agree_on_plan(
    own: Plan | RankError | None,
    request: PlanRequest | None,
    group: dist.ProcessGroup | None,
    who_asks: WhoAsks,
    response: bytes = b"",
) -> Plan:
    """Every rank calls this with its own result (`None` on ranks that did not ask) and the request
    for its own batch, and gets the group's plan back, or every rank raises the same error: the
    asking rank's, or the first rank's whose batch was refused before planning (it passes its error
    and no request). `response`: the serialized PlanResponse `own` was read from, when the service
    sent it (broadcast as is; rank 0 keeps the plan it already decoded)."""
    if not is_distributed(group):
        return _unwrap(own)
    if who_asks is WhoAsks.LEADER:
        first = dist.get_rank(group) == 0
        received = share_from_first(_outgoing(own, response) if first else None, group)
        if isinstance(received, BaseException):
            raise received  # the asking rank's error, on every rank (a refused batch's own error too)
        if not first and request is not None:  # a refused batch keeps its own error
            own = plan_from_proto(pb.PlanResponse.FromString(received))
    digest = canonical_digest(request) if request is not None else "refused"
    failure = None if isinstance(own, Plan) else own if isinstance(own, BaseException) else _no_plan()
    everyone = fail_together(
        failure, group, (own.plan_id if isinstance(own, Plan) else None, digest),
        context="rank {rank} of the DPxCP group could not plan: {message}",
    )
    if len({digest for _, digest in everyone}) > 1:
        raise PlanMismatchError(
            "ranks of the DPxCP group hold different batches (request digests by rank: "
            f"{[digest for _, digest in everyone]}); every rank must hold the same global batch"
        )
    if len({plan_id for plan_id, _ in everyone}) > 1:
        raise PlanMismatchError(
            f"ranks of the DPxCP group received different plans (plan ids by rank: {[p for p, _ in everyone]})"
        )
    return _unwrap(own)


def share_over_tp(
    own: Plan | RankError | None, request: PlanRequest | None, response: bytes, source: str | None, group: dist.ProcessGroup
) -> tuple[Plan | RankError, bytes, str | None]:
    """TP rank 0's answer for every rank of the TP group `group` (all of them lead their DPxCP
    groups; only TP rank 0 asked the planner): (its plan or error, the serialized PlanResponse,
    where the plan came from). A rank whose batch is not TP rank 0's gets a PlanMismatchError; one
    whose batch was refused before planning (`request` None) keeps `own`, its refusal. An error is
    returned, not raised: each rank hands it on to its own DPxCP group (`agree_on_plan`), whose
    ranks would otherwise wait."""
    if dist.get_rank(group) == 0:
        sent = _outgoing(own, response)
        share_from_first(sent if isinstance(sent, BaseException) else (sent, source, _batch_digest(request)), group)
        return own, b"" if isinstance(sent, BaseException) else sent, source  # type: ignore[return-value]
    received = share_from_first(None, group)
    if request is None:  # this rank's batch was refused before planning: `own` is that refusal
        if own is None:
            own = UsageError("share_over_tp: a rank without a request must pass the refusal of its batch as `own`, got None")
        return own, b"", None
    if isinstance(received, BaseException):
        return received, b"", None  # type: ignore[return-value]
    payload, source, digest = received
    mine = _batch_digest(request)
    if digest != mine:
        return PlanMismatchError(
            f"this TP rank's batch differs from TP rank 0's (batch digests {mine} and {digest}), which the planner planned; "
            "every TP rank must read the same global batch"
        ), b"", source
    return plan_from_proto(pb.PlanResponse.FromString(payload)), payload, source


def _batch_digest(request: PlanRequest | None) -> str | None:
    """A fingerprint of the batch alone, its lengths, not of the options: TP ranks may calibrate
    their cost models apart, and the plan TP rank 0's asked for serves them all (their layout is
    one by construction: the same DPxCP size and CP size)."""
    return None if request is None else hashlib.blake2b(lengths_key(request.sequence_lengths), digest_size=8).hexdigest()


def _outgoing(own: Plan | RankError | None, response: bytes) -> bytes | BaseException:
    """What the asking rank sends its peers: the serialized PlanResponse (the service's, or the fallback plan's), or its error."""
    if isinstance(own, Plan):
        return response or plan_to_proto(own, columns=True).SerializeToString()
    return own if own is not None else _no_plan()


def _no_plan() -> UsageError:
    return UsageError("rank 0 of the DPxCP group must plan when who_asks=leader")


def _unwrap(own: Plan | RankError | None) -> Plan:
    if isinstance(own, BaseException):
        raise own
    if own is None:
        raise UsageError("no plan: this rank did not plan and there is no group to receive one from")
    return own
