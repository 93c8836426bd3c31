"""What a Megatron trainer imports to get its batches planned by the batch planner service."""

from trainer_client.plans.batch_check import check_batch_is_planned
from trainer_client.service.client import BatchPlannerClient
from trainer_client.refusals.compatibility import check_dynamic_cp_support
from trainer_client.service.config import PlannerClientConfig, WhoAsks
from trainer_client.errors import (
    ArgumentTypeError, BatchMismatchError, ConfigError, DropInInputError, InvalidArgumentError, MissingUpstreamError,
    OutputRestoreError,
    PlanMismatchError, PlannerClientError, PlannerUnavailableError, PlanRejectedError, ProcessGroupError, RankFailedError,
    RouterReplayAlignmentError, ServiceFailedError, TlsMismatchError, UnrunnablePlanError, UnsupportedCombinationError,
    UsageError,
)
from trainer_client.plans.side_data import align_router_replay, attach_router_replay
from trainer_client.plans.token_outputs import TokenPiece, restore_token_outputs, token_pieces

__all__ = [
    "ArgumentTypeError", "BatchMismatchError", "BatchPlannerClient", "ConfigError", "DropInInputError",
    "InvalidArgumentError", "MissingUpstreamError", "OutputRestoreError", "PlanMismatchError", "PlanRejectedError", "PlannerClientConfig",
    "PlannerClientError", "PlannerUnavailableError", "ProcessGroupError", "RankFailedError",
    "RouterReplayAlignmentError", "ServiceFailedError", "TlsMismatchError", "TokenPiece", "UnrunnablePlanError",
    "UnsupportedCombinationError", "UsageError", "WhoAsks", "align_router_replay", "attach_router_replay",
    "check_batch_is_planned", "check_dynamic_cp_support", "restore_token_outputs", "token_pieces",
]
