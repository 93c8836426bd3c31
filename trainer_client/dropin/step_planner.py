"""Reading one global batch ahead and planning it while the current step trains (docs/megatron-lm.md,
"What changes"). The ranks of an `Agreement` (each reads and plans the same step) first agree that each
read the step, then that each holds the same plan, or all raise the same error, before any enters the
model's TP collectives or sends an activation to another stage."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from batch_planner.plan import Plan
from trainer_client.plans import megatron as mcore
from trainer_client.service.client import BatchPlannerClient
from trainer_client.refusals.compatibility import check
from trainer_client.service.config import PlannerClientConfig
from trainer_client.plans.distributed import is_distributed
from trainer_client.dropin.routing import Traffic, route_samples, sample_id_groups
from trainer_client.dropin.step_input import GlobalLayout, LocalBatch, ReadStep, agree_on_read, agree_on_step
from trainer_client.errors import DropInInputError, PlanMismatchError, PlanRejectedError, UsageError
from trainer_client.plans.together import fail_together

log = logging.getLogger(__name__)


@dataclass
class PlannedStep:
    """One step, planned and routed: what the drop-ins hand to Megatron-Core."""

    step: int
    plan: Plan
    sample_id_groups: list[list[list[int]]]
    samples: dict[int, dict[str, torch.Tensor]]
    layout: GlobalLayout
    traffic: Traffic
    source: str | None


@dataclass(frozen=True)
class Agreement:
    """A group whose ranks read and plan the same global batch each on their own, and must train one
    plan: `who` names one of its ranks in errors ("TP rank", "pipeline stage")."""

    group: Any
    who: str

    @classmethod
    def pipeline(cls, groups: mcore.DataGroups) -> tuple[Agreement, ...]:
        """The pipeline stages' agreement, where there are several stages."""
        pp = groups.pp
        return (cls(pp, "pipeline stage"),) if pp is not None and pp.size() > 1 else ()


@dataclass
class StepPlanner:
    """Reads step k+1 while step k is handed out, plans it ahead, and routes step k's samples,
    after checking that the plan is the one made for them (trainer_client/plans/batch_check.py)."""

    read_local: Callable[[], LocalBatch]  # raises StopIteration at the end of the data
    groups: mcore.DataGroups
    client: BatchPlannerClient
    transformer_config: Any = None
    # In the order they agree (the TP group where every TP rank reads, then the stages); empty: none beyond DPxCP.
    agreements: tuple[Agreement, ...] = ()
    _ahead: ReadStep | None = field(default=None, init=False)
    _step: int = field(default=0, init=False)
    _checks: dict[str, Any] = field(default_factory=dict, init=False)  # what the hook was handed this step

    @classmethod
    def start(cls, read_local: Callable[[], LocalBatch], groups: mcore.DataGroups, config: PlannerClientConfig, *,
              transformer_config: Any = None, every_tp_rank_reads: bool = False) -> StepPlanner:
        """A drop-in's read-ahead planner: its client over the DPxCP group, and the agreements its
        ranks need (the TP ranks', where each reads and plans the step; the pipeline stages').
        `transformer_config`: the model's, checked with each step's plan where it is Megatron-Core's
        TransformerConfig. `every_tp_rank_reads`: TP rank 0's DPxCP group then asks the planner for
        every TP rank (BatchPlannerClient's tp_group)."""
        client = BatchPlannerClient(config, group=groups.dp_cp, cp_groups=None, tp_group=groups.tp if every_tp_rank_reads else None)
        tp = (Agreement(groups.tp, "TP rank"),) if every_tp_rank_reads and is_distributed(groups.tp) else ()
        megatron = type(transformer_config).__name__ == "TransformerConfig" or hasattr(transformer_config, "transformer_impl")
        return cls(read_local, groups, client, transformer_config if megatron else None, tp + Agreement.pipeline(groups))

    def next_step(self, checks: dict[str, Any] | None = None) -> PlannedStep:
        """The next step, planned and routed. `checks`: what the drop-in was handed for this step, by
        refusal-table source (e.g. `{"megatron_lm": {...}}`), checked with the plan in the step's one
        `check` of the table."""
        self._checks = checks or {}
        if not self.agreements:
            return self._plan_and_route(self._next_read())
        try:
            current = self._next_read()
        except Exception as error:  # noqa: BLE001 - StopIteration too: agreed on over the groups first, then raised
            for agreement in self.agreements:
                agree_on_read(error, agreement.group, agreement.who)  # raises it (or the end of the data) on every rank
            raise
        for agreement in self.agreements:
            agree_on_read(None, agreement.group, agreement.who)
        try:
            planned = self._plan_and_route(current)
        except Exception as error:  # noqa: BLE001 - travels to the other ranks, then raised on all
            for agreement in self.agreements:
                _fail_on_plan(error, agreement)  # raises it on every rank
            raise
        for agreement in self.agreements:
            _agree_on_plan(planned, agreement)
        return planned

    def _next_read(self) -> ReadStep:
        """The step to plan now, with the step after it read ahead; StopIteration at the end of the
        data, DropInInputError for a step that cannot run."""
        current = self._ahead if self._ahead is not None else self._read(self._step)
        self._ahead = None
        if current.exhausted:
            raise StopIteration
        self._step = current.step + 1
        if current.error is not None:
            raise DropInInputError(current.error)
        self._ahead = self._read(current.step + 1)  # one global batch ahead: its plan is made while this step trains
        return current

    def _read(self, step: int) -> ReadStep:
        """This rank's part of `step`, agreed on over the DPxCP group (`agree_on_step`), whatever
        the data iterator raised: a rank that raised alone would leave the others in that gather."""
        local, error = None, None
        try:
            local = self.read_local()
        except StopIteration:
            pass
        except DropInInputError as problem:
            error = str(problem)
        except Exception as problem:  # noqa: BLE001 - every rank of the group raises it, as DropInInputError
            log.error("reading step %d from the data iterator failed", step, exc_info=True)
            error = f"the data iterator raised {type(problem).__name__}: {problem}"
        read = agree_on_step(step, local, error, self.groups)
        if read.layout is not None:
            try:
                self.client.prefetch(step, list(read.layout.padded))
            except PlanRejectedError:
                pass  # lengths the planner refuses: plan_step refuses them again in this step's turn, on every rank
        return read

    def _plan_and_route(self, current: ReadStep) -> PlannedStep:
        local, layout = current.local, current.layout
        if local is None or layout is None:
            raise UsageError(f"step {current.step} has no batch to plan (its read: error {current.error!r}, "
                             f"end of the data {current.exhausted}); plan only a step next_step read")
        plan = self.client.plan_step(current.step, list(layout.padded))
        self.client.check_planned_batch(plan, layout.padded)  # the batch routed is the one planned
        # The step's one check of the table: the settings, the model, the plan and what the hook was handed.
        check({"planner config": self.client.config, "transformer": self.transformer_config, "plan": plan, **self._checks})
        id_groups = sample_id_groups(plan)
        traffic = Traffic()
        samples = route_samples(local, layout, self.groups, id_groups, traffic)
        return PlannedStep(current.step, plan, id_groups, samples, layout, traffic, self.client.last_source)

    def close(self) -> None:
        self.client.close()


_COULD_NOT_PLAN = " {rank} could not plan this step: {message}"


def _fail_on_plan(failure: BaseException, agreement: Agreement) -> None:
    """This rank's side of `_agree_on_plan` when it could not plan the step: every rank of the
    agreement raises the first failed rank's error."""
    fail_together(failure, agreement.group, None, context=agreement.who + _COULD_NOT_PLAN)


def _agree_on_plan(planned: PlannedStep, agreement: Agreement) -> None:
    """Every rank of the agreement holds the same plan for the step (its micro-batches' samples and
    CP groups), or every one raises: the first failed rank's error (`_fail_on_plan`), or a
    PlanMismatchError naming the step and what each rank holds."""
    digests = fail_together(None, agreement.group, plan_digest(planned), context=agreement.who + _COULD_NOT_PLAN)
    if len(set(digests)) > 1:
        held = "; ".join(f"{agreement.who} {rank}: {digest}" for rank, digest in enumerate(digests))
        raise PlanMismatchError(
            f"the {agreement.who}s hold different plans for this step (step {planned.step}): {held}; every one "
            "must read the same global batch and plan it with the same settings"
        )


def plan_digest(planned: PlannedStep) -> str:
    """The plan a step trains, in words short enough for an error: its micro-batch count and a
    digest of each micro-batch's samples per DPxCP rank (which also fixes its CP groups)."""
    groups = planned.sample_id_groups
    digest = hashlib.sha256(json.dumps(groups).encode()).hexdigest()[:12]
    return f"{len(groups)} micro-batches, samples and CP groups {digest}"
