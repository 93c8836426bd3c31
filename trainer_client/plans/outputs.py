"""Restore outputs: gather the CP leaders' per-sample outputs and return them in sample order
(docs/trainer-client.md, "Per-sample side data travels with its sample"). A rank's problem travels
in the gather, so every rank raises it (`trainer_client.plans.together`).
"""

from __future__ import annotations

import numbers
import pickle
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from trainer_client.plans.distributed import is_distributed
from trainer_client.plans.together import fail_together, naming_rank
from trainer_client.errors import ArgumentTypeError, OutputRestoreError


def restore_outputs(
    local_outputs: Mapping[int, Any], num_samples: int, group: dist.ProcessGroup | None = None
) -> list[Any]:
    """All ranks call this; all get the outputs of samples 0..num_samples-1 in order."""
    problem: Exception | None = _outputs_problem(local_outputs)
    items: list[tuple[int, Any]] = []
    if problem is None:
        try:
            items = [(int(sample_id), _to_cpu(output)) for sample_id, output in local_outputs.items()]
        except Exception as exc:  # noqa: BLE001 - a rank's own failure travels in the gather, as its other problems do
            problem = OutputRestoreError(f"local_outputs: could not be read or copied to the CPU ({type(exc).__name__}: {str(exc):.160})")
    if is_distributed(group):
        payload, problem = (b"", problem) if problem else _pickled(items)
        gathered = fail_together(naming_rank(problem, group), group, payload, context="{message}")
        parts = [pickle.loads(part) for part in gathered]
        items = [(sample_id, output, rank) for rank, part in enumerate(parts) for sample_id, output in part]
    else:
        if problem is not None:
            raise problem
        items = [(sample_id, output, 0) for sample_id, output in items]
    return order_outputs(items, num_samples)


def _outputs_problem(local_outputs: Any) -> ArgumentTypeError | None:
    if not isinstance(local_outputs, Mapping):
        return ArgumentTypeError(f"local_outputs: got a {type(local_outputs).__name__}; expected a mapping of sample id (int) -> output")
    for bad in local_outputs:
        if isinstance(bad, bool) or not isinstance(bad, numbers.Integral):
            return ArgumentTypeError(
                f"local_outputs: key {bad!r:.60} is a {type(bad).__name__}; expected int sample ids (RankMicroBatch.sample_ids)"
            )
    return None


def _pickled(items: list[tuple[int, Any]]) -> tuple[bytes, ArgumentTypeError | None]:
    """`items` pickled for the gather, or b"" and the ArgumentTypeError (a TypeError) that names the first output that
    cannot be pickled (a lambda, a lock, an open file, a generator). Pickled here, not inside
    `all_gather_object`, where a pickling error would stop this rank alone, before the collective."""
    try:
        return pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as whole:  # noqa: BLE001 - pickle raises several types (PicklingError, TypeError, AttributeError)
        for sample_id, output in items:
            try:
                pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - as above
                return b"", ArgumentTypeError(
                    f"local_outputs: the output of sample {sample_id}, a {type(output).__name__}, cannot be pickled "
                    f"({type(exc).__name__}: {str(exc):.120}); outputs travel between ranks pickled: return tensors, numbers, "
                    "or lists, tuples and dicts of them"
                )
        return b"", ArgumentTypeError(f"local_outputs: cannot be pickled ({type(whole).__name__}: {str(whole):.120})")


def order_outputs(items: list[tuple[int, Any, int]], num_samples: int) -> list[Any]:
    """(sample_id, output, rank) triples -> outputs in sample order, each sample exactly once."""
    counts = Counter(sample_id for sample_id, _, _ in items)
    duplicated = sorted(i for i, n in counts.items() if n > 1)
    unknown = sorted(i for i in counts if not 0 <= i < num_samples)
    missing = sorted(set(range(num_samples)) - set(counts))
    if duplicated or unknown or missing:
        by_rank = {i: sorted(r for s, _, r in items if s == i) for i in duplicated[:10]}
        parts = (
            f"missing sample ids {missing[:20]} ({len(missing)} in all)" if missing else "",
            f"duplicated sample ids {duplicated[:20]} (reported by ranks {by_rank})" if duplicated else "",
            f"unknown sample ids {unknown[:20]} (batch has 0..{num_samples - 1})" if unknown else "",
        )
        raise OutputRestoreError("per-sample outputs do not cover the batch exactly once: " + "; ".join(filter(None, parts)))
    ordered: list[Any] = [None] * num_samples
    for sample_id, output, _ in items:
        ordered[sample_id] = output
    return ordered


def _to_cpu(output: Any) -> Any:
    # Pickled over gloo/NCCL object collectives; device tensors would be pickled with their device.
    return output.detach().cpu() if isinstance(output, torch.Tensor) else output
