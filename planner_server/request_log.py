"""What the server writes about each request: one log line (text or JSON), and the request itself
when its plan was withheld for breaking an invariant, so that an operator can replay it.

The request file is the PlanRequest as received (`<digest>.pb`, feed it to `planner-demo` or any
client); the directory keeps the newest `keep` files, so a scheduler bug that fires on every
request cannot fill the disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

from planner_server.planning_worker import WorkerResult

log = logging.getLogger("planner_server.requests")

_FIELDS = ("plan_id", "request_digest", "training_job", "scheduler", "samples", "ranks", "latency_ms", "status")


def log_request(result: WorkerResult, seconds: float, training_job: str) -> None:
    fields = {
        "plan_id": result.plan_id,
        "request_digest": result.about.request_digest,
        "training_job": training_job,
        "scheduler": result.about.scheduler,
        "samples": result.about.samples,
        "ranks": result.about.ranks,
        "latency_ms": round(seconds * 1e3, 3),
        "status": result.code.value,
    }
    if result.code.value != "OK":
        fields["error"] = result.message
    shown = list(_FIELDS)
    if result.substitute_reason:  # the plan served is the substitute: say so, and why
        fields["substituted_for"] = result.substituted_for
        fields["substitute_reason"] = result.substitute_reason
        shown += ["substituted_for", "substitute_reason"]
    log.info("plan %s", " ".join(f"{k}={fields[k]}" for k in shown), extra={"fields": fields})


class ViolationDump:
    """Keeps the newest `keep` requests whose plans broke an invariant, in `directory`."""

    def __init__(self, directory: str, keep: int):
        self.directory = Path(directory) if directory and keep > 0 else None
        self.keep = keep

    def write(self, request_bytes: bytes, result: WorkerResult) -> Path | None:
        if self.directory is None:
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"{result.about.request_digest}.pb"
            path.write_bytes(request_bytes)
            (self.directory / f"{result.about.request_digest}.txt").write_text(result.message + "\n")
            self._prune()
        except OSError as exc:
            log.error("could not keep the request %s: %s", result.about.request_digest, exc)
            return None
        log.error("kept the request whose plan broke invariant %s in %s", result.invariant, path)
        return path

    def _prune(self) -> None:
        requests = sorted(self.directory.glob("*.pb"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in requests[self.keep:]:
            old.unlink(missing_ok=True)
            old.with_suffix(".txt").unlink(missing_ok=True)
