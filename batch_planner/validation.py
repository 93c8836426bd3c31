"""What a planning request may ask for: its limits, its options, and the schedulers and layouts
Megatron-Core plans.

Every limit, every unsupported combination, every input that crashes or misleads Megatron-Core's
schedulers (docs/design.md, "What Megatron-Core does with bad or unusual input"), and every layout
outside a scheduler's measured domain (batch_planner/domain.py) is rejected here, before any
scheduler runs (`validate_request`), with a message that names the field, the value and what is
allowed.

The other refusals of a request are made where their input is read: a proto enum value the
contract lacks (batch_planner/convert.py: the core's types have no value for it), a cost model's
fields (batch_planner/cost_spec.py, cost_derivation.py), bytes that are not a PlanRequest, a
deadline passed and a job that differs from its metadata's (planner_server/planning_worker.py),
job metadata that is not a job name (planner_server/servicer.py, by `job_name_refusal` here), and
the server's own state: drain, overload, deadline (planner_server/servicer.py, admission.py).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Annotated, Any, NoReturn

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from batch_planner.cp_groups import is_power_of_two, largest_power_of_two_group, megatron_cp_group_sizes
from batch_planner.domain import layout_refusal, per_batch
from batch_planner.errors import InvalidRequestError
from batch_planner.precision import Precision
from batch_planner.request import PaddingRule, PlanRequest, SchedulerKind, option_bounds
from batch_planner.schedulers import require_scheduler

# \Z, not $: "$" also matches before a trailing newline, which would let "run1\n" through.
JOB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
# The largest value any limit may be set to: no server accepts a longer sample than this.
MAX_LIMIT = 1 << 62
OPTION_BOUNDS = option_bounds()
LENGTHS_ACCEPTED = "a sequence of integer lengths, one per sample (a list or tuple of ints, or a 1-D integer tensor or array)"


def _limit(doc: str) -> Any:
    return Field(ge=1, le=MAX_LIMIT, description=doc)


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class RequestLimits:
    """What one server accepts; configurable (planner-server --help, planner_server/config.py)."""

    max_samples_per_request: Annotated[int, _limit("largest batch (samples) one request may carry")] = 16384
    max_dp_cp_size: Annotated[int, _limit("largest DPxCP rank count a request may ask for")] = 1024
    max_sequence_length: Annotated[int, _limit("longest sample (tokens) a request may carry")] = 4 * 1024 * 1024
    max_tensor_parallel_size: Annotated[int, _limit("largest tensor-parallel size a request may ask for")] = 64
    max_micro_batch_group_size: Annotated[int, _limit("largest virtual-pipeline micro-batch group size")] = 64


def _reject(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(f"{field}: {message}", field=field)


def job_name_refusal(job: str) -> str | None:
    """Why `job` is not a job name (the one rule: the request's field, its metadata, its metric
    label), or None; "" is no job name, and is accepted."""
    if not job or JOB_NAME_PATTERN.match(job):
        return None
    return f"{job[:80]!r} is not a job name: use 1-63 characters of [A-Za-z0-9_.-]"


def sequence_lengths_of(values: Any) -> tuple[int, ...]:
    """A batch's lengths as a tuple of ints, or InvalidRequestError naming `sequence_lengths`, the
    sample and its value: the rule the server, the in-process planner and the trainer client share.
    Integers only (Python ints, numpy integers, integer tensors and arrays): nothing is truncated
    or converted, so floats, NaN, strings and bools are refused; so are None, scalars and mappings;
    every length is 1..MAX_LIMIT (a server's own limits are checked by validate_request)."""
    return _lengths_and_longest(values)[0]


def _lengths_and_longest(values: Any) -> tuple[tuple[int, ...], int]:
    """`sequence_lengths_of`, and the longest length."""
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):  # a tensor or an array
        values = values.tolist()
    if values is None or isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Sequence):
        what = "None" if values is None else f"the {type(values).__name__} {_shown(values)}"
        _reject("sequence_lengths", f"got {what}; expected {LENGTHS_ACCEPTED}")
    if set(map(type, values)) == {int}:  # the usual case, at C speed
        lengths = tuple(values)
    else:
        lengths = tuple(_length_at(index, value) for index, value in enumerate(values))
    if not lengths:
        _reject("sequence_lengths", "the batch is empty; send at least one sample length")
    shortest, longest = min(lengths), max(lengths)
    if shortest < 1:
        _reject("sequence_lengths", f"sample {lengths.index(shortest)} has length {shortest}; every sample needs >= 1 token")
    if longest > MAX_LIMIT:
        _reject("sequence_lengths", f"sample {lengths.index(longest)} has length {longest}; any server allows at most 2^62 tokens")
    return lengths, longest


def _length_at(index: int, value: Any) -> int:
    if not isinstance(value, bool) and type(value).__name__ not in ("bool_", "bool"):
        try:
            return operator.index(value)  # an int, a numpy integer, a 0-d integer tensor
        except TypeError:
            pass
    _reject(
        "sequence_lengths",
        f"sample {index} has value {_shown(value)} ({type(value).__name__}); expected an integer length >= 1 "
        "(floats, NaN, strings and bools are refused, not converted)",
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_request(request: PlanRequest, limits: RequestLimits) -> None:
    """Raises InvalidRequestError (or SchedulerUnavailableError) for a request we must not plan."""
    lengths, longest = _lengths_and_longest(request.sequence_lengths)
    if len(lengths) > limits.max_samples_per_request:
        _reject(
            "sequence_lengths",
            f"{len(lengths)} samples exceed this server's limit of {limits.max_samples_per_request} "
            "per request; split the batch or raise --max-samples-per-request",
        )
    bounded: list[tuple[str, Any, int, int | None]] = [("layout.data_parallel_size", request.data_parallel_size, 1, limits.max_dp_cp_size)]
    bounded += [(proto, getattr(request, name), lower, getattr(limits, limit) if limit else None) for name, proto, lower, limit in OPTION_BOUNDS]
    for name, value, lower, upper in bounded:
        if value is None:
            continue  # an optional option left unset
        if upper is None and value < lower:
            _reject(name, f"got {value}; allowed: >= {lower}")
        if upper is not None and not lower <= value <= upper:
            _reject(name, f"got {value}; allowed {lower}..{upper}")
    dp_cp = request.dp_cp_size
    if dp_cp > limits.max_dp_cp_size:
        _reject(
            "layout",
            f"DPxCP = {request.data_parallel_size}x{request.context_parallel_size} = {dp_cp} ranks "
            f"exceeds this server's limit of {limits.max_dp_cp_size}",
        )
    if longest > limits.max_sequence_length:
        _reject(
            "sequence_lengths",
            f"sample {lengths.index(longest)} has length {longest}; this server allows at most "
            f"{limits.max_sequence_length} tokens per sample",
        )
    refusal = job_name_refusal(request.job)
    if refusal is not None:
        _reject("job", refusal)

    kind = request.scheduler
    if not isinstance(kind, SchedulerKind):
        _reject("scheduler", f"{kind!r} is unknown; allowed: {', '.join(k.value for k in SchedulerKind)}")
    _reject_unsupported_options(request)
    if kind is SchedulerKind.AUTO:
        return  # each of auto's candidates is a concrete request, validated on its own
    require_scheduler(kind)

    # The layouts Megatron-Core's scheduler plans, as measured (batch_planner/domain.py): outside
    # them upstream crashes, returns plans no process group runs, or loops for ever.
    refusal = layout_refusal(kind, request.data_parallel_size, request.context_parallel_size)
    if refusal is not None:
        _reject("layout", refusal)
    if kind is SchedulerKind.HYBRID_CP:
        capacity, capacity_name = request.max_seqlen_per_dp_cp_rank * dp_cp, "max_seqlen_per_dp_cp_rank x DPxCP"
    elif kind is SchedulerKind.DYNAMIC_CP:
        group_size = request.micro_batch_group_size
        if group_size is not None and group_size > len(lengths):
            # Every micro-batch holds a sample, and VPP makes their count a multiple of the group.
            _reject(
                "micro_batch_group_size",
                f"got {group_size} with {len(lengths)} samples; dynamic_cp needs at least "
                "micro_batch_group_size samples (a micro-batch per sample at most); send more "
                "samples or a smaller micro_batch_group_size",
            )
        if per_batch(kind, dp_cp):
            # Planned batch by batch: a sample upstream cannot place (its power-of-two CP size is
            # not built here) makes upstream's plan invalid, and the substitute may hold it on the
            # whole DPxCP group (batch_planner/planner.py, substitute_cp_size).
            capacity = request.max_seqlen_per_dp_cp_rank * dp_cp
            capacity_name = f"max_seqlen_per_dp_cp_rank x DPxCP {dp_cp} (the whole group, which the substitute may use)"
        else:
            # A sample gets a power-of-two CP size, so the longest fits the largest power-of-two
            # group (the whole group: DPxCP is a power of two here).
            largest = largest_power_of_two_group(dp_cp)
            capacity = request.max_seqlen_per_dp_cp_rank * largest
            capacity_name = f"max_seqlen_per_dp_cp_rank x {largest} (the largest power-of-two CP group of DPxCP {dp_cp})"
    else:
        capacity = request.max_seqlen_per_dp_cp_rank * request.context_parallel_size
        capacity_name = "max_seqlen_per_dp_cp_rank x CP"
        replicas_needed = request.data_parallel_size * (request.micro_batch_group_size or 1)
        if len(lengths) < replicas_needed:
            _reject(
                "sequence_lengths",
                f"static_packing needs at least DP x micro_batch_group_size = {replicas_needed} "
                f"samples; got {len(lengths)}",
            )
    if longest > capacity:
        _reject(
            "sequence_lengths",
            f"sample {lengths.index(longest)} has length {longest}, more than {capacity_name} = "
            f"{capacity} tokens that {kind.value} can hold; raise max_seqlen_per_dp_cp_rank "
            "or drop the sample",
        )


def _reject_unsupported_options(request: PlanRequest) -> None:
    kind = request.scheduler
    if request.auto_schedulers:
        if kind is not SchedulerKind.AUTO:
            _reject("auto_schedulers", f"only auto chooses among schedulers; leave it empty for {kind.value}")
        if SchedulerKind.AUTO in request.auto_schedulers:
            _reject("auto_schedulers", "lists auto itself; allowed: hybrid_cp, dynamic_cp, static_packing")
    if request.min_cp_size is not None:
        if kind not in (SchedulerKind.DYNAMIC_CP, SchedulerKind.AUTO):
            _reject("min_cp_size", f"only dynamic_cp (and auto) take a minimum CP size; leave it unset for {kind.value}")
        buildable = sorted(size for size in megatron_cp_group_sizes(request.dp_cp_size) if is_power_of_two(size))
        if request.min_cp_size not in buildable:
            _reject(
                "min_cp_size",
                f"got {request.min_cp_size}; allowed: a CP group size Megatron-Core builds over "
                f"DPxCP = {request.dp_cp_size} ranks: {', '.join(map(str, buildable))}",
            )
    if request.precision is not Precision.BF16 and request.padding is PaddingRule.VERL:
        _reject("precision", f"got {request.precision.value} with padding verl; verl's dynamic CP runs bf16 only (its docs: no FP8), and the "
                "plan pads for verl's engine: allowed with padding verl: bf16")
    if request.min_local_rows is not None:
        if request.padding is not PaddingRule.VERL:
            _reject("min_local_rows", f"got {request.min_local_rows} with padding {request.padding.value}; only verl's padding tops groups "
                    "up to a minimum of rows per rank: set padding to verl, or leave min_local_rows unset")
        candidates = request.auto_schedulers or (SchedulerKind.HYBRID_CP,)  # auto without a list: every scheduler
        if kind is SchedulerKind.HYBRID_CP or (kind is SchedulerKind.AUTO and SchedulerKind.HYBRID_CP in candidates):
            _reject(
                "min_local_rows",
                f"got {request.min_local_rows} with scheduler {kind.value}; it tops up a packed group's buffer, and hybrid_cp runs "
                "each sample alone: use dynamic_cp or static_packing (with auto: auto_schedulers without hybrid_cp)",
            )
    if request.max_seqs_per_micro_batch is not None:
        if kind not in (SchedulerKind.STATIC_PACKING, SchedulerKind.AUTO):
            _reject(
                "max_seqs_per_micro_batch",
                f"only static_packing (and auto) cap sequences per micro-batch; leave it unset for {kind.value}",
            )
    if request.micro_batch_group_size is not None:
        if kind is SchedulerKind.HYBRID_CP:
            _reject(
                "micro_batch_group_size",
                "hybrid_cp in Megatron-Core does not support virtual pipeline parallelism; "
                "use dynamic_cp or static_packing, or leave it unset",
            )
