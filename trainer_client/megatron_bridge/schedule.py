"""Megatron-Core's forward-backward function, fed the planned micro-batches of the read-ahead planner of
each of Bridge's data iterators; a rerun of a step gets the same units again (docs/megatron-bridge.md,
"What it does in Bridge's loop")."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from batch_planner.request import SchedulerKind
from trainer_client.plans import megatron as mcore
from trainer_client.dropin.device import model_device
from trainer_client.dropin.step_planner import PlannedStep, StepPlanner
from trainer_client.dropin.units import rank_units
from trainer_client.megatron_bridge.micro_batches import PlannedMicroBatches, read_local_batch
from trainer_client.megatron_bridge.settings import BridgeSettings
from trainer_client.plans.micro_batch import RankMicroBatch


@dataclass
class PlannedIterator:
    """One of Bridge's data iterators (training or evaluation) and its read-ahead planner."""

    data_iterator: Any
    num_microbatches: int
    groups: mcore.DataGroups
    settings: BridgeSettings
    planner: StepPlanner = field(init=False)
    last_step: PlannedStep | None = None
    last_units: list[RankMicroBatch] = field(default_factory=list)
    steps: int = 0  # steps handed out (reruns not counted)
    reruns: int = 0  # calls that re-ran the last step

    def __post_init__(self) -> None:
        # Every TP rank and every pipeline stage reads and plans each step (TP rank 0 asks the planner
        # for all TP ranks); each group agrees on the plan before the model runs.
        self.planner = StepPlanner.start(
            self._read_local, self.groups, self.settings.planner, transformer_config=self.settings.model, every_tp_rank_reads=True
        )

    def _read_local(self):
        return read_local_batch([next(self.data_iterator) for _ in range(self.num_microbatches)])

    def units_for(self, rerun: bool) -> list[RankMicroBatch]:
        if rerun and self.last_step is not None:
            self.reruns += 1
            return self.last_units
        step = self.last_step = self.planner.next_step()
        resolver = self._cp_group_resolver(step)
        self.last_units = rank_units(step, self.groups.dp_cp.rank(), resolver)
        self.steps += 1
        return self.last_units

    def _cp_group_resolver(self, step: PlannedStep) -> Callable[[int], Any]:
        if self.settings.scheduler is SchedulerKind.STATIC_PACKING:
            return lambda size: mcore.static_cp_group()  # static packing plans groups of the static CP size only
        return mcore.megatron_cp_group_resolver(step.plan, self.groups.dp_cp)

    def close(self) -> None:
        self.planner.close()


class ChunkIterators(list):
    """What Bridge's `make_data_iterator_list` gives the schedule with the drop-in on and several model
    chunks: one entry per chunk, each the chunks' one data iterator (`source`), read once per step;
    `unplanned()` is Bridge's own list, for calls the drop-in does not plan."""

    def __init__(self, source: Any, chunks: int, unplanned: Callable[[], Any]):
        super().__init__([source] * chunks)
        self.source = source
        self.unplanned = unplanned


class PlannedForwardBackward:
    """`forward_backward_func` with the planned units and their count in place of Bridge's."""

    def __init__(self, inner: Callable[..., Any], dropin: Any):
        self.inner = inner
        self.dropin = dropin

    def __call__(self, **kwargs: Any) -> Any:
        data_iterator = kwargs.get("data_iterator")
        chunks = data_iterator if isinstance(data_iterator, ChunkIterators) else None
        source = chunks.source if chunks is not None else data_iterator
        if source is None or kwargs.get("collect_non_loss_data"):
            # Nothing to plan; or Bridge's non-loss evaluation, which runs on the last rank alone.
            if chunks is not None:
                kwargs["data_iterator"] = chunks.unplanned()
            return self.inner(**kwargs)
        planned = self.dropin.planned_iterator(source, kwargs["num_microbatches"], kwargs.get("pg_collection"))
        rerun = not kwargs.get("forward_only", False) and mcore.in_rerun()
        units = planned.units_for(rerun)
        device = model_device()
        # Virtual stages: each chunk iterates over every unit, and Bridge's get_batch takes what its stage
        # reads. (Megatron-LM's drop-in hands Megatron-Core's packed micro-batches to upstream's own
        # create_data_iterator with StageData's vpp_needs_data: another engine format, its own feed.)
        if chunks is not None:
            iterators: Any = [PlannedMicroBatches(units, device) for _ in chunks]
        else:
            iterators = PlannedMicroBatches(units, device)
        kwargs.update(data_iterator=iterators, num_microbatches=len(units))
        with _packed_schedule(kwargs["model"]):
            return self.inner(**kwargs)


@contextlib.contextmanager
def _packed_schedule(model: Any) -> Iterator[None]:
    """0.19's `hybrid_context_parallel` flag off for the call, so that the schedule runs the planned units
    as any packed micro-batches, not through 0.19's own hybrid-CP loop (docs/megatron-bridge.md, "Versions")."""
    config = mcore.model_config_of(model[0] if isinstance(model, list) else model)
    release_flag = getattr(config, "hybrid_context_parallel", False) and not hasattr(config, "dynamic_context_parallel")
    if release_flag:
        config.hybrid_context_parallel = False
    try:
        yield
    finally:
        if release_flag:
            config.hybrid_context_parallel = True
