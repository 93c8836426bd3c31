"""Admission: the in-flight bound, fair per job (the job: the `batch-planner-job` request
metadata, "" without it), and which requests are planned inline. No process code: the pool
(planner_server/worker_pool.py) reserves slots here before any work starts and gives each back
when its work has really stopped."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from batch_planner.errors import ErrorCode, PlanningError

# Bytes a PlanRequest holds besides its sample lengths, at most: layout, limits, enums, a job name
# of at most 63 characters and a cost model with its profiles. Longer messages are not parsed in
# the handler thread.
_REQUEST_FIXED_BYTES = 4096
_MAX_VARINT_BYTES = 10


def request_bytes_bound(samples: int) -> int:
    """More bytes than a PlanRequest of at most `samples` samples can take (each length a varint of
    at most 10 bytes): a longer message is not one validation would accept at that limit."""
    return _REQUEST_FIXED_BYTES + _MAX_VARINT_BYTES * samples


class PoolOverloaded(PlanningError):
    """The admission bound is reached: refuse at once rather than queue."""

    code = ErrorCode.RESOURCE_EXHAUSTED

    def __init__(self, detail: str):
        super().__init__(f"planner overloaded: {detail}; retry with backoff")


class JobShareExceeded(PoolOverloaded):
    """This job holds its share of the in-flight bound: its request is refused, other jobs' are not."""

    def __init__(self, detail: str, job: str):
        PlanningError.__init__(self, f"planner overloaded by this job: {detail}; retry with backoff")
        self.job = job


class Admission:
    """The in-flight bound: past `capacity` slots a request is refused at once (PoolOverloaded).
    Fair per job: one job ("" is one shared bucket) may hold at most `job_share` of the capacity,
    at least one slot; past it that job is refused (JobShareExceeded) while other jobs are still
    admitted up to the total bound. job_share 1.0 turns the per-job bound off."""

    def __init__(self, capacity: int, job_share: float = 1.0):
        self.capacity = capacity
        self.job_share = job_share
        self.job_bound = capacity if job_share >= 1.0 else max(1, int(capacity * job_share))
        self._lock = threading.Lock()
        self._used = 0
        self._by_job: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return self._used

    def reserve(self, slots: int = 1, job: str = "") -> None:
        with self._lock:
            need = f"; this request needs {slots} (auto: one per candidate, at most one per worker)" if slots > 1 else ""
            held = self._by_job.get(job, 0)
            if self.job_bound < self.capacity and held + slots > self.job_bound:
                raise JobShareExceeded(
                    f"job {job or '(none)'!r} holds {held} slots in flight{need}, its share is "
                    f"{self.job_bound} ({self.job_share:g} of the server's bound of {self.capacity})", job)
            if self._used + slots > self.capacity:
                raise PoolOverloaded(f"{self._used} slots in flight{need}, the server's bound is {self.capacity}")
            self._used += slots
            self._by_job[job] = held + slots

    def release(self, slots: int = 1, job: str = "") -> None:
        with self._lock:
            self._used -= slots
            left = self._by_job.get(job, 0) - slots
            if left > 0:
                self._by_job[job] = left
            else:
                self._by_job.pop(job, None)  # bounded by what is in flight, not by jobs ever seen


@dataclass(frozen=True)
class InlineBound:
    """Which requests are planned in the handler thread: at most `max_samples` samples on at most
    `max_ranks` DPxCP ranks (the scheduler's time grows with both). max_samples 0: none."""

    max_samples: int = 0
    max_ranks: int = 0

    def admits(self, samples: int, ranks: int) -> bool:
        return 0 < self.max_samples and samples <= self.max_samples and ranks <= self.max_ranks
