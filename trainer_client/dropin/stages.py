"""What each pipeline stage keeps of a step, as Megatron-Core's packing schedulers decide it
(`DpBalancedScheduler.run` on the dev branch): every stage reads and plans the whole step on its TP
rank 0, then keeps only the fields its model chunks read. The first stage keeps tokens and
positions, the last keeps labels and the loss mask, a stage that holds MTP layers keeps all four;
every stage keeps the two lengths. With virtual stages, each virtual stage gets its own iterator:
the full micro-batches where it reads data (the first virtual stage of the first stage, the last of
the last, and those holding MTP layers), the THD metadata alone elsewhere (Megatron-Core's
`create_data_iterator` with `vpp_needs_data`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer_client import megatron as mcore
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
