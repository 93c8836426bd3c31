"""One plan, this rank's verl micro-batches: the TensorDicts verl's Megatron engine runs, with the
non-tensor keys its `postprocess_dynamic_cp_batch` reads (docs/verl.md).
"""

from __future__ import annotations

from typing import Sequence

from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dynamic_cp_scheduler import (
    DCP_GROUP_LEADER,
    DCP_LOCAL_NUM_TOKENS,
    DCP_PADDING_MASK,
    DCP_SAMPLE_IDS,
)

from batch_planner.padding import group_padded_lengths
from batch_planner.plan import MicroBatch
from batch_planner.request import CpLayout, PaddingRule
from trainer_client.apply import shard_padding_mask


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
    """This rank's micro-batches of the plan's `micro_batches`, with the plan's CP groups."""
    out = []
    for index, micro_batch in enumerate(micro_batches):
        empty = [r for g in micro_batch.cp_groups if not g.sample_ids for r in range(g.first_rank, g.first_rank + g.size)]
        if empty:
            ranks = sum(g.size for g in micro_batch.cp_groups)
            raise RuntimeError(
                f"micro-batch {index}: DPxCP ranks {empty} have no sample; verl's engine needs every one of the "
                f"{ranks} ranks to run one in every micro-batch"
            )
        group = micro_batch.group_of_rank(rank)
        if group.first_rank % group.size:
            raise RuntimeError(
                f"dynamic CP group {list(range(group.first_rank, group.first_rank + group.size))} (sample ids "
                f"{list(group.sample_ids)}) is not aligned: its first rank {group.first_rank} must be a multiple of its size {group.size}"
            )
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

