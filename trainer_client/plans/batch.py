"""The global batch, read once: per-token fields as packed values + offsets, per-sample rows
(docs/trainer-client.md, "The input contract").
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from trainer_client.errors import ArgumentTypeError, BatchMismatchError


BATCH_ACCEPTED = (
    "a TensorDict, or a mapping of field name -> tensor, whose 'input_ids' is a jagged NestedTensor "
    "(torch.nested.nested_tensor(..., layout=torch.jagged)), one row per sample"
)


@dataclass(frozen=True)
class JaggedField:
    """One per-token field of the batch, read once: the packed tokens of all samples and where
    each sample starts in them (a jagged NestedTensor's values and offsets; no per-sample unbind)."""

    values: torch.Tensor  # [total tokens, ...]
    starts: tuple[int, ...]  # row in `values` of each sample's first token


@dataclass
class GlobalBatch:
    """A batch read into packed per-token fields once, so every micro-batch slices it cheaply."""

    lengths: tuple[int, ...]
    token_fields: dict[str, JaggedField]
    sample_fields: dict[str, torch.Tensor]  # name -> [B, ...]
    # The lengths as int64 bytes (`lengths_key`), so that checking them against a plan's is one
    # memory comparison (trainer_client/plans/batch_check.py); b"" when not known.
    lengths_bytes: bytes = b""

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    def samples(self, name: str, sample_ids: tuple[int, ...]) -> list[torch.Tensor]:
        """The unsharded tokens `[L, ...]` of field `name` for `sample_ids` (views of the batch)."""
        field = self.token_fields[name]
        return [field.values[field.starts[i] : field.starts[i] + self.lengths[i]] for i in sample_ids]


def unbind_batch(batch: Mapping[str, Any]) -> GlobalBatch:
    """The batch read once; ArgumentTypeError when it is not a mapping of tensors, BatchMismatchError when
    its fields do not describe one batch."""
    if not isinstance(batch, Mapping):
        raise ArgumentTypeError(f"batch: got {_kind(batch)}; expected {BATCH_ACCEPTED}")
    if "input_ids" not in batch.keys():
        raise BatchMismatchError(f"batch: it has no 'input_ids' field; fields: {sorted(map(str, batch.keys()))}")
    for name in batch.keys():
        if not isinstance(batch[name], torch.Tensor):
            raise ArgumentTypeError(
                f"batch: field {name!r} is {_kind(batch[name])}; expected a tensor (a jagged NestedTensor of [L, ...] "
                f"per sample, or a dense [B, ...] tensor); the batch must be {BATCH_ACCEPTED}"
            )
    input_ids = batch["input_ids"]
    if not input_ids.is_nested:
        raise BatchMismatchError(
            "batch: input_ids must be a jagged NestedTensor (torch.nested.nested_tensor(..., layout=torch.jagged)), "
            f"got a dense tensor of shape {tuple(input_ids.shape)}"
        )
    lengths, _, key = _jagged_field(input_ids)
    token_fields: dict[str, JaggedField] = {}
    sample_fields: dict[str, torch.Tensor] = {}
    for name in batch.keys():
        value = batch[name]
        if getattr(value, "is_nested", False):
            field_lengths, token_fields[name], _ = _jagged_field(value)
            _check_token_field(name, field_lengths, lengths)
        else:
            if value.shape[:1] != (len(lengths),):
                raise BatchMismatchError(
                    f"batch: per-sample field {name!r} has shape {tuple(value.shape)}; expected first dimension "
                    f"{len(lengths)} (one row per sample)"
                )
            sample_fields[name] = value
    return GlobalBatch(lengths, token_fields, sample_fields, key if key is not None else lengths_key(lengths))


def lengths_key(lengths: tuple[int, ...]) -> bytes:
    """Per-sample lengths as int64 bytes: equal keys, equal lengths."""
    return array.array("q", lengths).tobytes()


def _kind(value: Any) -> str:
    """What a value is, for a message: its type (and the first element's, for a list or tuple)."""
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)) and value:
        return f"a {type(value).__name__} of {type(value[0]).__name__}"
    return f"a {type(value).__name__}"


def _jagged_field(nested: torch.Tensor) -> tuple[tuple[int, ...], JaggedField, bytes | None]:
    """(lengths, packed field, `lengths_key` of the lengths or None) of a NestedTensor; its
    offsets give them without unbinding it (the key from the lengths tensor: a microsecond)."""
    if nested.layout is torch.jagged and getattr(nested, "_ragged_idx", 1) == 1:
        offsets = nested.offsets()
        lengths = nested.lengths()  # not None only for a view with holes between samples
        if lengths is None:
            lengths = offsets.diff()
        lengths = lengths.to(device="cpu", dtype=torch.int64)
        return tuple(lengths.tolist()), JaggedField(nested.values(), tuple(offsets[:-1].tolist())), lengths.numpy().tobytes()
    # Strided layout (or ragged along another dimension): per-sample tensors, packed once.
    per_sample = list(nested.unbind())
    lengths = tuple(int(t.shape[0]) for t in per_sample)
    starts = tuple(itertools.accumulate(lengths, initial=0))[:-1]
    return lengths, JaggedField(torch.cat(per_sample) if per_sample else torch.empty(0, dtype=nested.dtype), starts), None


def _check_token_field(name: str, field_lengths: tuple[int, ...], lengths: tuple[int, ...]) -> None:
    if len(field_lengths) != len(lengths):
        raise BatchMismatchError(f"batch: field {name!r} has {len(field_lengths)} samples, input_ids has {len(lengths)}")
    if field_lengths == lengths:
        return
    sample_id, (tokens, length) = next((i, pair) for i, pair in enumerate(zip(field_lengths, lengths)) if pair[0] != pair[1])
    raise BatchMismatchError(f"batch: field {name!r} of sample {sample_id} has {tokens} tokens, its input_ids has {length}")
