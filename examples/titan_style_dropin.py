"""A drop-in for a torchtitan-style loop, built only from the seam (`trainer_client.dropin`) and the
client: the trainer's `train()` hands `Trainer.train_step(data_iterator)` its data iterator, and each
step pulls one list of samples from it (this DP rank's part of the global batch, each sample a dict
of 1-D per-token tensors: tokens, labels, loss_mask, anything else to carry along).

    groups, cp_group_for = dpxcp_groups(cp_size=2)           # after dist.init_process_group
    enable(Trainer, groups, cp_group_for, max_seqlen_per_dp_cp_rank=4096)
    Trainer(...).train()                                     # every train_step trains a planned step
    disable()                                                # the trainer's own train_step again

The hook (`Patches.replace_method`) reads the step from the trainer's iterator (one step ahead: the
seam plans the next step while this one trains, and routes each sample to the ranks that run it),
then calls the trainer's own `train_step` with an iterator of that one step: this rank's planned
units instead of its samples, each as a Megatron-Core model's arguments (`model_inputs`; a model
without Megatron-Core reads `ModelInputs.cu_seqlens` and `cp_group`). The trainer's step runs each
as it runs a sample; what it must do for the step to equal the whole samples: normalise the loss
over the step's loss tokens summed over the DPxCP ranks (padding has loss mask 0) and all-reduce the
gradients over them (tests/examples/test_titan_style_dropin.py trains one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from trainer_client.service.config import PlannerClientConfig
from trainer_client.dropin import (
    DataGroups, DerivedSettings, DropIn, LocalBatch, Patches, PlannedStep, Registry, StepPlanner, TableSource,
    given_planner_settings, model_inputs, planner_config, rank_units, register_dropin,
)


@dataclass
class _Enabled:
    """What `enable` was given, for the hook."""

    trainer: type  # the class whose train_step is hooked
    groups: DataGroups  # dpxcp_groups' (or parallel_state's) groups
    cp_group_for: Callable[[int], Any]  # the CP group of each size
    config: PlannerClientConfig  # the planner settings with what the loop fixes
    last_step: PlannedStep | None = None  # the plan and samples behind the last step trained


_patches = Patches()
_planners: Registry[StepPlanner] = Registry()  # one read-ahead planner per data iterator
_enabled: _Enabled | None = None


def enable(trainer: type, groups: DataGroups, cp_group_for: Callable[[int], Any], *, max_seqlen_per_dp_cp_rank: int,
           cp_layout: str = "zigzag", planner: Any = None) -> _Enabled:
    """Hooks `trainer.train_step`. `planner`: the planner settings (a dict or PlannerClientConfig;
    None: `$BATCH_PLANNER_CONFIG`, else in-process planning)."""
    global _enabled
    derived = derived_settings(max_seqlen_per_dp_cp_rank, groups.dp_cp.size() // groups.dp.size(), cp_layout)
    _enabled = _Enabled(trainer, groups, cp_group_for, planner_config(given_planner_settings(planner), derived, trainer.__name__))
    _patches.replace_method(trainer, "train_step", train_step)
    return _enabled


def derived_settings(max_seqlen_per_dp_cp_rank: int, cp_size: int, cp_layout: str) -> DerivedSettings:
    """What the loop fixes: dynamic CP, padded as Transformer Engine's THD attention needs it."""
    return DerivedSettings(max_seqlen_per_dp_cp_rank, cp_size, 1, scheduler="dynamic_cp", padding="megatron_core", cp_layout=cp_layout)


def read(samples: list[dict[str, Any]]) -> LocalBatch:
    """One step's list of samples, as the seam reads it."""
    return LocalBatch.of(list(samples))


def train_step(self: Any, data_iterator: Iterator[list[dict[str, Any]]]) -> Any:
    """The trainer's train_step on this rank's planned units of the step it pulls (StopIteration at the end of the data)."""
    on = _enabled
    planner = _planners.get(data_iterator, lambda: StepPlanner.start(lambda: read(next(data_iterator)), on.groups, on.config))
    on.last_step = planner.next_step()
    units = rank_units(on.last_step, on.groups.dp_cp.rank(), on.cp_group_for)
    return _patches.original(on.trainer, "train_step")(self, iter([[model_inputs(u).megatron_kwargs() for u in units]]))


def disable() -> None:
    """The trainer's own train_step again; closes the planners (their clients' threads and channels)."""
    global _enabled
    _patches.restore()
    _enabled = None
    _planners.close()


# The drop-in as one object, registered at import (which enables nothing): its refusal-table source has
# no rows of its own (its settings fix the scheduler and padding the core rows check).
TITAN_STYLE = register_dropin(DropIn(refusals=TableSource("titan_style", "the torchtitan-style loop's drop-in"), package=__name__,
                                     settings=derived_settings, readers=(read,), enable=enable, disable=disable))
