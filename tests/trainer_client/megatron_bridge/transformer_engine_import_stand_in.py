"""Transformer Engine import stand-in for the Bridge leg (./dev test-bridge): lets Megatron-Bridge
0.6.2 be imported on a machine without Transformer Engine (TE), while Megatron-Core and every
guarded TE probe keep seeing TE as absent.

Why it is needed: a few Bridge modules import TE at module level without a guard
(`megatron.bridge.peft.lora_layers` does `import transformer_engine.pytorch as te`, and evaluates
`te.ops.Sequential` in annotations), and `import megatron.bridge` reaches that module through
`megatron.bridge.models` -> `conversion.peft_bridge` -> `peft.canonical_lora`. Without TE the import
of `megatron.bridge.training.train` fails there with `ModuleNotFoundError: No module named
'transformer_engine'`.

The design: the stand-in is seen ONLY by `import` statements executed in the modules listed in
UNGUARDED_IMPORTERS, and by nothing else. `install()` wraps `builtins.__import__`: an import of
`transformer_engine` or `transformer_engine.<sub>` whose importing module (the `__name__` of the
globals the statement runs in) is listed gets the stand-in; every other import goes to the real
`__import__` unchanged. The stand-in never enters `sys.modules` and there is no meta-path finder,
so:

- `import transformer_engine` anywhere else (Megatron-Core's `try: import transformer_engine`
  flags, e.g. `megatron.core.extensions.transformer_engine`, `megatron.core.fp8_utils`, the
  `HAVE_TE` of `megatron.core.transformer.*`; Bridge's own guarded probes in its model bridges and
  `training/comm_overlap.py`; modelopt's TE plugin) still raises ModuleNotFoundError, as without
  the stand-in;
- `megatron.core.utils.get_te_version()` imports TE itself, fails, and caches 0.0.0, so
  `is_te_min_version(...)` answers False; there is no `transformer-engine` distribution metadata;
- `importlib.import_module("transformer_engine...")` (Bridge's `config.py` for TE debug features,
  which only runs when tensor inspection is configured) fails as without TE.

What the stand-in hides from the listed modules (and only there): that TE is missing. Their
module-level names resolve: `te.<lowercase>` is a stand-in namespace (`te.ops`, `te.common.recipe`,
...), `te.<Capitalised>` a placeholder subclass of `torch.nn.Module` (`te.Linear`,
`te.ops.Sequential`, ...) that no object is ever an instance of and that raises RuntimeError when
instantiated, and any other attribute of the stand-in raises AttributeError. So `isinstance(m,
te.Linear)` is False for every module (no TE module exists here), and the TE-fused LoRA path,
which builds `te.ops.*`, raises instead of running. Nothing of TE's behaviour is imitated: the
Megatron-Core model the tests build uses the local (non-TE) layer spec.
"""

from __future__ import annotations

import builtins
import types

import torch

# The Bridge modules that import TE without a guard on the import path of
# megatron.bridge.training.{train,eval,gpt_step,losses,state,config,initialize} (0.6.2).
UNGUARDED_IMPORTERS = frozenset({"megatron.bridge.peft.lora_layers"})

STAND_IN_VERSION = "0.0.0+import-stand-in"


class StandInNamespace(types.SimpleNamespace):
    """A `transformer_engine[.sub]` module as the listed importers see it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        object.__setattr__(self, "__name__", name)
        object.__setattr__(self, "__is_transformer_engine_import_stand_in__", True)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        qualified = f"{self.__name__}.{attr}"
        value = _placeholder_class(qualified) if attr[:1].isupper() else StandInNamespace(qualified)
        object.__setattr__(self, attr, value)
        return value

    def __repr__(self) -> str:
        return f"<Transformer Engine import stand-in {self.__name__!r}>"


def _placeholder_class(qualified: str) -> type:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{qualified} is the Transformer Engine import stand-in (tests/trainer_client/megatron_bridge): TE is not installed")

    return type(qualified.rsplit(".", 1)[-1], (torch.nn.Module,), {"__init__": __init__, "__module__": qualified.rsplit(".", 1)[0]})


STAND_IN = StandInNamespace("transformer_engine")
object.__setattr__(STAND_IN, "__version__", STAND_IN_VERSION)

_real_import = None


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if (
        level == 0
        and (name == "transformer_engine" or name.startswith("transformer_engine."))
        and globals is not None
        and globals.get("__name__") in UNGUARDED_IMPORTERS
    ):
        if not fromlist:
            return STAND_IN  # `import transformer_engine[.x] [as y]`: the top level, then getattr
        module = STAND_IN
        for part in name.split(".")[1:]:
            module = getattr(module, part)
        return module  # `from transformer_engine.x import y`
    return _real_import(name, globals, locals, fromlist, level)


def install() -> None:
    """Wraps builtins.__import__ (once); to be called before Megatron-Bridge is imported."""
    global _real_import
    if _real_import is not None:
        return
    _real_import = builtins.__import__
    builtins.__import__ = _import


def installed() -> bool:
    return _real_import is not None
