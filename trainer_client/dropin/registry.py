"""What a drop-in keeps between calls of the trainer's hook, one per key: a read-ahead planner per
data iterator (Megatron-LM, Bridge), a cached planner per process group and settings (verl)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")
_ALL = object()


class Registry(Generic[T]):
    """Entries by key, found by identity (`by_identity`: a data iterator is the same object from step
    to step, and two equal lists of iterators are not the same one) or by equality; thread-safe.
    The key is held, so an identity stays unique."""

    def __init__(self, by_identity: bool = True):
        self._same: Callable[[Any, Any], bool] = (lambda a, b: a is b) if by_identity else (lambda a, b: a == b)
        self._entries: list[tuple[Any, T]] = []
        self._lock = threading.Lock()

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
        """Removes the entry of `key` (default: every entry) and closes it (its client, threads and caches)."""
        with self._lock:
            closing = [v for k, v in self._entries if key is _ALL or self._same(k, key)]
            self._entries = [(k, v) for k, v in self._entries if not (key is _ALL or self._same(k, key))]
        for value in closing:
            value.close()  # type: ignore[attr-defined]
