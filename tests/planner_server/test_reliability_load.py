"""Load, short CI version: 16 concurrent clients for 10 s against the session's
real planner, batches of up to 512 samples on 32 ranks. No unexpected error, latency percentiles reported, resident memory of the server
(with forkserver and workers) does not grow without bound. The 60 s version is bench/load.py."""

from __future__ import annotations

from bench.load import run_load

MIB = 1024 * 1024


def test_short_load_has_no_unexpected_error_and_bounded_memory(planner):
    result = run_load(planner.address, planner.proc.pid, duration_s=10.0, clients=16, warm_up_s=3.0, max_samples=512)
    print("\n" + result.table())  # shown with -s, and in the failure report
    assert not result.unexpected, result.unexpected[:5]
    assert result.codes.get("OK", 0) >= 10, result.codes
    assert result.codes.get("INVALID_ARGUMENT", 0) >= 1, result.codes  # the mix's invalid entry
    assert set(result.codes) <= {"OK", "INVALID_ARGUMENT"}, result.codes  # 16 clients < the queue bound
    assert 0 < result.percentile(50) <= result.percentile(99) < 60.0
    # Generous: planning 2048-sample batches allocates tens of MiB per worker and Python keeps
    # some of it; a leak of every request's message or plan would exceed this within 10 s.
    assert result.rss_at_end() - result.rss_after_warm_up() < 150 * MIB, result.table()
