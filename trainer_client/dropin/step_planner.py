"""Reading one global batch ahead and planning it while the current step trains.

While step k is handed out, the local part of step k+1 is already read from the wrapped iterator
and its lengths are all-gathered, so the plan for k+1 is made while step k trains. Memory: at most
two local batches (this rank's share of steps k and k+1) per rank, never a global one.

Where every TP rank reads and plans the same batch (Megatron-Bridge), `tp_agreement` is the TP
group: its ranks first agree that each read the step (`agree_on_read`), then that each holds the
same plan for it, or every one of them raises the same error, before any enters the model's TP
collectives."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from batch_planner.plan import Plan
from trainer_client import megatron as mcore
from trainer_client.client import BatchPlannerClient
from trainer_client.compatibility import check_dynamic_cp_support
from trainer_client.dropin.routing import Traffic, route_samples, sample_id_groups
from trainer_client.dropin.step_input import GlobalLayout, LocalBatch, ReadStep, agree_on_read, agree_on_step
from trainer_client.errors import DropInInputError, PlanMismatchError, PlanRejectedError
from trainer_client.together import fail_together

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


@dataclass
class StepPlanner:
    """Reads step k+1 while step k is handed out, plans it ahead, and routes step k's samples,
    after checking that the plan is the one made for them (trainer_client/batch_check.py)."""

    read_local: Callable[[], LocalBatch]  # raises StopIteration at the end of the data
    groups: mcore.DataGroups
    client: BatchPlannerClient
    transformer_config: Any = None
    # The TP group when every TP rank reads and plans each step (Bridge; the client then shares the
    # planner's answer over TP): all of them plan a step or none, and all hold the same plan.
    # None: only TP rank 0 reads (Megatron-LM), no agreement over TP.
    tp_agreement: Any = None
    _ahead: ReadStep | None = field(default=None, init=False)
    _step: int = field(default=0, init=False)

    def next_step(self) -> PlannedStep:
        if self.tp_agreement is None:
            return self._plan_and_route(self._next_read())
        try:
            current, failure = self._next_read(), None
        except StopIteration as end:
            current, failure = None, end
        except Exception as error:  # noqa: BLE001 - agreed on over the group first, then raised
            current, failure = None, error
        agree_on_read(failure, self.tp_agreement)
        assert current is not None
        planned, failure = None, None
        try:
            planned = self._plan_and_route(current)
        except Exception as error:  # noqa: BLE001 - travels to the other TP ranks, then raised on all
            failure = error
        plan_ids = fail_together(
            failure, self.tp_agreement, planned.plan.plan_id if planned else None,
            context="TP rank {rank} could not plan this step: {message}",
        )
        if len(set(plan_ids)) > 1:
            raise PlanMismatchError(f"the TP ranks hold different plans for this step: {plan_ids}")
        assert planned is not None
        return planned

    def _next_read(self) -> ReadStep:
        """The step to plan now, with the step after it read ahead; StopIteration at the end of the
        data, DropInInputError for a step that cannot run."""
        current = self._ahead if self._ahead is not None else self._read(self._step)
        self._ahead = None
        if current.exhausted:
            raise StopIteration
        self._step = current.step + 1
        if current.error is None:
            self._ahead = self._read(current.step + 1)  # one global batch ahead: its plan is made while this step trains
        if current.error is not None:
            raise DropInInputError(current.error)
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
        assert current.layout is not None and current.local is not None
        plan = self.client.plan_step(current.step, list(current.layout.padded))
        self.client.check_planned_batch(plan, current.layout.padded)  # the batch routed is the one planned
        check_dynamic_cp_support(planner_config=self.client.config, transformer_config=self.transformer_config, plan=plan)
        id_groups = sample_id_groups(plan)
        traffic = Traffic()
        samples = route_samples(current.local, current.layout, self.groups, id_groups, traffic)
        return PlannedStep(current.step, plan, id_groups, samples, current.layout, traffic, self.client.last_source)

    def close(self) -> None:
        self.client.close()
