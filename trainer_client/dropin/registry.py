"""What a drop-in keeps between calls of the trainer's hook, one per key: a read-ahead planner per
data iterator (Megatron-LM, Bridge), a cached planner per process group and settings (verl).

Its lifetime: entries close when someone closes them (`close`), at the end of a `with registry:`
block, and at the latest when the interpreter exits (or the registry is garbage collected)."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")
_ALL = object()

log = logging.getLogger(__name__)


class Registry(Generic[T]):
    """Entries by key, found by identity (`by_identity`: a data iterator is the same object from step
    to step, and two equal lists of iterators are not the same one) or by equality; thread-safe.
    The key is held, so an identity stays unique. Entries are objects with `close()` (a planner
    with its client, threads and channels); every one left open closes when the interpreter exits."""

    def __init__(self, by_identity: bool = True):
        self._same: Callable[[Any, Any], bool] = (lambda a, b: a is b) if by_identity else (lambda a, b: a == b)
        self._entries: list[tuple[Any, T]] = []
        self._lock = threading.Lock()
        # At exit (or when this registry is collected): close what is left, without `self`.
        self._at_exit = weakref.finalize(self, _close_left_open, self._entries, self._lock)

    def _find(self, key: Any) -> T | None:
        return next((v for k, v in self._entries if self._same(k, key)), None)

    def find(self, key: Any) -> T | None:
        with self._lock:
            return self._find(key)

    def get(self, key: Any, start: Callable[[], T]) -> T:
        """The entry of `key`, started (`start()`) the first time."""
        with self._lock:
            found = self._find(key)
            if found is None:
                found = start()
                self._entries.append((key, found))
            return found

    def values(self) -> list[T]:
        with self._lock:
            return [v for _, v in self._entries]

    def close(self, key: Any = _ALL) -> None:
        """Removes the entry of `key` (default: every entry) and closes it (its client, threads and
        caches). Every removed entry is closed even where one's `close()` raises; then the first
        error is raised again, with a note naming each entry that failed and its error."""
        with self._lock:
            closing = [(k, v) for k, v in self._entries if key is _ALL or self._same(k, key)]
            self._entries[:] = [(k, v) for k, v in self._entries if not (key is _ALL or self._same(k, key))]
        failed = _close_each(closing)
        if failed:
            first = failed[0][1]
            first.add_note(f"Registry.close: {len(failed)} of {len(closing)} entries failed to close: {_named(failed)}")
            raise first

    def __enter__(self) -> Registry[T]:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """The end of a `with registry:` block closes every entry (those started before it too)."""
        self.close()


def _close_each(entries: list[tuple[Any, Any]]) -> list[tuple[Any, BaseException]]:
    """Closes every entry; returns (key, error) of those whose close() raised."""
    failed = []
    for key, value in entries:
        try:
            value.close()
        except Exception as error:  # noqa: BLE001 - any entry's failure; the rest are closed all the same
            failed.append((key, error))
    return failed


def _named(failed: list[tuple[Any, BaseException]]) -> str:
    return "; ".join(f"key {key!r}: {type(error).__name__}: {error}" for key, error in failed)


def _close_left_open(entries: list[tuple[Any, Any]], lock: threading.Lock) -> None:
    """The interpreter's exit (or the registry's collection): closes every entry still open; a
    failure is logged, as nothing is left to raise to."""
    with lock:
        closing = list(entries)
        entries.clear()
    failed = _close_each(closing)
    if failed:
        log.warning("closing %d of %d planner entries at exit failed: %s", len(failed), len(closing), _named(failed))
