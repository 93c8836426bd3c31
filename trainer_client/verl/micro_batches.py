"""One plan, this rank's verl micro-batches: the TensorDicts verl's Megatron engine runs, with the
non-tensor keys its `postprocess_dynamic_cp_batch` reads (docs/verl.md).
"""

from __future__ import annotations

from typing import Sequence

from tensordict import TensorDict

from batch_planner.padding import group_padded_lengths
from batch_planner.plan import MicroBatch
from batch_planner.request import CpLayout, PaddingRule
from trainer_client.plans.apply import shard_padding_mask


def rank_micro_batches(
    batch: TensorDict,
    micro_batches: Sequence[MicroBatch],
    lengths: Sequence[int],
    rank: int,
    *,
    tp_size: int,
    cp_layout: CpLayout,
    min_local_rows: int | None,
) -> list[TensorDict]:
    """This rank's micro-batches of the plan's `micro_batches`, with the plan's CP groups (verl's
    TensorDicts: the one path of verl's engine format, trainer_client/dropin/units.py says the others)."""
    # verl is imported here, not at the top: the drop-in's package (its refusal rows) imports without verl.
    from verl.utils import tensordict_utils as tu
    from verl.utils.dynamic_cp_scheduler import DCP_GROUP_LEADER, DCP_LOCAL_NUM_TOKENS, DCP_PADDING_MASK, DCP_SAMPLE_IDS

    out = []
    for micro_batch in micro_batches:  # plans verl's engine cannot run: refused by the table (verl's rows)
        group = micro_batch.group_of_rank(rank)
        sample_ids = [int(i) for i in group.sample_ids]
        group_lengths = [lengths[i] for i in sample_ids]
        padded = group_padded_lengths(group_lengths, group.size, tp_size, cp_layout, PaddingRule.VERL, min_local_rows)
        mask = shard_padding_mask(group_lengths, padded, group.size, rank - group.first_rank, cp_layout)
        selected = tu.index_select_tensor_dict(batch, sample_ids)
        tu.assign_non_tensor_data(selected, "local_cp_size", group.size)
        tu.assign_non_tensor_data(selected, DCP_SAMPLE_IDS, sample_ids)
        tu.assign_non_tensor_data(selected, DCP_GROUP_LEADER, rank == group.first_rank)
        tu.assign_non_tensor_data(selected, DCP_PADDING_MASK, mask)
        tu.assign_non_tensor_data(selected, DCP_LOCAL_NUM_TOKENS, mask.numel() - int(mask.sum().item()))
        out.append(selected)
    return out

