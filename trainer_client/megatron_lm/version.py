"""The version gate of the Megatron-LM drop-in: the Megatron-Core builds it was checked against, and
the upstream names each of its two wrappers calls outside Megatron-Core's public API (private
functions and an unbound method), looked up before the wrapper's first step."""

from __future__ import annotations

import importlib.metadata

from trainer_client.dropin.patches import VersionGate

# The builds its CI legs run (deps/megatron-core.env; tests/project/test_megatron_pins.py checks
# that they agree): the dev wheel of the pinned commit, that commit installed from source (which
# reads 0.19.0), and the release the release leg runs.
CHECKED_MEGATRON_CORE_VERSIONS = ("0.19.0+dev.d48bd6b", "0.19.0", "0.19.2")
DISTRIBUTION = "megatron-core"
DATA_SCHEDULE = "megatron.core.datasets.data_schedule"
DATA_SCHEDULE_UTILS = "megatron.core.datasets.data_schedule_utils"

GATE = VersionGate(
    "trainer_client.megatron_lm", "Megatron-Core", CHECKED_MEGATRON_CORE_VERSIONS,
    "Megatron-LM's own data-iterator wrappers stay in place",
    needs={
        # The dev branch's packing: how upstream cuts packed samples, and the static packing cap.
        "wrap_data_iterator": (f"{DATA_SCHEDULE_UTILS}:_unpack_batch", f"{DATA_SCHEDULE}:_get_scheduler_max_real_num_seqs"),
        # 0.19's hybrid CP: upstream's own cut, called unbound (it reads nothing of self).
        "HybridCPDataLoaderWrapper": (f"{DATA_SCHEDULE}:HybridCPDataLoaderWrapper.unpack_batch",),
    },
)


def megatron_core_version() -> str | None:
    """The installed Megatron-Core's version, or None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(use: str) -> None:
    """MissingUpstreamError naming what `use` calls that the installed Megatron-Core lacks."""
    GATE.require(use, megatron_core_version())
