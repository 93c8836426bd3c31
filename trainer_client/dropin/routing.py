"""The plan as Megatron-Core's schedulers return it, and moving the samples to where they run, so that
no rank ever holds the global batch (docs/megatron-lm.md, "What changes")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from batch_planner.plan import Plan
from trainer_client.dropin.device import data_device
from trainer_client.dropin.step_input import GlobalLayout, LocalBatch


def sample_id_groups(plan: Plan) -> list[list[list[int]]]:
    """`sample_id_groups[micro_batch][dp_cp_rank] -> [global sample ids]`, Megatron-Core's shape."""
    return [
        [list(mb.group_of_rank(rank).sample_ids) for rank in range(plan.dp_cp_size)] for mb in plan.micro_batches
    ]


@dataclass
class Traffic:
    """Bytes this rank received for one step against the size of the whole global batch."""

    received_bytes: int = 0
    global_batch_bytes: int = 0


def route_samples(
    local: LocalBatch, layout: GlobalLayout, groups: Any, id_groups: list[list[list[int]]], traffic: Traffic
) -> dict[int, dict[str, torch.Tensor]]:
    """Every sample this DPxCP rank runs, by global id (sorted), moved from the DP rank that loaded
    it with one all-to-all per field inside the DP group (CP siblings of a DP rank hold the same
    samples, so each rank receives from the lane of its own CP rank, as Megatron-Core does)."""
    dcp_ranks = dist.get_process_group_ranks(groups.dp_cp)
    lane = [dcp_ranks.index(r) for r in dist.get_process_group_ranks(groups.dp)]  # DPxCP rank of each DP member
    runs = [sorted({i for mb in id_groups for i in mb[position]}) for position in range(len(dcp_ranks))]
    me, my_dp = groups.dp_cp.rank(), groups.dp.rank()
    mine = range(layout.offsets[my_dp], layout.offsets[my_dp + 1])
    send = [[i for i in runs[lane[d]] if i in mine] for d in range(len(lane))]
    receive = [[i for i in runs[me] if layout.offsets[d] <= i < layout.offsets[d + 1]] for d in range(len(lane))]
    device = data_device(groups.dp)
    received: dict[int, dict[str, torch.Tensor]] = {i: {} for d in receive for i in d}
    for name, dtype, trailing in layout.fields:
        width = math.prod(trailing)
        rows_in = [sum(layout.rows[i] for i in ids) * width for ids in receive]
        outgoing = [local.subsamples[i - mine.start][name].reshape(-1) for ids in send for i in ids]
        payload = torch.cat(outgoing).to(device) if outgoing else torch.empty(0, dtype=dtype, device=device)
        incoming = _exchange(payload, [sum(layout.rows[i] for i in ids) * width for ids in send], rows_in, groups.dp)
        traffic.received_bytes += incoming.numel() * incoming.element_size()
        traffic.global_batch_bytes += sum(layout.rows) * width * incoming.element_size()
        cursor = 0
        for i in (i for ids in receive for i in ids):
            count = layout.rows[i] * width
            received[i][name] = incoming[cursor : cursor + count].view(layout.rows[i], *trailing)
            cursor += count
    return dict(sorted(received.items()))


def _exchange(payload: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], dp_group: Any) -> torch.Tensor:
    if len(send_sizes) == 1:
        return payload
    incoming = payload.new_empty(sum(receive_sizes))
    dist.all_to_all_single(incoming, payload, receive_sizes, send_sizes, group=dp_group)
    return incoming
