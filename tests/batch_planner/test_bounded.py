"""batch_planner/bounded.py: a pure-Python call that never returns is cut off after its limit, in the
main thread and in any other (a server's handler, a trainer's planning thread); a call that returns
in time is untouched and leaves nothing pending behind; the request's deadline shortens the limit."""

from __future__ import annotations

import threading
import time

import pytest

from batch_planner import bounded


def _loops_for_ever() -> None:
    state = [0]
    while True:  # like upstream's align_sample_id_groups on some batches: pure Python, no end
        state[0] = (state[0] + 1) % 7


def test_a_call_that_never_returns_is_cut_off_in_the_main_thread():
    started = time.monotonic()
    with pytest.raises(bounded.CutOff, match="did not return within 0.2 s"):
        bounded.call_within(_loops_for_ever, 0.2)
    assert time.monotonic() - started < 30


def test_a_call_that_never_returns_is_cut_off_in_another_thread():
    outcome: list[BaseException] = []

    def planning_thread() -> None:
        try:
            bounded.call_within(_loops_for_ever, 0.2)
        except bounded.CutOff as cut:
            outcome.append(cut)

    thread = threading.Thread(target=planning_thread)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and len(outcome) == 1


def test_a_call_that_returns_in_time_is_untouched_and_leaves_nothing_pending():
    assert bounded.call_within(lambda: sum(range(1000)), 5.0) == 499500
    # Nothing fires later in unrelated code: a loop after the call runs well past the limit.
    assert bounded.call_within(lambda: 7, 0.05) == 7
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        pass


def test_the_requests_deadline_shortens_the_limit():
    assert bounded.limit_seconds() == bounded.DEFAULT_LIMIT_SECONDS
    with bounded.request_deadline(time.time() + 1.0):
        assert 0.0 < bounded.limit_seconds() <= 1.0 * bounded.DEADLINE_SHARE
    with bounded.request_deadline(time.time() + 1000.0):  # a long deadline: its share, not the default
        assert bounded.limit_seconds() > bounded.DEFAULT_LIMIT_SECONDS
    with bounded.request_deadline(time.time() - 1.0):
        assert bounded.limit_seconds() == 0.0
    assert bounded.limit_seconds() == bounded.DEFAULT_LIMIT_SECONDS
