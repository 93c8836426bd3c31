"""Plan identity: the canonical form of a request and the ids hashed from it.

One plan id function serves every scheduler and auto: a SHA-256 of the canonical request, the
plan format's version, the Megatron-Core version and what else decides the plan (`scope`: the
scheduler class, or auto's candidate list version, winner and cost coefficients). The trainer's
ranks hash the same canonical request to agree on a batch (trainer_client/service/broadcast.py), so this
module imports nothing of the planning pipeline.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from batch_planner.request import PlanRequest

# The version of the mapping from scheduler output to a plan, part of every plan id: bumped when
# the mapping changes, so plan ids change with it. In this format a contiguous plan pads to 2 x CP x TP.
PLAN_FORMAT_VERSION = 3


def canonical_request(request: PlanRequest) -> dict[str, Any]:
    """Every field that shapes the plan, as plain values: the batch (its lengths), the DP size and
    the planning options; not the job name, which is only a metric label."""
    return {"lengths": list(request.sequence_lengths), "dp": request.data_parallel_size, **request.options.canonical()}


def plan_id(request: PlanRequest, megatron_core: str, **scope: Any) -> str:
    """Same request, same scope, same Megatron-Core: same id, from any replica or process."""
    canonical = {"format": PLAN_FORMAT_VERSION, "megatron_core": megatron_core, **scope, **canonical_request(request)}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
