"""A planned step as execution units (`RankMicroBatch`, trainer_client/plans/apply.py): the format of a
drop-in whose trainer runs one packed THD micro-batch per planned group with its own CP group
(Bridge's, and any loop that takes `PackedSeqParams` or plain cu_seqlens: their model inputs are
trainer_client/dropin/model_inputs.py's). Megatron-LM's drop-in hands the engine
Megatron-Core's own packed micro-batches instead (its `build_packed_microbatches`), and verl's hands
verl's TensorDicts: each engine format has its one path."""

from __future__ import annotations

from typing import Any

import torch

from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.batch import GlobalBatch, JaggedField
from trainer_client.dropin.step_input import GlobalLayout
from trainer_client.dropin.step_planner import PlannedStep
from trainer_client.plans.micro_batch import RankMicroBatch


def rank_units(step: PlannedStep, dp_cp_rank: int, cp_group_for: Any, *, packed_seq_params: bool = True) -> list[RankMicroBatch]:
    """This rank's planned units of `step`: one packed unit per micro-batch of the plan, from the
    samples routed to this rank; `cp_group_for(size)` gives the process group of each CP size.
    `packed_seq_params`: each unit carries Megatron-Core's PackedSeqParams; False: none (the unit's
    `cu_seqlens`, `cu_seqlens_padded` and `cp_group` only, for a loop without Megatron-Core)."""
    batch = routed_batch(step.samples, step.layout)
    return micro_batches_for_rank(step.plan, batch, dp_cp_rank, cp_group_for, pad_token_id=0, pack_group_samples=True,
                                  with_packed_seq_params=packed_seq_params)


def routed_batch(samples: dict[int, dict[str, torch.Tensor]], layout: GlobalLayout) -> GlobalBatch:
    """The samples routed to this rank as a GlobalBatch of the whole step's lengths (samples this
    rank does not run hold no tokens in it; the plan never asks this rank for them)."""
    ids = sorted(samples)
    starts = [0] * len(layout.rows)
    cursor = 0
    for i in ids:
        starts[i] = cursor
        cursor += layout.rows[i]
    token_fields = {
        name: JaggedField(_cat([samples[i][name] for i in ids], dtype, trailing), tuple(starts))
        for name, dtype, trailing in layout.fields
    }
    return GlobalBatch(layout.rows, token_fields, {})


def _cat(pieces: list[torch.Tensor], dtype: torch.dtype, trailing: tuple[int, ...]) -> torch.Tensor:
    return torch.cat(pieces) if pieces else torch.empty((0, *trailing), dtype=dtype)
