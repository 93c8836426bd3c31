"""The version gate: the drop-in changes Megatron-Bridge only on the releases it was checked
against (the CI leg `./dev test-bridge`); on any other it warns once and changes nothing."""

from __future__ import annotations

import importlib.metadata

from trainer_client.dropin.patches import VersionGate

# Bridge releases whose training loop (train_step, evaluate, gpt_step.get_batch and
# get_packed_seq_params) this drop-in was tested against.
CHECKED_BRIDGE_VERSIONS = ("0.6.2",)
DISTRIBUTION = "megatron-bridge"
GATE = VersionGate("trainer_client.megatron_bridge", "Megatron-Bridge", CHECKED_BRIDGE_VERSIONS,
                   "Bridge's own training loop stays as it is")


def bridge_version() -> str | None:
    """The installed Megatron-Bridge's version (read from its metadata: importing
    `megatron.bridge` imports Transformer Engine), or None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_checked() -> bool:
    """True on a checked release; otherwise warns once (log and RuntimeWarning) and returns False."""
    return GATE.allows(bridge_version())
