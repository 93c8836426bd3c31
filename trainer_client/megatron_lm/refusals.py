"""Megatron-LM's drop-ins' part of the refusal table (docs/megatron-lm.md): what `wrap_data_iterator` is
handed (`num_microbatches`, checked with each step's plan, and `sequence_packing_scheduler`) and what
is read of the model once (`checks.MODEL_SETTINGS`): the `megatron_lm` source. Registered with the
drop-in (trainer_client/megatron_lm/__init__.py)."""

from __future__ import annotations

from trainer_client.refusals.compatibility import ABSENT, MEGATRON_SCHEDULER_NAMES, Place, Rule, TableSource

SOURCE = "megatron_lm"

ROWS = (
    Rule(Place(SOURCE, "sequence_packing_scheduler"), "not one of " + ", ".join(map(repr, MEGATRON_SCHEDULER_NAMES)), "wrap_data_iterator's "
         "drop-in plans with Megatron-Core's packing schedulers: set --sequence-packing-scheduler default_dynamic_cp (dynamic CP) or "
         "dp_balanced (static packing)", lambda v, _: v is not ABSENT and v not in MEGATRON_SCHEDULER_NAMES, default=ABSENT),
)

REFUSALS = TableSource(SOURCE, "Megatron-LM's drop-ins", ROWS, places={
    "batch_size_rampup": ("num_microbatches",),
    "position_embedding_type": ("position_embedding_type",),
    "mtp_num_layers": ("mtp_num_layers",),
})
