"""What a Megatron trainer imports to get its batches planned by the batch planner service."""

from trainer_client.client import BatchPlannerClient
from trainer_client.config import ConfigError, PlannerClientConfig, WhoAsks

__all__ = ["BatchPlannerClient", "ConfigError", "PlannerClientConfig", "WhoAsks"]
