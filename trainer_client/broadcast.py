"""One rank asks, all ranks agree: share a step's plan over the DPxCP process group.

By default rank 0 of the group has the plan (from the service or its fallback) and broadcasts it
as serialized PlanResponse bytes: the service's own, as the RPC returned them, or the fallback's.
With `who_asks=all_ranks` every rank planned for itself. Either way every rank then all-gathers
(plan id, digest of its own request) and raises PlanMismatchError unless all ranks hold the same
plan for the same batch: a rank that trains a different plan than its peers would hang the job in
its first CP collective.

A planning error on the asking rank is broadcast too, so every rank raises it instead of the
others waiting forever in the broadcast: a refusal (PlanRejectedError) as a refusal with its code,
a service that failed with fallback off (PlannerUnavailableError) as that.

Where every TP rank plans the same batch (Megatron-Bridge), the ranks that lead the TP ranks'
DPxCP groups form one TP group, and `share_over_tp` hands TP rank 0's answer, plan or error, to the
others before each broadcasts it over its own DPxCP group: one request per step, not one per TP rank.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist

from batch_planner.convert import plan_from_proto, plan_to_proto
from batch_planner.plan import Plan
from batch_planner.identity import canonical_request
from batch_planner.request import PlanRequest
from batch_planner.v1 import planner_pb2 as pb
from trainer_client.batch import lengths_key
from trainer_client.config import WhoAsks
from trainer_client.distributed import is_distributed
from trainer_client.plan_source import PlannerUnavailableError
from trainer_client.rpc_client import PlanRejectedError


class PlanMismatchError(RuntimeError):
    """Ranks that must train one plan hold different plans or different batches: ranks of one
    DPxCP group, or TP ranks where TP rank 0 asks for all of them."""


# What a rank may hold instead of a plan; every rank of the group raises it.
RankError = PlanRejectedError | PlannerUnavailableError | PlanMismatchError


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
    for its own batch, and gets the group's plan back, or raises the asking rank's RankError.
    A rank whose batch was refused before planning passes its error and no request: every rank
    then raises, a refusal as a PlanRejectedError with the refusing rank's code. Without a process
    group of several ranks there is no one to agree with: no digest, no collective. `response`:
    the serialized PlanResponse `own` was read from, when the service sent it (broadcast as is)."""
    if not is_distributed(group):
        return _unwrap(own)
    if who_asks is WhoAsks.LEADER:
        holder: list[Any] = [_encode(own, response) if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        if request is not None or dist.get_rank(group) == 0:  # a refused batch keeps its own error
            own = _decode(holder[0])
    digest = canonical_digest(request) if request is not None else "refused"
    mine = (own.plan_id if isinstance(own, Plan) else None, digest, None if isinstance(own, Plan) else _encode(own))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    errors = [(rank, entry[2]) for rank, entry in enumerate(everyone) if entry[2] is not None]
    if errors:
        if not isinstance(own, Plan):
            return _unwrap(own)
        rank, payload = errors[0]
        raise _decode(payload, f"rank {rank} of the DPxCP group could not plan: ")  # type: ignore[misc]
    batches = {digest for _, digest, _ in everyone}
    if len(batches) > 1:
        raise PlanMismatchError(
            "ranks of the DPxCP group hold different batches (request digests by rank: "
            f"{[digest for _, digest, _ in everyone]}); every rank must hold the same global batch"
        )
    plan_ids = {plan_id for plan_id, _, _ in everyone}
    if len(plan_ids) > 1:
        raise PlanMismatchError(
            f"ranks of the DPxCP group received different plans (plan ids by rank: {[p for p, _, _ in everyone]})"
        )
    return _unwrap(own)


def share_over_tp(
    own: Plan | RankError | None, request: PlanRequest | None, response: bytes, source: str | None, group: dist.ProcessGroup
) -> tuple[Plan | RankError, bytes, str | None]:
    """TP rank 0's answer for every rank of the TP group `group` (all of them lead their DPxCP
    groups; only TP rank 0 asked the planner): (its plan or error, the serialized PlanResponse,
    where the plan came from). TP rank 0 passes its own and gets it back, with the bytes it sent;
    the others pass None and their own `request`. A rank whose batch is not TP rank 0's gets a
    PlanMismatchError instead of a plan made for another batch; one whose batch was refused before
    planning (`request` None) keeps `own`, its refusal."""
    first = dist.get_rank(group) == 0
    sent = _encode(own, response) if first else None
    holder: list[Any] = [(sent, source, _batch_digest(request)) if first else None]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    if first:
        assert own is not None and sent is not None
        return own, _response_of(sent), source
    payload, source, digest = holder[0]
    if request is None:
        assert own is not None, "a rank without a request holds its refusal"
        return own, b"", source
    mine = _batch_digest(request)
    if digest != mine:  # (None: TP rank 0's batch was refused before planning, so it is another one)
        return PlanMismatchError(
            f"this TP rank's batch differs from TP rank 0's (batch digests {mine} and {digest}), which the planner planned; "
            "every TP rank must read the same global batch"
        ), b"", source
    return _decode(payload), _response_of(payload), source


def _batch_digest(request: PlanRequest | None) -> str | None:
    """A fingerprint of the batch alone, its lengths, not of the options: TP ranks may calibrate
    their cost models apart, and the plan TP rank 0's asked for serves them all (their layout is
    one by construction: the same DPxCP size and CP size)."""
    return None if request is None else hashlib.blake2b(lengths_key(request.sequence_lengths), digest_size=8).hexdigest()


def _response_of(payload: tuple) -> bytes:
    """The serialized PlanResponse an `_encode`d plan carries; b"" for an error."""
    return payload[1] if payload[0] == "plan" else b""


def _encode(own: Plan | RankError | None, response: bytes = b"") -> tuple:
    if isinstance(own, Plan):
        return ("plan", response or plan_to_proto(own, columns=True).SerializeToString())
    if isinstance(own, PlanRejectedError):
        return ("rejected", own.code, own.server_message)
    if isinstance(own, PlannerUnavailableError):
        return ("unavailable", str(own))
    if isinstance(own, PlanMismatchError):
        return ("mismatch", str(own))
    raise RuntimeError("rank 0 of the DPxCP group must plan when who_asks=leader")


def _decode(payload: tuple, prefix: str = "") -> Plan | RankError:
    if payload[0] == "plan":
        return plan_from_proto(pb.PlanResponse.FromString(payload[1]))
    if payload[0] == "rejected":
        return PlanRejectedError(payload[1], prefix + payload[2])
    if payload[0] == "mismatch":
        return PlanMismatchError(prefix + payload[1])
    return PlannerUnavailableError(prefix + payload[1])


def _unwrap(own: Plan | RankError | None) -> Plan:
    if isinstance(own, RankError):
        raise own
    if own is None:
        raise RuntimeError("no plan: this rank did not plan and there is no group to receive one from")
    return own
