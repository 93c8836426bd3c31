"""The drop-in for Megatron-LM 0.19.x (`--hybrid-context-parallel`): HybridCPDataLoaderWrapper."""

from __future__ import annotations

from batch_planner.request import SchedulerKind
from trainer_client.plans import megatron as mcore
from trainer_client.service.client import BatchPlannerClient
from trainer_client.service.config import PlannerClientConfig
from trainer_client.dropin.step_input import LocalBatch, raise_on_bad_packed_sample
from trainer_client.dropin.step_planner import PlannedStep, StepPlanner
from trainer_client.megatron_lm.checks import start_planner
from trainer_client.megatron_lm.version import require


class HybridCPDataLoaderWrapper:
    """Drop-in for `megatron.core.datasets.data_schedule.HybridCPDataLoaderWrapper`: its arguments and
    what `next()` yields (docs/megatron-lm.md, "What stays the same"), plus the keyword `planner`. Each DP
    rank's `data_iterator` yields a list of packed samples (dicts with `cu_seqlens` and 1-D per-token fields)."""

    def __init__(self, data_iterator, config, pg_collection=None, *, planner: PlannerClientConfig | dict | None = None):
        if data_iterator is not None:
            require("HybridCPDataLoaderWrapper")  # the upstream names it calls outside Megatron-Core's public API
        self.data_iterator = data_iterator
        self.config = config
        self.groups = mcore.DataGroups.of(pg_collection)
        self.total_hdp_gpus = self.groups.dp_cp.size()
        self.last_step: PlannedStep | None = None
        self._planner: StepPlanner | None = None
        if data_iterator is not None:
            self._planner = start_planner(self._read_local, config, SchedulerKind.HYBRID_CP, self.groups, planner)

    @property
    def client(self) -> BatchPlannerClient | None:
        return self._planner.client if self._planner else None

    def __iter__(self):
        return self

    def __next__(self):
        if self._planner is None:
            return None, None  # TP ranks > 0: Megatron-Core broadcasts within the TP group
        self.last_step = self._planner.next_step()
        return self.last_step.samples, self.last_step.sample_id_groups

    def _read_local(self) -> LocalBatch:
        batch = next(self.data_iterator)
        for index, sample in enumerate(batch):
            raise_on_bad_packed_sample(sample, index)
        return LocalBatch.of(mcore.unpack_hybrid_cp_batch(batch))

    def close(self) -> None:
        """Stops the planner client (one left open stops at the interpreter's exit)."""
        if self._planner is not None:
            self._planner.close()

    def __enter__(self) -> HybridCPDataLoaderWrapper:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
