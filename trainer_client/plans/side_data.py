"""Per-sample side data that must line up with the model input before a plan is applied: recorded
MoE routes (docs/trainer-client.md, "Router replay").
"""

from __future__ import annotations

from typing import Any, MutableMapping, Sequence

import torch

from trainer_client.errors import InvalidArgumentError, RouterReplayAlignmentError


def _per_sample(value: Any) -> list[torch.Tensor]:
    if getattr(value, "is_nested", False):
        return list(value.unbind())
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))  # a dense [B, L, ...] tensor: every sample has the same L
    return list(value)


def align_router_replay(
    routes: Sequence[torch.Tensor] | torch.Tensor,
    input_lengths: Sequence[int],
    *,
    sample_names: Sequence[Any] | None = None,
    placeholder: int | float = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Routes `[L-1 or L, ...]` per sample -> (routes `[L, ...]`, valid mask `[L]` bool).

    The placeholder row repeats `placeholder` (0: a valid expert index, so a replaying router never
    indexes out of range); the mask is False on it, so whoever reads the routes (a replaying router,
    a routing loss) can skip it. `sample_names` name the samples in errors (default: their index).
    """
    per_sample = _per_sample(routes)
    lengths = [int(n) for n in input_lengths]
    names = list(sample_names) if sample_names is not None else list(range(len(lengths)))
    if len(per_sample) != len(lengths):
        raise RouterReplayAlignmentError(
            f"router replay: {len(per_sample)} samples of recorded routes for {len(lengths)} input samples"
        )
    if len(names) != len(lengths):
        raise InvalidArgumentError(f"sample_names has {len(names)} names for {len(lengths)} samples")
    aligned: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for name, recorded, length in zip(names, per_sample, lengths):
        rows = int(recorded.shape[0])
        valid = torch.ones(length, dtype=torch.bool)
        if rows == length - 1:
            filler = torch.full((1, *recorded.shape[1:]), placeholder, dtype=recorded.dtype, device=recorded.device)
            recorded = torch.cat([recorded, filler])
            valid[-1] = False
        elif rows != length:
            raise RouterReplayAlignmentError(
                f"router replay: sample {name} has {rows} recorded route rows but {length} input tokens; "
                f"expected {length - 1} (recorded during generation, last token has no route) or {length}"
            )
        aligned.append(recorded)
        masks.append(valid)
    return aligned, masks


def attach_router_replay(
    batch: MutableMapping[str, Any],
    routes: Sequence[torch.Tensor] | torch.Tensor,
    *,
    field: str = "routed_experts",
    mask_field: str = "routed_experts_valid",
    sample_names: Sequence[Any] | None = None,
) -> MutableMapping[str, Any]:
    """Aligns `routes` to the batch's `input_ids` and stores them (and the mask) as jagged per-token
    fields, so `micro_batches()` shards them with their sample. Returns the batch."""
    lengths = [int(t.shape[0]) for t in batch["input_ids"].unbind()]
    aligned, masks = align_router_replay(routes, lengths, sample_names=sample_names)
    batch[field] = torch.nested.nested_tensor(aligned, layout=torch.jagged)
    batch[mask_field] = torch.nested.nested_tensor(masks, layout=torch.jagged)
    return batch
