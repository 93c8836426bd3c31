"""A planned step as execution units (`RankMicroBatch`, trainer_client/apply.py): the format of a
drop-in whose trainer runs one packed THD micro-batch per planned group with its own CP group
(Bridge's, and any loop that takes `PackedSeqParams`). Megatron-LM's drop-in hands the engine
Megatron-Core's own packed micro-batches instead (its `build_packed_microbatches`), and verl's hands
verl's TensorDicts: each engine format has its one path."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trainer_client.apply import micro_batches_for_rank
from trainer_client.batch import GlobalBatch, JaggedField
from trainer_client.dropin.step_input import GlobalLayout
from trainer_client.dropin.step_planner import PlannedStep
from trainer_client.micro_batch import RankMicroBatch


def rank_units(step: PlannedStep, dp_cp_rank: int, cp_group_for: Any) -> list[RankMicroBatch]:
    """This rank's planned units of `step`: one packed unit per micro-batch of the plan, from the
    samples routed to this rank; `cp_group_for(size)` gives the process group of each CP size."""
    batch = routed_batch(step.samples, step.layout)
    return micro_batches_for_rank(step.plan, batch, dp_cp_rank, cp_group_for, pad_token_id=0, pack_group_samples=True)


def packed_seq_params_on(unit: RankMicroBatch, device: torch.device) -> Any:
    """The unit's PackedSeqParams with its cu_seqlens on `device` (q and kv share their tensors: one copy each)."""
    params, copies = unit.packed_seq_params, {}
    names = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
    return dataclasses.replace(params, **{n: copies.setdefault(id(getattr(params, n)), getattr(params, n).to(device)) for n in names})


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
