"""A drop-in for a plain PyTorch training loop, built only from the seam (`trainer_client.dropin`).

Each step the batch planner plans the global batch with dynamic context parallelism (every
micro-batch gives its samples their own CP group size), and each rank gets its own packed THD
units (`RankMicroBatch`), each with the `PackedSeqParams`, CP group included, that a Megatron-Core
model takes:

    groups, cp_groups = dpxcp_groups(cp_size=2)            # after dist.init_process_group
    with PlannedLoader(my_batches, groups, cp_groups, max_seqlen_per_dp_cp_rank=4096) as loader:
        for units in loader:                               # one step: this rank's units
            for unit in units:
                per_token = model(**model_inputs(unit))
                ...                                        # the loss, normalised over the global batch
            ...                                            # reduce gradients over DPxCP, step

The seam reads one step ahead, plans it while the current step trains, agrees on it over the
ranks, routes each sample to the ranks that run it, and pads and shards it. What a plain loop
writes itself, and this module is:

1. its batch read into a `LocalBatch` (`PlannedLoader._read_local`): `my_batches` yields, per
   step, this DP rank's samples, each a dict of 1-D per-token tensors (tokens, labels, loss_mask,
   anything else to carry along);
2. the settings the loop fixes (`derived_settings`): the per-rank token budget, the CP and TP
   sizes, the scheduler, the padding rule and CP layout its attention takes;
3. the process groups (`dpxcp_groups`): `DataGroups` over DPxCP in Megatron's rank order
   (rank = dp_rank * cp + cp_rank), and a CP group of every size a plan may use (`cp_groups_for`);
4. the model's arguments of a unit on the model's device (`model_inputs`), and the loop itself:
   the loss of each unit normalised over the global batch's loss tokens, gradients all-reduced
   over DPxCP (tests/test_example_plain_torch_dropin.py runs one, against whole samples).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from batch_planner.cp_groups import megatron_cp_group_sizes
from trainer_client.dropin import (
    DataGroups, LocalBatch, PlannedStep, StepPlanner, given_planner_settings, model_device, planner_config, rank_units,
)
from trainer_client.micro_batch import RankMicroBatch

CU_SEQLENS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def cp_groups_for(dp_cp_ranks: list[int]) -> dict[int, Any]:
    """This rank's CP group of every size a plan over `dp_cp_ranks` may use (size 1 included: the
    model's dynamic-CP attention and RoPE ask for a group even there). A plan's group of size s
    covers an aligned block of s ranks, as Megatron-Core's dynamic groups do; `dist.new_group` is
    collective, so every rank creates every block's group, in the same order."""
    mine: dict[int, Any] = {}
    for size in sorted(megatron_cp_group_sizes(len(dp_cp_ranks))):
        for first in range(0, len(dp_cp_ranks) - size + 1, size):
            block = dp_cp_ranks[first:first + size]
            group = dist.new_group(block)
            if dist.get_rank() in block:
                mine[size] = group
    return mine


def dpxcp_groups(cp_size: int) -> tuple[DataGroups, dict[int, Any]]:
    """The groups of a loop whose whole world is DPxCP (no TP, no pipeline), in Megatron's rank order:
    DP rank d holds ranks d * cp .. d * cp + cp - 1, its CP siblings, which load the same samples."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp_groups = [dist.new_group(list(range(cp_rank, world, cp_size))) for cp_rank in range(cp_size)]  # same CP rank
    # tp: read only where every TP rank reads a step (StepPlanner's every_tp_rank_reads); no TP here.
    groups = DataGroups(dp_cp=dist.group.WORLD, dp=dp_groups[rank % cp_size], tp=None, pp=None)
    return groups, cp_groups_for(list(range(world)))


def derived_settings(max_seqlen_per_dp_cp_rank: int, cp_size: int, cp_layout: str) -> dict[str, Any]:
    """What the loop fixes, whatever the planner settings say (a conflict raises ConfigError):
    dynamic CP, padded as Transformer Engine's THD attention needs it (every sequence of a CP
    group to a multiple of 2 x CP)."""
    return {
        "max_seqlen_per_dp_cp_rank": max_seqlen_per_dp_cp_rank, "context_parallel_size": cp_size,
        "tensor_parallel_size": 1, "scheduler": "dynamic_cp", "padding": "megatron_core", "cp_layout": cp_layout,
    }


class PlannedLoader:
    """Iterates over the steps of `data_iterator` (this DP rank's samples of each step), yielding
    this rank's planned units of each. `planner`: the planner settings (a dict or
    PlannerClientConfig; None: `$BATCH_PLANNER_CONFIG`, else in-process planning)."""

    def __init__(self, data_iterator: Iterable[list[dict[str, torch.Tensor]]], groups: DataGroups, cp_groups: dict[int, Any], *,
                 max_seqlen_per_dp_cp_rank: int, cp_layout: str = "zigzag", planner: Any = None) -> None:
        self.data_iterator = iter(data_iterator)
        self.groups = groups
        self.cp_groups = cp_groups
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
            yield rank_units(self.last_step, self.groups.dp_cp.rank(), self.cp_groups.__getitem__)

    def close(self) -> None:
        """Stops the planner client (its threads, its channel)."""
        self.planner.close()

    def __enter__(self) -> PlannedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def model_inputs(unit: RankMicroBatch, device: torch.device | None = None) -> dict[str, Any]:
    """A Megatron-Core GPTModel's forward arguments for one unit, on `device` (default: the model's,
    `model_device()`): `[1, rows]` tensors and the unit's PackedSeqParams with its cu_seqlens there
    too. Padding rows hold token 0 and loss_mask 0, so a loss over loss_mask counts real tokens only;
    position_ids are each row's place in its padded sequence."""
    device = device or model_device()
    params = unit.packed_seq_params
    moved = {name: getattr(params, name).to(device) for name in CU_SEQLENS}
    fields = unit.token_fields
    return {
        "input_ids": fields["tokens"].to(device)[None], "position_ids": unit.position_ids.to(device)[None],
        "labels": fields["labels"].to(device)[None], "loss_mask": fields["loss_mask"].to(device)[None],
        "attention_mask": None, "packed_seq_params": dataclasses.replace(params, **moved),
    }
