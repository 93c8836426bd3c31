"""The seam: what every trainer drop-in (Megatron-LM, Megatron-Bridge, verl, examples/plain_torch_dropin.py)
is built from, on top of `BatchPlannerClient`. A drop-in imports this package and `trainer_client`; no drop-in imports another (the
import-linter contract in pyproject.toml). docs/trainer-client.md, "Adding a drop-in", is the recipe.
"""

from trainer_client.dropin.device import data_device, model_device
from trainer_client.dropin.groups import dpxcp_groups
from trainer_client.dropin.model_inputs import ModelInputs, model_inputs, packed_seq_params_on
from trainer_client.dropin.patches import Patches, VersionGate
from trainer_client.dropin.registry import Registry
from trainer_client.dropin.routing import Traffic, route_samples, sample_id_groups
from trainer_client.refusals.compatibility import Place, Rule, TableSource
from trainer_client.dropin.derived import NOT_FIXED, DerivedSettings
from trainer_client.dropin.settings import CONFIG_ENV, given_planner_settings, merged_settings, planner_config
from trainer_client.dropin.spec import DropIn, dropin, register_dropin, registered_dropins
from trainer_client.dropin.stages import StageData
from trainer_client.dropin.step_input import (
    GlobalLayout,
    LocalBatch,
    agree_on_read,
    agree_on_step,
    check_packed_sample,
    raise_on_bad_packed_sample,
)
from trainer_client.dropin.step_planner import Agreement, PlannedStep, StepPlanner
from trainer_client.dropin.units import rank_units
from trainer_client.errors import DropInInputError
from trainer_client.plans.megatron import DataGroups
from trainer_client.plans.micro_batch import RankMicroBatch

__all__ = [
    "Agreement", "CONFIG_ENV", "DataGroups", "DerivedSettings", "DropIn", "DropInInputError", "GlobalLayout", "LocalBatch",
    "ModelInputs", "NOT_FIXED", "Patches", "Place", "PlannedStep", "RankMicroBatch", "Registry", "Rule", "StageData", "StepPlanner",
    "TableSource", "Traffic", "VersionGate",
    "agree_on_read", "agree_on_step", "check_packed_sample", "data_device", "dpxcp_groups", "dropin", "given_planner_settings",
    "merged_settings", "model_device", "model_inputs", "packed_seq_params_on", "planner_config", "raise_on_bad_packed_sample",
    "rank_units", "register_dropin", "registered_dropins", "route_samples", "sample_id_groups",
]
