"""`DynamicCPScheduler`: verl 0.9's class (`verl.utils.dynamic_cp_scheduler`), planned by the batch
planner, with the same constructor, `schedule()` arguments and return value (docs/verl.md).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from tensordict import TensorDict

from batch_planner.request import CpLayout
from trainer_client.refusals.compatibility import check
from trainer_client.service.config import PlannerClientConfig
from trainer_client.errors import DropInInputError, ConfigError, InvalidArgumentError
from trainer_client.verl.micro_batches import rank_micro_batches
from trainer_client.service.client import BatchPlannerClient
from trainer_client.verl.planning import planner_for
from trainer_client.verl.refusals import SOURCE
from trainer_client.verl.settings import planner_settings, verl_planner_config


# The configs built so far (a handful per job: one per distinct settings and sizes).
_configs: dict[str, PlannerClientConfig] = {}


class DynamicCPScheduler:
    """Drop-in for `verl.utils.dynamic_cp_scheduler.DynamicCPScheduler`."""

    def __init__(self, max_seqlen_per_dp_cp_rank: int, dp_size: int, cp_size: int):
        for name, value in (("max_seqlen_per_dp_cp_rank", max_seqlen_per_dp_cp_rank), ("dp_size", dp_size), ("cp_size", cp_size)):
            if type(value) is not int or value <= 0:
                raise InvalidArgumentError(f"{name}: {value!r} is not allowed; Dynamic CP scheduler sizes must be positive integers")
        self.max_seqlen_per_dp_cp_rank = max_seqlen_per_dp_cp_rank
        self.dp_size = dp_size
        self.cp_size = cp_size
        self.total_ranks = dp_size * cp_size

    def schedule(
        self,
        batch: TensorDict,
        dcp_group,
        *,
        tp_size: int,
        cp_layout: str = "zigzag",
        min_local_rows: int | None = None,
    ) -> list[TensorDict]:
        """This rank's micro-batches of `batch` (replicated on every rank of `dcp_group`); a
        collective over `dcp_group`."""
        layout = _layout(cp_layout)
        config = self._config(tp_size, cp_layout, min_local_rows)  # the settings, checked once
        lengths = self._lengths(batch, dcp_group)
        planner = planner_for(config, dcp_group)
        plan = planner.plan(lengths, cache=True)
        planner.check_planned_batch(plan, lengths)  # the batch split is the one planned
        check({SOURCE: {"tp_size": tp_size, "cp_layout": layout.value}, "plan": plan})  # the step's one check of the table
        return rank_micro_batches(
            batch, plan.micro_batches, lengths, dcp_group.rank(),
            tp_size=tp_size, cp_layout=layout, min_local_rows=min_local_rows,
        )

    def prefetch(self, batches: Sequence[TensorDict], dcp_group, *, tp_size: int, cp_layout: str = "zigzag",
                 min_local_rows: int | None = None) -> None:
        """Starts planning each of `batches` (e.g. every mini-batch of a rollout batch, as soon as
        it exists) in the background, so that `schedule` finds the plans ready (with the same
        arguments). Not a collective: only the asking rank plans; any rank may call it."""
        planner = self.planner(dcp_group, tp_size=tp_size, cp_layout=cp_layout, min_local_rows=min_local_rows)
        planner.prefetch_batches([self._lengths(b, dcp_group) for b in batches])

    def planner(self, dcp_group, *, tp_size: int, cp_layout: str = "zigzag", min_local_rows: int | None = None) -> BatchPlannerClient:
        """The planner (client, cache, metrics) this process uses for `dcp_group` and these sizes."""
        return planner_for(self._config(tp_size, cp_layout, min_local_rows), dcp_group)

    def _config(self, tp_size: int, cp_layout: str, min_local_rows: int | None = None):
        """The client config of these settings and sizes: built and checked once, not on every call
        (keyed by its arguments' repr: settings from YAML may hold lists, and bad arguments must reach
        the checks that name them)."""
        if min_local_rows is not None and (type(min_local_rows) is not int or min_local_rows <= 0):
            raise InvalidArgumentError(f"min_local_rows: {min_local_rows!r} is not allowed; expected None or a positive integer")
        settings = planner_settings()
        key = repr((settings, self.max_seqlen_per_dp_cp_rank, self.cp_size, tp_size, cp_layout, min_local_rows))
        if key not in _configs:
            _configs[key] = verl_planner_config(settings, max_seqlen_per_dp_cp_rank=self.max_seqlen_per_dp_cp_rank,
                                                cp_size=self.cp_size, tp_size=tp_size, cp_layout=_layout(cp_layout),
                                                min_local_rows=min_local_rows)
        return _configs[key]

    def _lengths(self, batch: TensorDict, dcp_group: Any) -> list[int]:
        input_ids = batch.get("input_ids", None)
        if not isinstance(input_ids, torch.Tensor) or not input_ids.is_nested:
            raise DropInInputError(
                f"input_ids: {type(input_ids).__name__} is not allowed; Dynamic CP requires input_ids to be a "
                "jagged NestedTensor"
            )
        if len(batch) == 0:
            raise DropInInputError("batch: 0 samples is not allowed; Dynamic CP cannot schedule an empty batch")
        if dcp_group.size() != self.total_ranks:
            raise InvalidArgumentError(
                f"dcp_group: DPxCP group size {dcp_group.size()} does not match dp_size * cp_size "
                f"({self.dp_size} * {self.cp_size})"
            )
        lengths = [int(n) for n in input_ids.offsets().diff().tolist()]
        empty = [i for i, n in enumerate(lengths) if n <= 0]
        if empty:
            raise DropInInputError(f"input_ids: samples {empty} have no token; Dynamic CP requires every input sequence to contain at least one token")
        longest = max(lengths)
        needed = math.ceil(longest / self.max_seqlen_per_dp_cp_rank)
        if needed > self.total_ranks:
            raise DropInInputError(
                f"input_ids: a sequence with {longest} tokens needs at least {needed} ranks at "
                f"max_seqlen_per_dp_cp_rank={self.max_seqlen_per_dp_cp_rank}, but the DPxCP group only has "
                f"{self.total_ranks} ranks; allowed: sequences of at most "
                f"{self.total_ranks * self.max_seqlen_per_dp_cp_rank} tokens"
            )
        return lengths


def _layout(cp_layout: str) -> CpLayout:
    try:
        return CpLayout(cp_layout)
    except ValueError:
        raise ConfigError(
            f"cp_layout: {cp_layout!r} is not allowed; Unsupported context parallel layout, allowed: "
            f"{[layout.value for layout in CpLayout]}"
        ) from None
