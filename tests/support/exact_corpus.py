"""The differential corpus: seeded scheduler inputs that the exact path (batch_planner/exact) and
Megatron-Core's own code must answer identically, and the harness that compares them.

A case is one scheduler call: the batch, DP and CP, the per-rank budget and the options. Its
outcome is what the call returned, or the exception type and message it raised. Cases cover every
distribution in batch_planner/distributions.py plus all-equal lengths, tiny lengths and one giant
sample among small ones; DPxCP from 2 to 1,024 including the non-powers of two 6, 10, 12, 20, 24,
40, 48 and 96 (`non_power_of_two_corpus`: those only); `min_cp_size` and the VPP `micro_batch_group_size`. Sizes are drawn so that
upstream's own code, which is the slow side, answers each in milliseconds.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from batch_planner.distributions import DISTRIBUTIONS, sample_lengths

NON_POWERS_OF_TWO = (6, 10, 12, 20, 24, 40, 48, 96)
POWERS_OF_TWO = tuple(2**i for i in range(1, 11))  # 2 .. 1,024
SHAPES = (*DISTRIBUTIONS, "all_equal", "tiny", "one_giant")
BUDGETS = (64, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]
    dp: int
    cp: int
    max_seqlen: int
    min_cp_size: int
    micro_batch_group_size: int | None
    shape: str

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    def describe(self) -> str:
        return (
            f"{self.shape}: {len(self.lengths)} samples, DP {self.dp} x CP {self.cp} = {self.dp_cp}, max_seqlen "
            f"{self.max_seqlen}, min_cp {self.min_cp_size}, micro_batch_group_size {self.micro_batch_group_size}; "
            f"lengths {list(self.lengths)[:12]}{'...' if len(self.lengths) > 12 else ''}"
        )


def _lengths(rng: random.Random, shape: str, count: int, max_seqlen: int, dp_cp: int) -> list[int]:
    if shape == "all_equal":
        return [rng.randint(1, max_seqlen * 2)] * count
    if shape == "tiny":
        return [rng.randint(1, 8) for _ in range(count)]
    if shape == "one_giant":
        small = [rng.randint(1, max(1, max_seqlen // 4)) for _ in range(count - 1)]
        giant = rng.randint(max_seqlen, max_seqlen * max(1, dp_cp // 2))
        small.insert(rng.randrange(count), giant)
        return small
    return sample_lengths(shape, count, rng.randrange(1 << 30))


def _sample_count(rng: random.Random, dp_cp: int) -> int:
    """Up to a few thousand sample x rank units, so that upstream answers in milliseconds."""
    ceiling = max(4, min(400, 6_000 // dp_cp))
    return rng.choice((1, 2, 3, rng.randint(4, 16), rng.randint(4, ceiling), rng.randint(4, ceiling)))


def draw_case(rng: random.Random, sizes: tuple[int, ...] = POWERS_OF_TWO + NON_POWERS_OF_TWO + (2, 4, 8, 16, 32, 64)) -> Case:
    dp_cp = rng.choice(sizes)
    cp = rng.choice([c for c in (1, 2, 4, 8, 16) if dp_cp % c == 0])
    max_seqlen = rng.choice(BUDGETS)
    shape = rng.choice(SHAPES)
    lengths = _lengths(rng, shape, _sample_count(rng, dp_cp), max_seqlen, dp_cp)
    min_cp = rng.choice((1, 1, 1, 2, 4))
    group = rng.choice((None, None, None, 1, 2, 3, 4, 8))
    return Case(tuple(lengths), dp_cp // cp, cp, max_seqlen, min_cp, group, shape)


def corpus(count: int, seed: int) -> list[Case]:
    rng = random.Random(f"exact-corpus:{seed}")
    return [draw_case(rng) for _ in range(count)]


def non_power_of_two_corpus(count: int, seed: int) -> list[Case]:
    """Cases on DPxCP sizes that are not a power of two only, where dynamic CP is planned batch by
    batch (upstream's plan where it is valid, the substitute elsewhere)."""
    rng = random.Random(f"exact-corpus-non-power-of-two:{seed}")
    return [draw_case(rng, NON_POWERS_OF_TWO) for _ in range(count)]


class _CallBudgetExceeded(Exception):
    pass


# The longest one scheduler call of the corpus may run: each answers in milliseconds, so a call
# still running after this never ends (a bug of the exact path, or of the corpus's budget).
CALL_BOUND_S = 60.0


class CallOverran(AssertionError):
    """A scheduler call ran past CALL_BOUND_S; the message names its input."""


@contextmanager
def bounded(named: str, seconds: float = CALL_BOUND_S):
    """Fails the call inside with CallOverran naming `named` once it has run `seconds`, instead
    of letting it hang the test run. In the main thread only (SIGALRM); pytest-timeout's own
    alarm, if one is set, is restored with the time it had left."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def overran(signum, frame):
        raise CallOverran(f"{named}: still running after {seconds:g} s, a call that does not end")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, overran)
    left, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, left - (time.monotonic() - started)), interval)


def outcome(call: Callable[[], Any], budget: tuple[str, int] | None = None, named: str = "a scheduler call") -> tuple:
    """("ok", result) or ("raised", type name, message). With `budget` (a function name, a count),
    the calls of that function are counted and the call is stopped past the count: ("no end",
    calls). Every call is bounded (`bounded`): one that never ends fails with `named` in the error."""
    with bounded(named):
        return _outcome(call, budget)


def _outcome(call: Callable[[], Any], budget: tuple[str, int] | None) -> tuple:
    if budget is None:
        try:
            return ("ok", call())
        except CallOverran:
            raise
        except Exception as exc:  # noqa: BLE001 - the exception is the outcome
            return ("raised", type(exc).__name__, str(exc))
    calls = 0
    name, most = budget

    def count_calls(frame, event, arg):
        nonlocal calls
        if frame.f_code.co_name == name:
            calls += 1
            if calls > most:
                raise _CallBudgetExceeded
        return None

    sys.settrace(count_calls)
    try:
        return ("ok", call())
    except _CallBudgetExceeded:
        return ("no end", calls)
    except CallOverran:
        raise
    except Exception as exc:  # noqa: BLE001
        return ("raised", type(exc).__name__, str(exc))
    finally:
        sys.settrace(None)


def served_bytes(request, implementation) -> tuple:
    """The whole planning pipeline's answer to `request` with `implementation` planning: the
    response bytes, or the refusal's code and message."""
    from batch_planner.convert import plan_to_proto
    from batch_planner.errors import PlanningError
    from batch_planner.exact.verified import select_implementation
    from batch_planner.planner import plan_batch

    select_implementation(implementation)
    try:
        return ("plan", plan_to_proto(plan_batch(request)).SerializeToString(deterministic=True))
    except PlanningError as error:
        return ("refused", error.code.value, str(error))
    finally:
        select_implementation(None)


def tally(outcomes: list[tuple]) -> Counter:
    return Counter(o[0] if o[0] != "raised" else f"raised {o[1]}" for o in outcomes)
