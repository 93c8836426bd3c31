"""A drop-in's planner settings: the planner's own from `planner=` or `$BATCH_PLANNER_CONFIG`, plus the
sizes, scheduler and padding the trainer runs (docs/megatron-lm.md, "Which settings go where")."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from batch_planner.precision import MEGATRON_FP8_RECIPES, Precision
from batch_planner.request import PaddingRule, SchedulerKind
from trainer_client.dropin.derived import DerivedSettings
from trainer_client.errors import ArgumentTypeError
from trainer_client.plans import megatron as mcore
from trainer_client.service.config import ConfigError, PlannerClientConfig

log = logging.getLogger(__name__)

CONFIG_ENV = "BATCH_PLANNER_CONFIG"


def planner_config(given: dict[str, Any], derived: DerivedSettings, trainer: str) -> PlannerClientConfig:
    """The client config of a drop-in: the user's settings (`given_planner_settings`) with the sizes,
    scheduler and padding the trainer runs (`derived`, read from its own config; `merged_settings`)."""
    return PlannerClientConfig.from_dict(merged_settings(given, derived, trainer))


def merged_settings(given: dict[str, Any], derived: DerivedSettings, trainer: str) -> dict[str, Any]:
    """The user's planner settings with the values the trainer runs (`derived`, read from the
    trainer's own config) put in: a key set in both must have one value (ConfigError names both)."""
    if not isinstance(derived, DerivedSettings):
        raise ArgumentTypeError(f"derived: got a {type(derived).__name__}; expected trainer_client.dropin.DerivedSettings")
    fixed = derived.fixed()
    for key, value in fixed.items():
        if key in given and given[key] != value:
            raise ConfigError(
                f"{key}: the planner settings say {given[key]!r} but {trainer} runs {value!r}; drop {key} "
                "from the planner settings (the drop-in takes it from the trainer's own settings)"
            )
    return {**given, **fixed}


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
    if not isinstance(data, dict) or "batch_planner" not in data:
        raise ConfigError(f"${CONFIG_ENV}={path}: no top-level section 'batch_planner' (the file holds {type(data).__name__} {data!r:.80})")
    section = data["batch_planner"] or {}
    if not isinstance(section, dict):
        raise ConfigError(f"${CONFIG_ENV}={path}: section 'batch_planner' must be a mapping of settings, got {type(section).__name__} {section!r:.80}")
    return dict(section)


def megatron_precision(config: Any) -> Precision:
    """The precision a Megatron-Core model config runs its linear layers in: bf16 without `fp8`, else
    its `fp8_recipe` (Megatron-Core's default, delayed, when unset). A recipe the planner has no
    alignment for (a custom quantizer factory) is a ConfigError naming the ones it has."""
    if getattr(config, "fp8", None) is None:
        return Precision.BF16
    recipe = getattr(config, "fp8_recipe", None)
    recipe = getattr(recipe, "value", recipe) or "delayed"
    if recipe not in MEGATRON_FP8_RECIPES:
        raise ConfigError(
            f"fp8_recipe: {recipe!r} with fp8={config.fp8!r} has no row alignment in the planner; allowed with dynamic CP: "
            f"{', '.join(MEGATRON_FP8_RECIPES)} (batch_planner/precision.py)"
        )
    return MEGATRON_FP8_RECIPES[recipe]


def planner_settings_of(config: Any, scheduler: SchedulerKind, cp_size: int) -> DerivedSettings:
    """The planner settings a Megatron-Core model config fixes (the Megatron-LM and Bridge drop-ins'
    derived settings, for `planner_config`): its sizes, the scheduler the trainer runs, and
    Megatron-Core's padding (its dataset, or the drop-in for it), with no top-up."""
    derived = DerivedSettings(
        max_seqlen_per_dp_cp_rank=int(config.max_seqlen_per_dp_cp_rank),
        context_parallel_size=cp_size,
        tensor_parallel_size=int(getattr(config, "tensor_model_parallel_size", 1) or 1),
        scheduler=scheduler,
        padding=PaddingRule.MEGATRON_CORE,
        min_local_rows=None,
        precision=megatron_precision(config),
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
    )
    if getattr(config, "cp_partition_mode", None) is not None:
        # The layout Megatron-Core cuts and reads the shards in (dev build; 0.19 reads zigzag only):
        # the drop-ins' shards and the plan's padding must be of the same one.
        derived = dataclasses.replace(derived, cp_layout=config.cp_partition_mode)
    if scheduler is SchedulerKind.DYNAMIC_CP:
        derived = dataclasses.replace(derived, min_cp_size=getattr(config, "min_dynamic_context_parallel_size", None))
    if scheduler is SchedulerKind.STATIC_PACKING:
        derived = dataclasses.replace(derived, max_seqs_per_micro_batch=mcore.max_real_seqs_per_micro_batch(config))
    if getattr(config, "virtual_pipeline_model_parallel_size", None) is not None:
        # Megatron-Core's packing schedulers group micro-batches per virtual stage (its wrap_data_iterator).
        derived = dataclasses.replace(derived, micro_batch_group_size=getattr(config, "microbatch_group_size_per_vp_stage", None))
    return derived
