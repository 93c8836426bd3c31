"""One planned unit (`RankMicroBatch`, trainer_client/dropin/units.py) as the tensors a model takes:
the one home of that step, for every loop that runs the units itself (Bridge's `get_batch`, the
examples' loops). A Megatron-Core model reads `packed_seq_params`; a loop without Megatron-Core
reads the plain `cu_seqlens` tensors and the unit's CP group (units made with
`rank_units(..., packed_seq_params=False)` need no Megatron-Core at all)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from trainer_client.dropin.device import model_device
from trainer_client.errors import UsageError
from trainer_client.plans.micro_batch import RankMicroBatch

# The PackedSeqParams fields that hold tensors (q and kv share theirs: moved once each).
_CU_SEQLENS_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


@dataclass(frozen=True)
class ModelInputs:
    """One unit's inputs on one device. Per-token tensors are `[1, rows]`: one packed THD row of this
    rank's CP shard of each sequence, padding rows included (token 0, label 0, loss mask 0, so a
    loss over `loss_mask` counts real tokens only)."""

    input_ids: torch.Tensor  # [1, rows] the unit's tokens
    position_ids: torch.Tensor  # [1, rows] each row's position (model_inputs' `positions` says which)
    labels: torch.Tensor  # [1, rows]
    loss_mask: torch.Tensor  # [1, rows]
    cu_seqlens: torch.Tensor  # int32 [sequences + 1]: cumulative real lengths of the whole sequences
    cu_seqlens_padded: torch.Tensor  # int32 [sequences + 1]: cumulative padded lengths (the THD layout's)
    max_seqlen: int  # the longest padded sequence
    cp_size: int  # the unit's CP group size: this rank holds 1 / cp_size of each padded sequence
    cp_group: Any  # the unit's CP process group (cp_group_for(cp_size)); None where the resolver gave none
    packed_seq_params: Any = None  # Megatron-Core's PackedSeqParams, sharing the cu_seqlens above; None: a unit made without

    def megatron_kwargs(self) -> dict[str, Any]:
        """A Megatron-Core GPTModel's forward arguments (attention_mask None: THD attention reads cu_seqlens)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "labels": self.labels,
                "loss_mask": self.loss_mask, "attention_mask": None, "packed_seq_params": self.packed_seq_params}


def model_inputs(unit: RankMicroBatch, device: torch.device | None = None, *, tokens: str = "tokens",
                 positions: str | None = None) -> ModelInputs:
    """`unit`'s inputs on `device` (default: the model's, `model_device()`). `tokens`: the token field
    holding the input ids. `positions`: None, each row's place in its padded sequence (the unit's
    own `position_ids`); or the name of a token field the samples carry their positions in (Bridge's
    `position_ids`: padding rows then hold 0)."""
    device = device or model_device()
    wanted = [tokens, "labels", "loss_mask"] + ([positions] if positions is not None else [])
    missing = [name for name in wanted if name not in unit.token_fields]
    if missing:
        raise UsageError(f"model_inputs: the unit has no token field {missing} (its fields: {sorted(unit.token_fields)}); "
                         f"it reads {wanted}: name the fields the samples carry (tokens=, positions=)")
    copies: dict[int, torch.Tensor] = {}
    fields = unit.token_fields
    position_ids = unit.position_ids if positions is None else fields[positions]
    return ModelInputs(
        input_ids=fields[tokens].to(device)[None], position_ids=position_ids.to(device)[None],
        labels=fields["labels"].to(device)[None], loss_mask=fields["loss_mask"].to(device)[None],
        cu_seqlens=_moved(unit.cu_seqlens, device, copies), cu_seqlens_padded=_moved(unit.cu_seqlens_padded, device, copies),
        max_seqlen=unit.max_seqlen, cp_size=unit.local_cp_size, cp_group=unit.cp_group,
        packed_seq_params=_params_on(unit.packed_seq_params, device, copies),
    )


def packed_seq_params_on(unit: RankMicroBatch, device: torch.device) -> Any:
    """The unit's PackedSeqParams with its cu_seqlens on `device` (q and kv share their tensors: one copy each)."""
    return _params_on(unit.packed_seq_params, device, {})


def _params_on(params: Any, device: torch.device, copies: dict[int, torch.Tensor]) -> Any:
    if params is None:
        return None
    return dataclasses.replace(params, **{name: _moved(getattr(params, name), device, copies) for name in _CU_SEQLENS_FIELDS})


def _moved(tensor: torch.Tensor, device: torch.device, copies: dict[int, torch.Tensor]) -> torch.Tensor:
    """`tensor` on `device`, one copy per tensor however often it is asked for (`copies`, by identity)."""
    found = copies.get(id(tensor))
    if found is None:
        found = copies[id(tensor)] = tensor.to(device)
    return found
