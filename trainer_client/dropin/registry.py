"""What a drop-in keeps between calls of the trainer's hook, one per key: a read-ahead planner per
data iterator (Megatron-LM, Bridge), a cached planner per process group and settings (verl)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by key, found by identity (`by_identity`: a data iterator is the same object from step
    to step, and two equal lists of iterators are not the same one) or by equality; thread-safe."""

    def __init__(self, by_identity: bool = True):
        self._by_identity = by_identity
        self._entries: list[tuple[Any, T]] = []  # the key is held, so an identity stays unique
        self._lock = threading.Lock()

    def _index(self, key: Any) -> int | None:
        same = (lambda k: k is key) if self._by_identity else (lambda k: k == key)
        return next((i for i, (k, _) in enumerate(self._entries) if same(k)), None)

    def find(self, key: Any) -> T | None:
        with self._lock:
            index = self._index(key)
            return None if index is None else self._entries[index][1]

    def get(self, key: Any, start: Callable[[], T]) -> T:
        """The entry of `key`, started (`start()`) the first time."""
        with self._lock:
            index = self._index(key)
            if index is not None:
                return self._entries[index][1]
            value = start()
            self._entries.append((key, value))
            return value

    def pop(self, key: Any) -> T | None:
        with self._lock:
            index = self._index(key)
            return None if index is None else self._entries.pop(index)[1]

    def values(self) -> list[T]:
        with self._lock:
            return [value for _, value in self._entries]

    def close(self, key: Any) -> None:
        """Removes the entry of `key` and closes it (its planner client, threads and caches)."""
        value = self.pop(key)
        if value is not None:
            value.close()  # type: ignore[attr-defined]

    def close_all(self) -> None:
        with self._lock:
            held = [value for _, value in self._entries]
            self._entries.clear()
        for value in held:
            value.close()  # type: ignore[attr-defined]
