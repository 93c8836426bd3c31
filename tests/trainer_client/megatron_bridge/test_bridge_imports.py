"""Megatron-Bridge 0.6.2 imports on this leg's Megatron-Core (the venv's dev build, or the release
with BRIDGE_MEGATRON_CORE=release): the modules the Bridge drop-in and its tests use, with
Transformer Engine absent (only the import stand-in, which Megatron-Core never sees)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys

import pytest

BRIDGE_VERSION = "0.6.2"

# What the drop-in and tests/trainer_client/megatron_bridge/dropin_ranks.py use. Not megatron.bridge.training.pretrain (nor
# .finetune, which imports it): it imports nvidia_resiliency_ext unguarded, and with NVRx's newest
# release (0.4.1) installed `import megatron.core` fails (requirements/bridge-leg.txt).
MODULES = [
    "megatron.bridge.training.train",
    "megatron.bridge.training.eval",
    "megatron.bridge.training.gpt_step",
    "megatron.bridge.training.losses",
    "megatron.bridge.training.state",
    "megatron.bridge.training.config",
    "megatron.bridge.training.initialize",
    "megatron.bridge.training.setup",
    "megatron.bridge.training.optim",
    "megatron.bridge.training.utils.train_utils",
    "megatron.bridge.data.iterator_utils",
]


def _megatron_core() -> str:
    import megatron.core

    return f"Megatron-Core {importlib.metadata.version('megatron-core')} from {os.path.dirname(megatron.core.__file__)}"


@pytest.mark.parametrize("module", MODULES)
def test_bridge_module_imports(module):
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure (ImportError, AttributeError, ...) is reported with the Megatron-Core it happened on
        pytest.fail(f"import {module} failed on {_megatron_core()}: {type(error).__name__}: {error}")


def test_bridge_version_and_megatron_core():
    import megatron.bridge

    where = _megatron_core()
    assert megatron.bridge.__version__ == BRIDGE_VERSION, f"Megatron-Bridge {megatron.bridge.__version__}, not {BRIDGE_VERSION}, on {where}"
    assert importlib.metadata.version("megatron-bridge") == BRIDGE_VERSION, where
    if os.environ.get("BRIDGE_MEGATRON_CORE") == "release":
        import megatron.core

        release = os.path.realpath(os.environ["PLANNER_RELEASE_OVERLAY"])
        assert os.path.realpath(megatron.core.__file__).startswith(release + os.sep), (
            f"BRIDGE_MEGATRON_CORE=release, but Bridge runs on {where}"
        )
    # Not a failure: the line that says which Megatron-Core this leg ran on (-rA shows it).
    print(f"Megatron-Bridge {megatron.bridge.__version__} on {where}")


def test_megatron_core_does_not_see_transformer_engine():
    """The stand-in is seen only by Bridge's unguarded importers: Megatron-Core's TE flags and
    version checks answer as without TE, and no transformer_engine module is importable."""
    from megatron.core import utils
    import megatron.core.extensions.transformer_engine as te_extension
    import megatron.core.fp8_utils as fp8_utils

    from tests.trainer_client.megatron_bridge import transformer_engine_import_stand_in as stand_in

    assert stand_in.installed()
    assert not [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]
    with pytest.raises(ImportError):
        importlib.import_module("transformer_engine")
    with pytest.raises(ImportError):
        __import__("transformer_engine.pytorch")
    assert str(utils.get_te_version()) == "0.0.0"
    assert not utils.is_te_min_version("1.0.0")
    assert te_extension.HAVE_TE is False
    assert fp8_utils.HAVE_TE is False
    from megatron.bridge.peft import lora_layers

    assert lora_layers.te is stand_in.STAND_IN.pytorch, "Bridge's LoRA layers see the stand-in"
