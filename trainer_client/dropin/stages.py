"""What each pipeline stage keeps of a step, as Megatron-Core's packing schedulers decide it (the dev
branch's `DpBalancedScheduler.run`, and `create_data_iterator` with `vpp_needs_data`): docs/megatron-lm.md,
"Pipeline, virtual pipeline, MTP, MoE and RoPE", its paragraph "Pipeline parallelism, as Megatron-Core's
packing schedulers run it"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer_client.plans import megatron as mcore
from trainer_client.dropin.step_input import LENGTH_KEYS

FIRST_STAGE_KEYS = ("tokens", "position_ids")
LAST_STAGE_KEYS = ("labels", "loss_mask")


@dataclass(frozen=True)
class StageData:
    """The fields this pipeline stage keeps, and which of its virtual stages read data (None: no
    virtual stages)."""

    keys: frozenset[str]
    vpp_needs_data: tuple[bool, ...] | None

    @classmethod
    def of(cls, groups: mcore.DataGroups, config: Any) -> StageData:
        pp = groups.pp
        first = pp is None or pp.rank() == 0
        last = pp is None or pp.rank() == pp.size() - 1
        vpp = int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1)
        mtp_stage, mtp_virtual = mcore.mtp_stages(config, vpp) if pp is not None else (False, (False,) * vpp)
        keys = set(LENGTH_KEYS)
        if first or mtp_stage:
            keys |= set(FIRST_STAGE_KEYS)
        if last or mtp_stage:
            keys |= set(LAST_STAGE_KEYS)
        needs = None
        if vpp > 1:
            needs = tuple((first and v == 0) or (last and v == vpp - 1) or mtp_virtual[v] for v in range(vpp))
        return cls(frozenset(keys), needs)
