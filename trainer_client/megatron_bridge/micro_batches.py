"""Bridge's micro-batches in (docs/megatron-bridge.md, "Input"), this rank's execution units of the plan
out (trainer_client/plans/apply.py), built from the samples routed to this rank and turned into what Bridge's
`get_batch` returns."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from trainer_client.dropin.step_input import LocalBatch, check_packed_sample
from trainer_client.dropin.model_inputs import model_inputs
from trainer_client.errors import DropInInputError
from trainer_client.plans.micro_batch import RankMicroBatch

# The per-token fields Bridge's gpt_step reads from a micro-batch.
TOKEN_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def read_local_batch(micro_batches: list[Mapping[str, Any]]) -> LocalBatch:
    """This DP rank's samples of one step: every sample of each micro-batch, in order."""
    subsamples: list[dict[str, torch.Tensor]] = []
    for index, micro_batch in enumerate(micro_batches):
        subsamples += unpack_micro_batch(micro_batch, index)
    return LocalBatch.of(subsamples)  # an empty one: LocalBatch.problem says so, on every rank


def unpack_micro_batch(micro_batch: Mapping[str, Any], index: int) -> list[dict[str, torch.Tensor]]:
    """The samples of one of Bridge's micro-batches, each field 1-D `[length]`."""
    where = f"micro-batch {index} of this rank's step"
    if not isinstance(micro_batch, Mapping):
        raise DropInInputError(f"{where} is a {type(micro_batch).__name__}; Bridge's micro-batches are dicts of tensors")
    missing = [name for name in TOKEN_FIELDS if not torch.is_tensor(micro_batch.get(name))]
    if missing:
        raise DropInInputError(f"{where} has no tensor {missing} (keys: {sorted(micro_batch)}); it needs {list(TOKEN_FIELDS)}")
    fields = {name: micro_batch[name] for name in TOKEN_FIELDS}
    shapes = {name: tuple(value.shape) for name, value in fields.items()}
    if len(set(shapes.values())) > 1 or len(shapes["tokens"]) != 2:
        raise DropInInputError(f"{where}: {list(TOKEN_FIELDS)} must share one [rows, seq] shape; got {shapes}")
    boundaries = _packed_boundaries(micro_batch, where)
    if boundaries is None:  # unpacked rows: each row one sample of the whole sequence length
        return [{name: value[row] for name, value in fields.items()} for row in range(shapes["tokens"][0])]
    if shapes["tokens"][0] != 1:
        raise DropInInputError(f"{where}: a packed micro-batch holds one row (micro_batch_size 1), got {shapes['tokens'][0]}")
    problem = check_packed_sample({"cu_seqlens": boundaries, **fields}, where)
    if problem:
        raise DropInInputError(problem)
    starts = boundaries.tolist()
    return [
        {name: value[0, start:stop] for name, value in fields.items()}
        for start, stop in zip(starts, starts[1:])
        if stop > start
    ]


def _packed_boundaries(micro_batch: Mapping[str, Any], where: str) -> torch.Tensor | None:
    """The physical sequence boundaries of a packed micro-batch, or None when it is not packed."""
    for name in ("cu_seqlens_q_padded", "cu_seqlens_q"):
        if torch.is_tensor(micro_batch.get(name)):
            return micro_batch[name].reshape(-1).cpu()
    if not torch.is_tensor(micro_batch.get("cu_seqlens")):
        return None
    boundaries = micro_batch["cu_seqlens"].reshape(-1).cpu()
    argmin = micro_batch.get("cu_seqlens_argmin")
    if torch.is_tensor(argmin):
        return boundaries[: int(argmin.reshape(-1)[0])]
    negative = torch.nonzero(boundaries < 0)
    return boundaries[: int(negative[0])] if negative.numel() else boundaries


class PlannedMicroBatches(Iterator[RankMicroBatch]):
    """The iterator the schedule is given instead of Bridge's: one planned unit per `next()`;
    `device`, where `get_batch` puts the unit's tensors (trainer_client.dropin.device.model_device)."""

    def __init__(self, units: list[RankMicroBatch], device: torch.device | None = None):
        self.units = units
        self.device = device or torch.device("cpu")
        self._next = 0

    def __next__(self) -> RankMicroBatch:
        if self._next >= len(self.units):
            raise StopIteration
        self._next += 1
        return self.units[self._next - 1]


class PlannedPackedSeq(dict):
    """Bridge's packed-sequence metadata of one planned unit (the dict its forward step reads),
    carrying the unit's `PackedSeqParams`, CP group included, for `get_packed_seq_params`."""

    params: Any = None


def bridge_batch(unit: RankMicroBatch, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What Bridge's `get_batch` returns for one unit: tokens, labels, loss_mask, attention_mask
    (None: THD attention reads cu_seqlens), position_ids, packed-sequence metadata. Padding has
    loss_mask 0, so the loss stays normalised over real tokens."""
    inputs = model_inputs(unit, device, positions="position_ids")  # the positions Bridge's samples carry
    params = inputs.packed_seq_params
    metadata = PlannedPackedSeq(cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_q_padded=params.cu_seqlens_q_padded,
                                max_seqlen_q=unit.max_seqlen)
    metadata.params = params
    return inputs.input_ids, inputs.labels, inputs.loss_mask, None, inputs.position_ids, metadata
