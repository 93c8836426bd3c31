"""The drop-ins' planner settings: the planner's own from `planner=` or `$BATCH_PLANNER_CONFIG`, plus the
sizes and the scheduler the trainer runs (docs/megatron-lm.md, "Which settings go where")."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from batch_planner.request import PaddingRule, SchedulerKind
from trainer_client import megatron as mcore
from trainer_client.client import BatchPlannerClient
from trainer_client.config import ConfigError, PlannerClientConfig

log = logging.getLogger(__name__)

CONFIG_ENV = "BATCH_PLANNER_CONFIG"
# Megatron-Core's `sequence_packing_scheduler` names and the planner's schedulers they are.
PACKING_SCHEDULERS = {"default_dynamic_cp": SchedulerKind.DYNAMIC_CP, "dp_balanced": SchedulerKind.STATIC_PACKING}


def planner_config_for(
    megatron_config: Any, scheduler: SchedulerKind, cp_size: int, planner: PlannerClientConfig | dict | None = None
) -> PlannerClientConfig:
    """The client config: the planner's settings, with the sizes and scheduler Megatron runs (`merged_settings`)."""
    given = given_planner_settings(planner)
    derived = {
        "max_seqlen_per_dp_cp_rank": int(megatron_config.max_seqlen_per_dp_cp_rank),
        "context_parallel_size": cp_size,
        "tensor_parallel_size": int(getattr(megatron_config, "tensor_model_parallel_size", 1) or 1),
        "scheduler": scheduler.value,
        # Megatron-Core pads (its dataset, or this drop-in for it) by its own rule, with no top-up.
        "padding": PaddingRule.MEGATRON_CORE.value,
        "min_local_rows": None,
    }
    if getattr(megatron_config, "cp_partition_mode", None) is not None:
        # The layout Megatron-Core cuts and reads the shards in (dev build; 0.19 reads zigzag only):
        # the drop-ins' shards and the plan's padding must be of the same one.
        derived["cp_layout"] = megatron_config.cp_partition_mode
    if scheduler is SchedulerKind.DYNAMIC_CP:
        derived["min_cp_size"] = getattr(megatron_config, "min_dynamic_context_parallel_size", None)
    if scheduler is SchedulerKind.STATIC_PACKING:
        derived["max_seqs_per_micro_batch"] = mcore.max_real_seqs_per_micro_batch(megatron_config)
    if getattr(megatron_config, "virtual_pipeline_model_parallel_size", None) is not None:
        # Megatron-Core's packing schedulers group micro-batches per virtual stage (its wrap_data_iterator).
        derived["micro_batch_group_size"] = getattr(megatron_config, "microbatch_group_size_per_vp_stage", None)
    return PlannerClientConfig.from_dict(merged_settings(given, derived, "Megatron"))


def merged_settings(given: dict[str, Any], derived: dict[str, Any], trainer: str) -> dict[str, Any]:
    """The user's planner settings with the values the trainer runs (`derived`, read from the
    trainer's own config) put in: a key set in both must have one value (ConfigError names both)."""
    for key, value in derived.items():
        if key in given and given[key] != value:
            raise ConfigError(
                f"{key}: the planner settings say {given[key]!r} but {trainer} runs {value!r}; drop {key} "
                "from the planner settings (the drop-in takes it from the trainer's own settings)"
            )
    return {**given, **derived}


def given_planner_settings(planner: PlannerClientConfig | dict | None) -> dict[str, Any]:
    """The settings the user gave: `planner=` (its non-default values), else the `batch_planner`
    section of `$BATCH_PLANNER_CONFIG`, else none (in-process planning, with a warning)."""
    if isinstance(planner, PlannerClientConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(PlannerClientConfig)}
        values = planner.to_dict()
        return {k: v for k, v in values.items() if k != "max_seqlen_per_dp_cp_rank" and v != getattr(defaults[k], "value", defaults[k])}
    if isinstance(planner, dict):
        return dict(planner)
    path = os.environ.get(CONFIG_ENV)
    if not path:
        log.warning("no planner settings (planner= or $%s): planning in-process", CONFIG_ENV)
        return {}
    import yaml

    with open(path) as handle:
        data = yaml.safe_load(handle) or {}
    if "batch_planner" not in data:
        raise ConfigError(f"${CONFIG_ENV}={path}: no top-level section 'batch_planner'")
    return dict(data["batch_planner"] or {})


def client_for(config: PlannerClientConfig, groups: mcore.DataGroups, every_tp_rank_plans: bool = False) -> BatchPlannerClient:
    """The planner client of one drop-in: planned and checked over the DPxCP group.
    `every_tp_rank_plans`: every TP rank reads and plans the same batch (Bridge); TP rank 0's
    DPxCP group then asks the planner for all of them (BatchPlannerClient's tp_group)."""
    return BatchPlannerClient(config, group=groups.dp_cp, cp_groups=None, tp_group=groups.tp if every_tp_rank_plans else None)


def checked_transformer_config(config: Any) -> Any:
    """Megatron's config is checked centrally when it is Megatron-Core's TransformerConfig."""
    return config if type(config).__name__ == "TransformerConfig" or hasattr(config, "transformer_impl") else None
