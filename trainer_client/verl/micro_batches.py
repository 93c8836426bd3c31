"""One plan, this rank's verl micro-batches: the TensorDicts verl's Megatron engine runs.

Per micro-batch of the plan, this rank's samples selected from the replicated mini-batch with
verl's own `index_select_tensor_dict`, and the non-tensor keys verl's engine and its
`postprocess_dynamic_cp_batch` read: `local_cp_size`, `_dcp_sample_ids`, `_dcp_group_leader`,
`_dcp_padding_mask`, `_dcp_local_num_tokens`. A CP group is the run of ranks holding the same
sample list; verl's engine needs it to be an aligned run (Megatron-Core's dynamic-CP groups).
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

from batch_planner.request import CpLayout
from trainer_client.verl.padding_mask import local_padding_mask


def cp_group_of(assignment: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The DPxCP ranks of `rank`'s CP group in one micro-batch: those holding its sample list,
    which must be a run starting at a multiple of its size (RuntimeError otherwise)."""
    mine = list(assignment[rank])
    members = [peer for peer, ids in enumerate(assignment) if list(ids) == mine]
    size = len(members)
    if members != list(range(members[0], members[0] + size)):
        raise RuntimeError(f"dynamic CP group {members} (sample ids {mine}): members must be contiguous ranks")
    if members[0] % size:
        raise RuntimeError(
            f"dynamic CP group {members} (sample ids {mine}) is not aligned: its first rank {members[0]} "
            f"must be a multiple of its size {size}"
        )
    return members


def rank_micro_batches(
    batch: TensorDict,
    sample_id_groups: Sequence[Sequence[Sequence[int]]],
    lengths: Sequence[int],
    rank: int,
    *,
    tp_size: int,
    cp_layout: CpLayout,
    min_local_rows: int | None,
) -> list[TensorDict]:
    """This rank's micro-batches for `sample_id_groups[micro_batch][dp_cp_rank] -> sample ids`."""
    micro_batches = []
    for index, assignment in enumerate(sample_id_groups):
        empty = [r for r, ids in enumerate(assignment) if not ids]
        if empty:
            raise RuntimeError(
                f"micro-batch {index}: DPxCP ranks {empty} have no sample; verl's engine needs every one of the "
                f"{len(assignment)} ranks to run one in every micro-batch"
            )
        sample_ids = [int(i) for i in assignment[rank]]
        members = cp_group_of(assignment, rank)
        mask = local_padding_mask(
            [lengths[i] for i in sample_ids], len(members), members.index(rank), tp_size, cp_layout, min_local_rows
        )
        micro_batch = tu.index_select_tensor_dict(batch, sample_ids)
        tu.assign_non_tensor_data(micro_batch, "local_cp_size", len(members))
        tu.assign_non_tensor_data(micro_batch, DCP_SAMPLE_IDS, sample_ids)
        tu.assign_non_tensor_data(micro_batch, DCP_GROUP_LEADER, rank == members[0])
        tu.assign_non_tensor_data(micro_batch, DCP_PADDING_MASK, mask)
        tu.assign_non_tensor_data(micro_batch, DCP_LOCAL_NUM_TOKENS, mask.numel() - int(mask.sum().item()))
        micro_batches.append(micro_batch)
    return micro_batches
