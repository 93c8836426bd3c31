"""The seam's `Registry` (trainer_client/dropin/registry.py): one entry per key, found by identity (a
data iterator) or by equality (a process group and settings), started once, closed by key or all
together (every one even where one's close fails), at the end of a `with` block and at the
interpreter's exit; the entries are `Closable` stand-ins (named as such) that count their closes, in place of a
drop-in's planner with its client. Concurrency is driven by barriers, not by sleeping."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from trainer_client.dropin import Registry


class Closable:
    """Stand-in for a registry entry (a drop-in's StepPlanner): counts its closes."""

    def __init__(self, key=None):
        self.key = key
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def _starter(counter: Counter, key_label: str):
    def start() -> Closable:
        counter[key_label] += 1
        return Closable(key_label)

    return start


def test_by_identity_equal_keys_are_different_entries():
    registry: Registry[Closable] = Registry(by_identity=True)
    starts: Counter = Counter()
    a, b = [1, 2], [1, 2]  # equal, not the same object: two data iterators' lists
    first = registry.get(a, _starter(starts, "a"))
    assert registry.get(a, _starter(starts, "a")) is first
    second = registry.get(b, _starter(starts, "b"))
    assert second is not first and starts == {"a": 1, "b": 1}
    assert registry.find(a) is first and registry.find(b) is second and registry.find([1, 2]) is None
    assert registry.values() == [first, second]


def test_by_equality_equal_keys_share_one_entry_even_unhashable():
    registry: Registry[Closable] = Registry(by_identity=False)
    starts: Counter = Counter()
    first = registry.get({"group": [0, 1], "cp": 2}, _starter(starts, "k"))
    assert registry.get({"cp": 2, "group": [0, 1]}, _starter(starts, "k")) is first
    assert registry.find({"group": [0, 1], "cp": 2}) is first
    assert registry.find({"group": [0, 1], "cp": 4}) is None
    assert starts == {"k": 1} and registry.values() == [first]


def test_a_key_is_held_so_an_identity_is_never_reused():
    """Keys made and dropped in a loop: each is its own entry (a freed key's id could come back)."""
    registry: Registry[Closable] = Registry(by_identity=True)
    for _ in range(50):
        registry.get(iter(()), Closable)
    assert len(registry.values()) == 50


def test_start_that_raises_leaves_no_entry():
    registry: Registry[Closable] = Registry()
    key = object()

    def broken() -> Closable:
        raise OSError("cannot reach the planner")

    with pytest.raises(OSError, match="cannot reach"):
        registry.get(key, broken)
    assert registry.find(key) is None and registry.values() == []
    assert registry.get(key, Closable) is registry.find(key)


def test_close_of_a_key_closes_that_entry_alone():
    registry: Registry[Closable] = Registry(by_identity=True)
    keys = [object(), object(), object()]
    entries = [registry.get(k, Closable) for k in keys]
    registry.close(keys[1])
    assert [e.closes for e in entries] == [0, 1, 0]
    assert registry.find(keys[1]) is None and registry.values() == [entries[0], entries[2]]
    replacement = registry.get(keys[1], Closable)  # a closed key starts anew
    assert replacement is not entries[1] and entries[1].closes == 1


def test_close_by_identity_ignores_an_equal_key():
    registry: Registry[Closable] = Registry(by_identity=True)
    key = [1]
    entry = registry.get(key, Closable)
    registry.close([1])
    assert entry.closes == 0 and registry.find(key) is entry


def test_close_by_equality_closes_the_equal_key():
    registry: Registry[Closable] = Registry(by_identity=False)
    entry = registry.get(("group", 2), Closable)
    registry.close(("group", 2))
    assert entry.closes == 1 and registry.values() == []


def test_closing_an_unknown_key_closes_nothing():
    registry: Registry[Closable] = Registry()
    entry = registry.get(object(), Closable)
    registry.close(object())
    registry.close(None)  # None is a key like any other, not "all"
    assert entry.closes == 0 and registry.values() == [entry]


def test_close_all_closes_every_entry_once():
    registry: Registry[Closable] = Registry()
    entries = [registry.get(object(), Closable) for _ in range(5)]
    registry.close()
    assert [e.closes for e in entries] == [1] * 5 and registry.values() == []
    registry.close()  # an empty registry: nothing left to close
    assert [e.closes for e in entries] == [1] * 5


THREADS = 8
ROUNDS = 200


def test_concurrent_gets_of_one_key_start_it_once():
    """Every round, THREADS threads released together by a barrier ask for one new key."""
    registry: Registry[Closable] = Registry(by_identity=True)
    barrier = threading.Barrier(THREADS)
    keys = [object() for _ in range(ROUNDS)]
    got: list[list[Closable]] = [[] for _ in range(ROUNDS)]
    starts: Counter = Counter()
    lock = threading.Lock()

    def start_for(round_: int):
        def start() -> Closable:
            with lock:
                starts[round_] += 1
            return Closable(round_)

        return start

    def worker() -> None:
        for round_ in range(ROUNDS):
            barrier.wait()
            entry = registry.get(keys[round_], start_for(round_))
            with lock:
                got[round_].append(entry)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(starts[r] == 1 for r in range(ROUNDS)), [r for r in range(ROUNDS) if starts[r] != 1]
    assert all(len({id(e) for e in entries}) == 1 and len(entries) == THREADS for entries in got)
    assert len(registry.values()) == ROUNDS


def test_concurrent_gets_and_closes_close_each_entry_exactly_once():
    """Half the threads get a shared set of keys, half close them, released together each round;
    at the end close() takes the rest: no entry is closed twice or left open, none lost."""
    registry: Registry[Closable] = Registry(by_identity=True)
    keys = [object() for _ in range(4)]
    barrier = threading.Barrier(THREADS)
    made: list[Closable] = []
    lock = threading.Lock()

    def start() -> Closable:
        entry = Closable()
        with lock:
            made.append(entry)
        return entry

    def worker(index: int) -> None:
        for round_ in range(ROUNDS):
            barrier.wait()
            key = keys[(index + round_) % len(keys)]
            if index % 2:
                registry.close(key)
            else:
                registry.get(key, start)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    registry.close()
    assert made, "no entry was ever started"
    assert Counter(e.closes for e in made) == {1: len(made)}, Counter(e.closes for e in made)
    assert registry.values() == []


class FailingClose(Closable):
    """An entry whose close() raises (a channel that fails to shut down), after counting the close."""

    def close(self) -> None:
        super().close()
        raise OSError(f"entry {self.key} failed to close")


def test_a_failing_close_closes_the_rest_then_raises_the_first_naming_every_failure():
    registry: Registry[Closable] = Registry(by_identity=False)
    entries = [registry.get(label, lambda label=label: (FailingClose if label in "bd" else Closable)(label)) for label in "abcde"]
    with pytest.raises(OSError, match="entry b failed to close") as raised:
        registry.close()
    assert [e.closes for e in entries] == [1] * 5 and registry.values() == []
    note = " ".join(getattr(raised.value, "__notes__", []))
    assert "2 of 5 entries failed to close" in note and "key 'b': OSError" in note and "key 'd': OSError" in note, note


def test_a_with_block_closes_every_entry_at_its_end_even_on_an_error():
    registry: Registry[Closable] = Registry()
    with pytest.raises(KeyError), registry:
        entries = [registry.get(object(), Closable) for _ in range(3)]
        raise KeyError("the trainer's step failed")
    assert [e.closes for e in entries] == [1, 1, 1] and registry.values() == []


def test_a_registry_collected_closes_what_it_held():
    import gc

    registry: Registry[Closable] = Registry()
    entry = registry.get(object(), Closable)
    del registry
    gc.collect()
    assert entry.closes == 1


def test_entries_left_open_close_at_interpreter_exit():
    """A process that never closes its registry: its entries close as the interpreter exits (one's
    failure is logged and the next still closes), after the program's own last line."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent(
        """
        from trainer_client.dropin import Registry

        class Entry:
            def __init__(self, name, fails=False):
                self.name, self.fails = name, fails
            def close(self):
                print("closed", self.name, flush=True)
                if self.fails:
                    raise OSError("channel stuck")

        registry = Registry(by_identity=False)
        for name, fails in (("first", True), ("second", False)):
            registry.get(name, lambda name=name, fails=fails: Entry(name, fails))
        print("end of program", flush=True)
        """
    )
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["end of program", "closed first", "closed second"], done.stdout
    assert "closing 1 of 2 planner entries at exit failed: key 'first': OSError: channel stuck" in done.stderr, done.stderr
