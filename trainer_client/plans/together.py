"""Ranks fail together: every rank of a group enters one collective with its result or its error,
and every rank leaves it with the group's result, or every rank raises the same error
(docs/trainer-client.md, "Errors"): a rank that raised alone would leave its peers waiting for
ever in the next collective.

An error that cannot be pickled travels as a RankFailedError naming its type and message. Without a
process group of several ranks there is no one to tell: the error is raised, the payload returned.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist

from trainer_client.plans.distributed import is_distributed
from trainer_client.errors import ArgumentTypeError, RankFailedError

# How a copy of another rank's error names where it came from: {rank}, that rank in the group;
# {message}, the error's own message.
DEFAULT_CONTEXT = "rank {rank} of the group failed: {message}"


def fail_together(
    failure: BaseException | None, group: Any, payload: Any = None, *, context: str = DEFAULT_CONTEXT
) -> list[Any]:
    """Every rank of `group` calls this with its payload, or with the error it failed with
    (`failure`); all of them get every rank's payload in group-rank order, or all of them raise the
    first failed rank's error: the failed rank its own object, the others a copy worded by `context`.
    A payload that cannot be pickled is this rank's failure (ArgumentTypeError, a TypeError)."""
    if not is_distributed(group):
        if failure is not None:
            raise failure
        return [payload]
    entry = _entry(failure, payload)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, entry, group=group)
    for rank, (kind, data) in enumerate(everyone):
        if kind == "error":
            if rank == dist.get_rank(group) and failure is not None:
                raise failure
            raise _copy(data, rank, context)
    return [_payload(kind, data) for kind, data in everyone]


def share_from_first(outcome: Any, group: Any) -> Any:
    """Rank 0's outcome, a value or an exception (to the others a copy with the same message), on
    every rank of `group`. Nothing is raised here: the caller raises an error outcome once its own
    peers know it too."""
    if not is_distributed(group):
        return outcome
    first = dist.get_rank(group) == 0
    failure = outcome if isinstance(outcome, BaseException) else None
    holder: list[Any] = [_entry(failure, None if failure else outcome) if first else None]
    dist.broadcast_object_list(holder, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    if first:
        return outcome
    kind, data = holder[0]
    return _copy(data, 0, "{message}") if kind == "error" else _payload(kind, data)


def naming_rank(error: Exception | None, group: Any) -> Exception | None:
    """`error` (of its class, built from its message) naming this rank of `group`: for a call
    site whose ranks should all raise one message, given with `context="{message}"`."""
    return None if error is None else type(error)(f"{error} (on rank {dist.get_rank(group)} of the group)")


def _entry(failure: BaseException | None, payload: Any) -> tuple[str, bytes]:
    """What one rank contributes, pickled here so that a pickling error is this rank's failure
    rather than an exception inside the collective that would stop this rank alone. Bytes (a
    serialized plan) travel as they are: a second copy of megabytes would cost the step."""
    if failure is None:
        if type(payload) is bytes:
            return ("bytes", payload)
        try:
            return ("ok", pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:  # noqa: BLE001 - pickle raises several types
            failure = ArgumentTypeError(f"this rank's result cannot be sent to the other ranks ({type(exc).__name__}: {str(exc):.160})")
    return ("error", _pickled_error(failure))


def _payload(kind: str, data: bytes) -> Any:
    return data if kind == "bytes" else pickle.loads(data)


def _pickled_error(error: BaseException) -> bytes:
    try:
        data = pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)  # an exception whose constructor takes other arguments fails here
        return data
    except Exception:  # noqa: BLE001 - pickle raises several types
        return pickle.dumps(RankFailedError(f"{type(error).__name__}: {error}"), protocol=pickle.HIGHEST_PROTOCOL)


def _copy(data: bytes, rank: int, context: str) -> BaseException:
    """Another rank's error, of its class and attributes, its message saying where it came from."""
    error = pickle.loads(data)
    message = context.format(rank=rank, message=str(error.args[0]) if len(error.args) == 1 else str(error))
    error.args = (message,)
    return error
