"""A recorder of Transformer Engine's fused-attention calls: `record_fused_attention()`.

Transformer Engine's attention reaches cuDNN's fused attention through two functions of
`transformer_engine.pytorch.cpp_extensions.fused_attn`, `fused_attn_fwd` and `fused_attn_bwd`,
which its attention modules import by name: `backends.py` (no CP group) and `context_parallel.py`
(one call per ring step). Inside the recorder both names in both modules are wrapped: each call is
recorded (`FusedCall`: direction, the shapes of q, k and v, the mask, the layout, the maximum
lengths, and the four `cu_seqlens` as lists) and then runs as it would. Reading a `cu_seqlens`
tensor synchronises the device: record calls to compare them, never while timing.

The fidelity check (docs/gpu-replay.md) records the calls of a CP group's ranks run through
Transformer Engine's CP attention as several processes (tests/trainer_client/transformer_engine)
and of the replay's rank alone in one process (`in_process_peers.py`), and compares them.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import asdict, dataclass
from typing import Any, Iterator

_MODULES = (
    "transformer_engine.pytorch.attention.dot_product_attention.backends",
    "transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
)


@dataclass(frozen=True)
class FusedCall:
    direction: str  # "fwd" or "bwd"
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    attn_mask_type: str
    qkv_layout: str
    max_seqlen_q: int
    max_seqlen_kv: int
    cu_seqlens_q: tuple[int, ...]
    cu_seqlens_kv: tuple[int, ...]
    cu_seqlens_q_padded: tuple[int, ...] | None
    cu_seqlens_kv_padded: tuple[int, ...] | None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _values(tensor) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(int(v) for v in tensor.tolist())


def _shape(tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in tensor.shape)


@contextlib.contextmanager
def record_fused_attention() -> Iterator[list[FusedCall]]:
    """Within: every fused-attention call of Transformer Engine's attention, in call order."""
    import importlib

    from transformer_engine.pytorch.cpp_extensions import fused_attn

    calls: list[FusedCall] = []
    signatures = {name: inspect.signature(getattr(fused_attn, name)) for name in ("fused_attn_fwd", "fused_attn_bwd")}

    def wrap(name: str, original):
        direction = "fwd" if name.endswith("fwd") else "bwd"

        def recorded(*args, **kwargs):
            bound = signatures[name].bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            calls.append(FusedCall(
                direction, _shape(a["q"]), _shape(a["k"]), _shape(a["v"]), str(a["attn_mask_type"]), str(a["qkv_layout"]),
                int(a["max_seqlen_q"]), int(a["max_seqlen_kv"]), _values(a["cu_seqlens_q"]), _values(a["cu_seqlens_kv"]),
                _values(a["cu_seqlens_q_padded"]), _values(a["cu_seqlens_kv_padded"]),
            ))
            return original(*args, **kwargs)

        return recorded

    saved = []
    for module_name in _MODULES:
        module = importlib.import_module(module_name)
        for name in ("fused_attn_fwd", "fused_attn_bwd"):
            original = getattr(module, name)
            saved.append((module, name, original))
            setattr(module, name, wrap(name, original))
    try:
        yield calls
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
