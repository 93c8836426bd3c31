"""Measured plan rates, by scheduler and size class, over a rolling window of served plans.

GetCapabilities reports them (proto `PlanRate`) so that a job can size its plan-ahead depth and its
replicas from what this replica really does at its size, rather than from a guess. The classes are
powers of two of samples and DPxCP ranks, so there are few of them (bounded by the request limits:
at most 15 x 11 per scheduler), and each keeps only its most recent `window` plans.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass

WINDOW = 32


def size_class(value: int) -> int:
    """The smallest power of two >= value (1 for value <= 1)."""
    return 1 << max(0, int(value) - 1).bit_length()


@dataclass(frozen=True)
class PlanRate:
    scheduler: str
    samples: int  # size class: at most this many samples (a power of two)
    dp_cp_size: int  # ... on at most this many DPxCP ranks (a power of two)
    plans_measured: int
    seconds_per_plan: float  # median over the window


class PlanRates:
    """Thread-safe: the gRPC handler threads record, GetCapabilities reads."""

    def __init__(self, window: int = WINDOW):
        self.window = window
        self._seconds: dict[tuple[str, int, int], deque[float]] = {}
        self._lock = threading.Lock()

    def record(self, scheduler: str, samples: int, dp_cp_size: int, seconds: float) -> None:
        if samples <= 0 or dp_cp_size <= 0 or seconds <= 0:
            return
        key = (scheduler, size_class(samples), size_class(dp_cp_size))
        with self._lock:
            self._seconds.setdefault(key, deque(maxlen=self.window)).append(seconds)

    def snapshot(self) -> list[PlanRate]:
        with self._lock:
            items = [(key, list(values)) for key, values in self._seconds.items()]
        return [
            PlanRate(scheduler, samples, ranks, len(values), statistics.median(values))
            for (scheduler, samples, ranks), values in sorted(items)
        ]
