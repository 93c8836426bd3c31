"""The facade a trainer imports: plan each step (ahead of time), apply the plan, restore outputs
(docs/trainer-client.md, "Usage").
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import time
import weakref
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import torch.distributed as dist
from prometheus_client import CollectorRegistry, start_http_server

from batch_planner.errors import InvalidRequestError
from batch_planner.plan import Plan
from batch_planner.request import PlanningOptions, PlanRequest, SchedulerKind
from batch_planner.validation import sequence_lengths_of
from trainer_client.service.ahead import PLAN_CACHE_SIZE, Fetched, PlanAhead
from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.batch import GlobalBatch, unbind_batch
from trainer_client.plans.batch_check import PlannedBatches
from trainer_client.plans.megatron import (
    CpGroupResolver,
    dp_cp_group,
    megatron_cp_group_resolver,
    parallel_state_initialized,
)
from trainer_client.plans.micro_batch import RankMicroBatch
from trainer_client.service.broadcast import RankError, agree_on_plan, canonical_digest, share_over_tp
from trainer_client.service.calibration import CalibrationReport, Calibrator
from trainer_client.refusals.compatibility import check_dynamic_cp_support, schedulers_the_trainer_runs
from trainer_client.service.config import PlannerClientConfig, WhoAsks
from trainer_client.plans.distributed import is_distributed
from trainer_client.errors import ArgumentTypeError, InvalidArgumentError
from trainer_client.service.metrics import TrainerMetrics
from trainer_client.plans.outputs import restore_outputs
from trainer_client.service.plan_source import PlannerUnavailableError, PlanSource
from trainer_client.service.rpc_client import PlanRejectedError
from trainer_client.plans.together import fail_together
from trainer_client.plans.token_outputs import TokenPiece, restore_token_outputs

log = logging.getLogger(__name__)


class BatchPlannerClient:
    """One per trainer process.

    group: the DPxCP process group the plan covers; by default Megatron-Core's
    `get_data_parallel_group(with_context_parallel=True)` when parallel_state is initialised, else
    the default (world) group. Without torch.distributed, pass `dp_cp_size` and `rank` to plan for a
    layout and apply it as one of its ranks (tests, single-process tools).
    cp_groups: "megatron" (Megatron-Core's parallel_state groups, the default when initialised),
    None (no process groups; only ranks), or a callable size -> group.
    tp_group: this rank's tensor-parallel group, when every TP rank plans the same batch (Megatron-
    Bridge): only TP rank 0 of the ranks that lead the DPxCP groups asks, and hands its answer to the
    others (docs/trainer-client.md, "Usage"). None: each DPxCP group asks.
    engine_config, model_config, transformer_config: the trainer's settings (dataclasses, objects
    or dicts; the transformer config is Megatron-Core's TransformerConfig), checked here and again
    with each batch and plan by `check_dynamic_cp_support` (docs: "Parity with the reference PR").
    """

    def __init__(
        self,
        config: PlannerClientConfig,
        group: Any = None,
        *,
        metrics: TrainerMetrics | None = None,
        registry: CollectorRegistry | None = None,
        cp_groups: str | CpGroupResolver | None = "auto",
        dp_cp_size: int | None = None,
        rank: int | None = None,
        tp_group: Any = None,
        plan_cache_size: int = PLAN_CACHE_SIZE,
        engine_config: Any = None,
        model_config: Any = None,
        transformer_config: Any = None,
    ):
        if not isinstance(config, PlannerClientConfig):
            raise ArgumentTypeError(
                f"config: got a {type(config).__name__}; expected a PlannerClientConfig "
                "(PlannerClientConfig.from_dict or .from_yaml)"
            )
        self.config = config
        self._trainer_configs = dict(
            engine_config=engine_config, model_config=model_config, transformer_config=transformer_config
        )
        # Refuse unsupported features before any process group or planner connection is made.
        check_dynamic_cp_support(planner_config=config, **self._trainer_configs)
        self.metrics = metrics or TrainerMetrics(registry, job=config.job)
        megatron_ready = parallel_state_initialized()
        if group is None and megatron_ready:
            group = dp_cp_group()
        self.group = group
        self.dp_cp_size, self.rank = _group_layout(group, dp_cp_size, rank)
        if self.dp_cp_size % config.context_parallel_size:
            raise InvalidArgumentError(
                f"context_parallel_size={config.context_parallel_size} does not divide the DPxCP group "
                f"of {self.dp_cp_size} ranks"
            )
        if not (cp_groups in ("auto", "megatron", None) or callable(cp_groups)):
            raise InvalidArgumentError(f"cp_groups: {cp_groups!r} is not allowed; expected 'auto', 'megatron', None or a callable size -> group")
        if cp_groups == "auto":
            cp_groups = "megatron" if megatron_ready else None
        self._cp_groups = cp_groups
        # The TP group this rank shares the planner's answers over, and whether it receives them.
        self._tp_sharing, self._tp_receives = _tp_sharing(tp_group, self.leads)
        self._options = PlanningOptions.of(config)
        if config.scheduler is SchedulerKind.AUTO:  # only candidates this trainer can run
            runs = schedulers_the_trainer_runs(config, **self._trainer_configs)
            if config.auto_schedulers:  # the job's own restriction, within what it can run
                runs = tuple(k for k in config.auto_schedulers if not runs or k in runs)
            self._options = replace(self._options, auto_schedulers=runs)
        self.source = PlanSource(config, self.metrics)
        self.ahead = PlanAhead(self.source.plan, depth=config.plan_ahead_depth, cache_size=plan_cache_size)
        # Closed once: by close(), the end of a `with` block, or at the latest the interpreter's exit.
        self._closer = weakref.finalize(self, _close_parts, self.ahead, self.source)
        self.metrics.plan_ahead_depth.labels(self.metrics.job).set(config.plan_ahead_depth)
        self.last_source: str | None = None
        # The lengths and step of the plans handed out, so that micro_batches checks the batch.
        self.planned_batches = PlannedBatches(keep=config.plan_ahead_depth + 2)
        # Closed-loop calibration (trainer_client/service/calibration.py): None when config.calibration is off.
        self.calibration = Calibrator(
            self._options, config.calibration_window_steps, config.calibration_min_observations,
            config.calibration_update_interval_steps, config.plan_ahead_depth, self.metrics, group,
        ) if config.calibration else None

    @property
    def leads(self) -> bool:
        """Whether this rank holds the answer its DPxCP group agrees on: rank 0 of the group, or
        every rank with who_asks=all_ranks."""
        return self.config.who_asks is WhoAsks.ALL_RANKS or self.rank == 0

    @property
    def asks(self) -> bool:
        """Whether this rank calls the planner: one that leads, unless TP rank 0 asks for it (tp_group)."""
        return self.leads and not self._tp_receives

    def request_for(self, lengths: Sequence[int], step: int | None = None) -> PlanRequest:
        """The request for a batch of `step` (default: the next step), with the options in force
        then: the calibrated cost model changes only from a step no rank has prefetched yet.
        Lengths that are not integers >= 1 raise PlanRejectedError (`checked_lengths`)."""
        return self._request(checked_lengths(lengths), step)

    def _request(self, lengths: tuple[int, ...], step: int | None) -> PlanRequest:
        dp = self.dp_cp_size // self.config.context_parallel_size
        return PlanRequest(lengths, dp, self._options_for(step), self.config.job)

    def _options_for(self, step: int | None) -> PlanningOptions:
        return self._options if self.calibration is None else self.calibration.options_for(step)

    def prefetch(self, step: int, lengths: Sequence[int]) -> None:
        """Start planning `step` in the background: call it for steps step + 1 .. step +
        `plan_ahead_depth` while a step trains, as soon as each batch's lengths are known."""
        _check_step(step)
        request = self.request_for(lengths, step)  # on every rank: a bad batch raises everywhere
        if self.asks:
            self.ahead.prefetch(step, request, source=lengths)

    def plan_step(self, step: int, lengths: Sequence[int]) -> Plan:
        """The plan for `step`, the same on every rank of the group (a collective: all ranks call it)."""
        _check_step(step)
        return self._agreed_plan(lengths, step, lambda request: self.ahead.get(step, request))

    def plan(self, lengths: Sequence[int], *, cache: bool = False) -> Plan:
        """The plan for one batch that is not a training step of its own, the same on every rank
        of the group (a collective: all ranks call it, hit or miss). cache=True: the asking rank
        keeps the plans of the last `plan_cache_size` batches by their request's digest
        (docs/trainer-client.md, "Usage": "Batches that are not steps"). cache=False: planned now."""
        if cache:
            return self._agreed_plan(lengths, None, lambda request: self.ahead.get_cached(canonical_digest(request), request))
        return self._agreed_plan(lengths, None, lambda request: Fetched(self.source.plan(request), 0.0))

    def prefetch_batches(self, batches_lengths: Sequence[Sequence[int]]) -> None:
        """Starts planning each batch in the background for `plan(..., cache=True)`; not a
        collective. Lengths the planner refuses raise here."""
        requests = [self.request_for(lengths) for lengths in batches_lengths]
        if self.asks:
            for request in requests:
                self.ahead.prefetch_cached(canonical_digest(request), request)

    def _agreed_plan(self, lengths: Sequence[int], step: int | None, fetch: Callable[[PlanRequest], Fetched]) -> Plan:
        """Asks (on the rank that asks) through `fetch`, then agrees on the plan over the TP and
        DPxCP groups; every rank raises the same error when the asking rank could not plan."""
        started = time.perf_counter()
        own: Plan | RankError | None = None
        response = b""  # the serialized PlanResponse, when the service sent `own`
        try:
            request: PlanRequest | None = self._request_for_step(step, lengths) if step is not None else self.request_for(lengths)
        except PlanRejectedError as error:  # still enters the collectives, so every rank raises
            request, own = None, error
        if self.asks and request is not None:
            try:
                fetched = fetch(request)
                self.metrics.plan_lead.labels(self.metrics.job).observe(fetched.lead_seconds)
                if fetched.waited:
                    self.metrics.late_plans.labels(self.metrics.job).inc()
                own, self.last_source, response = fetched.sourced.plan, fetched.sourced.source, fetched.sourced.response
            except (PlanRejectedError, PlannerUnavailableError) as error:
                own = error
            except Exception as error:  # noqa: BLE001 - a TLS mismatch, a bug: every rank raises it, not this one alone
                if not is_distributed(self.group) and self._tp_sharing is None:
                    raise
                own = _unavailable(error)
        if self._tp_sharing is not None:
            own, response, self.last_source = share_over_tp(own, request, response, self.last_source, self._tp_sharing)
        plan = agree_on_plan(own, request, self.group, self.config.who_asks, response)
        if request is not None:  # (else agree_on_plan raised this rank's error)
            self.planned_batches.record(plan, request.sequence_lengths, step)
        self.metrics.plan_wait.labels(self.metrics.job).observe(time.perf_counter() - started)
        self.metrics.micro_batches.labels(self.metrics.job).set(len(plan.micro_batches))
        if self.calibration is not None and step is not None:
            self.calibration.begin_step(step, plan)
        return plan

    def _request_for_step(self, step: int, lengths: Sequence[int]) -> PlanRequest:
        """The request `prefetch` built for `step` when the lengths are the same, else a new one."""
        prefetched = self.ahead.pending_request(step) if self.asks else None
        if prefetched is None or prefetched.options != self._options_for(step):
            return self.request_for(lengths, step)
        # The very object prefetch was given (a tuple: unchanged since, checked then) needs no
        # element-wise pass, which for 16,384 samples costs a cold cache a fraction of a millisecond.
        if isinstance(lengths, tuple) and self.ahead.pending_source(step) is lengths:
            return prefetched
        checked = checked_lengths(lengths)
        return prefetched if checked == prefetched.sequence_lengths else self._request(checked, step)

    def micro_batches(
        self,
        plan: Plan,
        batch: GlobalBatch | Mapping[str, Any],
        pad_token_id: int = 0,
        pack_group_samples: bool | None = None,
    ) -> list[RankMicroBatch]:
        """This rank's execution units of the plan, from the global batch every rank holds.

        pack_group_samples: pack all samples of a CP group into one unit (default: as the plan's
        scheduler executes). BatchMismatchError unless the batch is the one the plan was made for;
        ArgumentTypeError for what is not a batch.
        """
        _require_plan(plan)
        _require_int("pad_token_id", pad_token_id, 0, what="a token id")
        if pack_group_samples not in (None, True, False):
            raise ArgumentTypeError(f"pack_group_samples: got {pack_group_samples!r}; expected None, True or False")
        global_batch = batch if isinstance(batch, GlobalBatch) else unbind_batch(batch)
        self.planned_batches.check(plan, global_batch.lengths, global_batch.lengths_bytes)
        given = {} if isinstance(batch, GlobalBatch) else {"batch": batch}
        check_dynamic_cp_support(planner_config=self.config, plan=plan, **given, **self._trainer_configs)
        resolver = self._cp_groups
        if resolver == "megatron":
            resolver = megatron_cp_group_resolver(plan, self.group)
        return micro_batches_for_rank(plan, global_batch, self.rank, resolver, pad_token_id, pack_group_samples)

    def check_planned_batch(self, plan: Plan, lengths: Sequence[int]) -> None:
        """BatchMismatchError unless `lengths` (a batch's, in sample order) are those `plan`, one of
        this client's last plans, was made for: what `micro_batches` checks, for drop-ins that
        apply plans themselves."""
        _require_plan(plan)
        self.planned_batches.check(plan, lengths)

    def restore_outputs(self, plan: Plan, local_outputs: Mapping[int, Any]) -> list[Any]:
        """Per-sample outputs of this rank's led samples -> every sample's output, in sample order."""
        _require_plan(plan)
        num_samples = sum(len(g.sample_ids) for mb in plan.micro_batches for g in mb.cp_groups)
        return restore_outputs(local_outputs, num_samples, self.group if is_distributed(self.group) else None)

    def restore_token_outputs(self, pieces: Sequence[TokenPiece], lengths: Sequence[int]) -> list[Any]:
        """Per-token outputs of this rank's shards (see `token_pieces`) -> `[L, ...]` per sample, in order."""
        return restore_token_outputs(pieces, lengths, self.group if is_distributed(self.group) else None)

    def record_step(self, micro_batches: Sequence[RankMicroBatch], seconds: float) -> None:
        """Counts this rank's real and padding tokens and the step time."""
        _check_record_step(micro_batches, seconds)
        m, job = self.metrics, self.metrics.job
        real = sum(mb.real_local_tokens for mb in micro_batches)
        m.tokens.labels(job).inc(real)
        m.padding_tokens.labels(job).inc(sum(mb.padding_local_tokens for mb in micro_batches))
        m.step_time.labels(job).observe(seconds)
        if seconds > 0:
            m.tokens_per_second.labels(job).set(real / seconds)

    def timed(self, unit: RankMicroBatch, cuda: bool | None = None) -> Any:
        """`with client.timed(unit): forward_backward(unit)` times one execution unit of the step
        last planned, for calibration (a no-op when it is off)."""
        if self.calibration is None:
            return contextlib.nullcontext()
        return self.calibration.timed(unit, cuda)

    def record_unit(self, unit: RankMicroBatch, seconds: float) -> None:
        """A unit the trainer timed itself (seconds of its forward+backward on this rank)."""
        if self.calibration is not None:
            self.calibration.record(unit, seconds)

    def end_step(self) -> CalibrationReport | None:
        """Ends the step last planned, for calibration; at some steps gathers the timed units and
        refits. A collective: every rank calls it after each step's units ran. Returns what the
        gather found, or None."""
        return None if self.calibration is None else self.calibration.end_step()

    def serve_metrics(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serves this client's registry on http://addr:port/metrics; returns the bound port."""
        server, _ = start_http_server(port, addr=addr, registry=self.metrics.registry)
        return server.server_port

    def close(self) -> None:
        """Stops the read-ahead threads and the service's channel (once; later calls do nothing).
        A client left open closes when the interpreter exits."""
        self._closer()

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def __enter__(self) -> BatchPlannerClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _close_parts(ahead: PlanAhead, source: PlanSource) -> None:
    ahead.close()
    source.close()


def checked_lengths(lengths: Any) -> tuple[int, ...]:
    """A batch's lengths as ints by the server's own rule (`batch_planner.validation.
    sequence_lengths_of`), or the PlanRejectedError (INVALID_ARGUMENT) the server would answer."""
    try:
        return sequence_lengths_of(lengths)
    except InvalidRequestError as error:
        raise PlanRejectedError(error.code.value, str(error)) from None


def _tp_sharing(tp_group: Any, leads: bool) -> tuple[Any, bool]:
    """(the TP group to share the planner's answers over, or None; whether this rank receives
    them): the group when every rank of it leads its DPxCP group, None when none does (a
    collective over `tp_group`). InvalidArgumentError on every rank of a group where only some lead."""
    if tp_group is None or not is_distributed(tp_group):
        return None, False
    everyone = fail_together(None, tp_group, leads)
    if not any(everyone):
        return None, False
    if not all(everyone):
        raise InvalidArgumentError(
            f"tp_group: TP ranks {[r for r, lead in enumerate(everyone) if lead]} lead their DPxCP groups and "
            f"{[r for r, lead in enumerate(everyone) if not lead]} do not, so the TP ranks of one DPxCP rank are not "
            "one TP group; pass Megatron-Core's tensor-parallel group, or leave tp_group unset"
        )
    return tp_group, dist.get_rank(tp_group) != 0


def _group_layout(group: Any, dp_cp_size: Any, rank: Any) -> tuple[int, int]:
    """(DPxCP size, this rank) from the process group, or from the arguments without one."""
    if dist.is_available() and dist.is_initialized():
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if me < 0:
            raise InvalidArgumentError("group: this process is not a member of the DPxCP group it was given")
        for name, given, actual in (("dp_cp_size", dp_cp_size, size), ("rank", rank, me)):
            if given is not None and given != actual:
                raise InvalidArgumentError(f"{name}: {given!r} is not this process's: the process group says {actual}; leave it unset")
        return size, me
    if dp_cp_size is None:
        raise InvalidArgumentError("dp_cp_size: torch.distributed is not initialised: pass dp_cp_size (and rank) explicitly")
    _require_int("dp_cp_size", dp_cp_size, 1, what="the ranks of the DPxCP group")
    if rank is not None:
        _require_int("rank", rank, 0, dp_cp_size - 1, what=f"a rank of the dp_cp_size={dp_cp_size} group")
    return dp_cp_size, rank or 0


def _require_int(name: str, value: Any, low: int, high: int | None = None, *, what: str) -> None:
    """ArgumentTypeError unless `value` is an int (a bool is not), InvalidArgumentError unless it is in low..high."""
    allowed = f"an int >= {low}" if high is None else f"an int in {low}..{high}"
    if type(value) is not int:
        raise ArgumentTypeError(f"{name}: got {value!r:.60} ({type(value).__name__}); expected {allowed} ({what})")
    if value < low or (high is not None and value > high):
        raise InvalidArgumentError(f"{name}: {value} is not allowed; expected {allowed} ({what})")


def _check_step(step: Any) -> None:
    _require_int("step", step, 0, what="the training step")


def _require_plan(plan: Any) -> None:
    if not isinstance(plan, Plan):
        raise ArgumentTypeError(f"plan: got a {type(plan).__name__}; expected the Plan plan_step returned")


def _kind_of(value: Any) -> str:
    """A one-line name of what was given: its type, and for a sequence the first item's that is not a unit."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        odd = next((item for item in value if not isinstance(item, RankMicroBatch)), None)
        if odd is not None:
            return f"a {type(value).__name__} holding a {type(odd).__name__}"
    return f"a {type(value).__name__}"


def _unavailable(error: Exception) -> PlannerUnavailableError:
    """Any other failure of the asking rank (a TlsMismatchError, a bug) as the error every rank of
    the group raises: raised on the asking rank alone, it would leave the others waiting."""
    unavailable = PlannerUnavailableError(f"could not plan this step: {type(error).__name__}: {error}")
    unavailable.__cause__ = error
    return unavailable


def _check_record_step(micro_batches: Any, seconds: Any) -> None:
    if isinstance(micro_batches, (str, bytes)) or not isinstance(micro_batches, Sequence) or not all(
        isinstance(mb, RankMicroBatch) for mb in micro_batches
    ):
        raise ArgumentTypeError(f"micro_batches: got {_kind_of(micro_batches)}; expected the RankMicroBatches micro_batches() returned")
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise ArgumentTypeError(f"seconds: got {seconds!r:.60} ({type(seconds).__name__}); expected a number of seconds >= 0")
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgumentError(f"seconds: {seconds!r} is not allowed; expected a finite number of seconds >= 0")
