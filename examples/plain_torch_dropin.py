"""A drop-in for a plain PyTorch training loop, built only from the seam (`trainer_client.dropin`).

Each step the batch planner plans the global batch with dynamic context parallelism (every
micro-batch gives its samples their own CP group size), and each rank gets its own packed THD
units (`RankMicroBatch`), each with the `PackedSeqParams`, CP group included, that a Megatron-Core
model takes:

    groups, cp_group_for = dpxcp_groups(cp_size=2)         # after dist.init_process_group
    with PlannedLoader(my_batches, groups, cp_group_for, max_seqlen_per_dp_cp_rank=4096) as loader:
        for units in loader:                               # one step: this rank's units
            for unit in units:
                per_token = model(**model_inputs(unit).megatron_kwargs())
                ...                                        # the loss, normalised over the global batch
            ...                                            # reduce gradients over DPxCP, step

The seam reads one step ahead, plans it while the current step trains, agrees on it over the
ranks, routes each sample to the ranks that run it, and pads and shards it; it builds the process
groups of a world without Megatron-Core's parallel_state (`dpxcp_groups`: DPxCP, TP and pipeline
groups in Megatron's rank order, and a CP group of every size a plan may use). What a plain loop
writes itself, and this module is:

1. its batch read into a `LocalBatch` (`PlannedLoader._read_local`): `my_batches` yields, per
   step, this DP rank's samples, each a dict of 1-D per-token tensors (tokens, labels, loss_mask,
   anything else to carry along);
2. the settings the loop fixes (`derived_settings`): the per-rank token budget, the CP and TP
   sizes, the scheduler, the padding rule and CP layout its attention takes;
3. the loop itself: each unit's model inputs (the seam's `model_inputs`: on the model's device,
   `[1, rows]` tensors and the PackedSeqParams, or plain cu_seqlens for a model without
   Megatron-Core), the loss of each unit normalised over the global batch's loss tokens, gradients
   all-reduced over DPxCP (tests/examples/test_plain_torch_dropin.py runs one, against whole samples).
4. the drop-in as one object (`PLAIN_TORCH`), registered at import: its refusal-table source (no
   rows of its own: the core's apply), settings and reader; it replaces nothing of a trainer's, so
   it has no hooks and no version gate.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from trainer_client.dropin import (
    DataGroups, DerivedSettings, DropIn, LocalBatch, PlannedStep, RankMicroBatch, StepPlanner, TableSource,
    given_planner_settings, planner_config, rank_units, register_dropin,
)


def derived_settings(max_seqlen_per_dp_cp_rank: int, cp_size: int, cp_layout: str) -> DerivedSettings:
    """What the loop fixes, whatever the planner settings say (a conflict raises ConfigError):
    dynamic CP, padded as Transformer Engine's THD attention needs it (every sequence of a CP
    group to a multiple of 2 x CP)."""
    return DerivedSettings(max_seqlen_per_dp_cp_rank, cp_size, 1, scheduler="dynamic_cp", padding="megatron_core", cp_layout=cp_layout)


class PlannedLoader:
    """Iterates over the steps of `data_iterator` (this DP rank's samples of each step), yielding
    this rank's planned units of each. `planner`: the planner settings (a dict or
    PlannerClientConfig; None: `$BATCH_PLANNER_CONFIG`, else in-process planning)."""

    def __init__(self, data_iterator: Iterable[list[dict[str, torch.Tensor]]], groups: DataGroups,
                 cp_group_for: Callable[[int], Any], *, max_seqlen_per_dp_cp_rank: int, cp_layout: str = "zigzag",
                 planner: Any = None) -> None:
        self.data_iterator = iter(data_iterator)
        self.groups = groups
        self.cp_group_for = cp_group_for
        cp_size = groups.dp_cp.size() // groups.dp.size()
        derived = derived_settings(max_seqlen_per_dp_cp_rank, cp_size, cp_layout)
        config = planner_config(given_planner_settings(planner), derived, "the training loop")
        self.planner = StepPlanner.start(self._read_local, groups, config)
        self.last_step: PlannedStep | None = None  # the plan and samples behind the last units handed out

    def _read_local(self) -> LocalBatch:
        """One step of this DP rank's samples (StopIteration at the end: the seam agrees on it)."""
        return LocalBatch.of(list(next(self.data_iterator)))

    def __iter__(self) -> Iterator[list[RankMicroBatch]]:
        while True:
            try:
                self.last_step = self.planner.next_step()
            except StopIteration:
                return
            yield rank_units(self.last_step, self.groups.dp_cp.rank(), self.cp_group_for)

    def close(self) -> None:
        """Stops the planner client (its threads, its channel)."""
        self.planner.close()

    def __enter__(self) -> PlannedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



PLAIN_TORCH = register_dropin(DropIn(
    refusals=TableSource("plain_torch", "the plain PyTorch loop's drop-in"), package=__name__, settings=derived_settings,
    readers=(PlannedLoader._read_local,),
))
