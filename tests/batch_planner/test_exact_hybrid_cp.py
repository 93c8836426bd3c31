"""Differential tests: batch_planner/exact/hybrid_cp.py against Megatron-Core's own
`BalancedCPScheduler.get_groups_and_subsamples` on a seeded corpus and on Hypothesis examples.

Equal `sample_id_groups` (==, list for list) or the same exception (type and message) on every
case. The corpus: DPxCP every power of two 2..1024 and 6, 10, 12, 20, 24, 40, 48, 96; every named
distribution plus all-equal lengths, tiny lengths (1..8), one giant sample among small ones and
lengths near powers-of-two multiples of the per-rank capacity; 1 to ~500 samples; several
max_seqlen_per_dp_cp_rank values. Upstream is run directly (it terminates on all of these).
"""

from __future__ import annotations

import os
import random
import warnings
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.exact import hybrid_cp
from batch_planner.schedulers import _DpCpGroupSize
from tests.support.exact_corpus import outcome, served_bytes

os.environ.setdefault("NO_VCS_VERSION", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hybrid_cp_schedule = pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
BalancedCPScheduler = hybrid_cp_schedule.BalancedCPScheduler

POWERS = [2**i for i in range(1, 11)]  # 2..1024
NON_POWERS = [6, 10, 12, 20, 24, 40, 48, 96]
MAX_SEQLENS = [1024, 2048, 3000, 4096, 8192, 16384]


def _upstream(pairs, max_seqlen, ranks):
    scheduler = BalancedCPScheduler(max_seqlen, _DpCpGroupSize(ranks))
    return scheduler.get_groups_and_subsamples(list(pairs), None)[1]


def _exact(pairs, max_seqlen, ranks):
    return hybrid_cp.get_groups_and_subsamples(list(pairs), max_seq_len_per_rank=max_seqlen, total_ranks=ranks)


def compare(lengths, max_seqlen, ranks, ids=None):
    pairs = list(zip(ids if ids is not None else range(len(lengths)), lengths))
    named = f"ranks={ranks} max_seqlen={max_seqlen} lengths={lengths}"
    expected = outcome(lambda: _upstream(pairs, max_seqlen, ranks), named=f"upstream on {named}")
    got = outcome(lambda: _exact(pairs, max_seqlen, ranks), named=f"the exact path on {named}")
    assert got == expected, f"ranks={ranks} max_seqlen={max_seqlen} lengths={lengths}: {got!r:.300} != {expected!r:.300}"
    return expected[0] if expected[0] == "ok" else expected[1]


def _lengths(kind: str, count: int, rng: random.Random, max_seqlen: int) -> list[int]:
    if kind in DISTRIBUTIONS:
        return sample_lengths(kind, count, rng.randrange(1 << 30))
    if kind == "equal":
        return [rng.choice([1, 100, max_seqlen // 2, max_seqlen, max_seqlen + 1, 3 * max_seqlen])] * count
    if kind == "tiny":
        return [rng.randint(1, 8) for _ in range(count)]
    if kind == "giant":
        small = [rng.randint(64, 2048) for _ in range(count)]
        small[rng.randrange(count)] = max_seqlen * rng.choice([2, 8, 64, 512, 4096]) - rng.randrange(2)
        return small
    if kind == "boundaries":  # lengths at and around power-of-two multiples of the capacity
        return [max(1, (max_seqlen * 2 ** rng.randint(-3, 6)) + rng.choice([-1, 0, 1])) for _ in range(count)]
    raise AssertionError(kind)


KINDS = [*DISTRIBUTIONS, "equal", "tiny", "giant", "boundaries"]


def corpus():
    """Seeded cases (lengths, max_seqlen, ranks); sample counts shrink as the ranks grow so that
    upstream (O(ranks) per placed sample) keeps the whole run within about a minute."""
    rng = random.Random(20250101)
    cases = []
    for ranks in POWERS + NON_POWERS:
        if ranks <= 64:
            counts, repeats = [1, 2, 3, 5, 8, 17, 40, 100, 250, 500], 2
        elif ranks <= 256:
            counts, repeats = [1, 3, 8, 40, 150, 400], 1
        else:
            counts, repeats = [1, 4, 30, 120, 300], 1
        for kind in KINDS:
            for count in counts:
                for _ in range(repeats):
                    max_seqlen = rng.choice(MAX_SEQLENS)
                    if kind == "tiny":
                        max_seqlen = rng.choice([1, 2, 3, 4, 5, 8])
                    cases.append((_lengths(kind, count, rng, max_seqlen), max_seqlen, ranks))
    # Degenerate inputs: the same exceptions from the same expressions.
    cases += [([], 8192, 8), ([0, 5], 8192, 8), ([5, -3], 8192, 8), ([100], 0, 8), ([100], -4, 8), ([100, 7], 8192, 0), ([3], 8192, 1), ([9000], 8192, 1)]
    return cases


@pytest.mark.timeout(600)  # about 25 s on an idle core
def test_corpus_matches_upstream(capsys):
    outcomes = Counter()
    for lengths, max_seqlen, ranks in corpus():
        outcomes[compare(lengths, max_seqlen, ranks)] += 1
    with capsys.disabled():
        print(f"\nhybrid CP exact vs upstream: {sum(outcomes.values())} requests compared, 0 differences: {dict(sorted(outcomes.items()))}")
    assert outcomes["ok"] > 1000
    assert len(outcomes) > 2  # the corpus reaches upstream's failures too


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("count", "ranks", "max_seqlen"), [(2048, 128, 4096), (4096, 256, 8192)])
def test_at_scale_matches_upstream(count, ranks, max_seqlen):
    assert compare(sample_lengths("lognormal_32k", count, 0), max_seqlen, ranks) == "ok"


def test_ids_are_carried_not_positions():
    rng = random.Random(7)
    lengths = sample_lengths("lognormal_32k", 200, 3)
    ids = [f"s{rng.randrange(10**6)}" for _ in lengths]
    assert compare(lengths, 4096, 64, ids=ids) == "ok"


HYPOTHESIS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.timeout(120)
def test_hypothesis_matches_upstream(capsys):
    outcomes: Counter = Counter()

    @HYPOTHESIS
    @given(
        ranks=st.one_of(st.sampled_from(POWERS[:7] + NON_POWERS), st.integers(1, 40)),
        max_seqlen=st.one_of(st.sampled_from([1, 2, 3, 7, 64, 1000, 4096]), st.integers(1, 20000)),
        lengths=st.lists(st.one_of(st.integers(1, 9), st.integers(1, 70000), st.sampled_from([1024, 2048, 4096, 8192, 8193])), min_size=1, max_size=120),
    )
    def matches(ranks, max_seqlen, lengths):
        outcomes[compare(lengths, max_seqlen, ranks)] += 1

    matches()
    with capsys.disabled():
        print(f"\nhybrid CP hypothesis: {sum(outcomes.values())} examples: {dict(sorted(outcomes.items()))}")
    assert outcomes["ok"] > 0, outcomes  # the examples reach plans, not only refusals


def test_guard_against_a_micro_batch_that_consumes_nothing(monkeypatch):
    """Unreachable with upstream's algorithm (module doc); the guard raises instead of looping."""
    from batch_planner.errors import SchedulerWouldNotTerminate

    monkeypatch.setattr(hybrid_cp, "_next_micro_batch", lambda ids, needs, costs, ranks: ([[]] * ranks, list(range(len(ids)))))
    with pytest.raises(SchedulerWouldNotTerminate, match="placed none of the 3 samples"):
        hybrid_cp.get_groups_and_subsamples([(0, 5), (1, 6), (2, 7)], max_seq_len_per_rank=8, total_ranks=4)


def test_the_whole_pipeline_serves_the_same_bytes_and_refusals(capsys):
    """Validation, the scheduler, the alignment of CP groups, invariants, statistics, plan id: the
    response bytes (or the refusal) are the same whichever implementation is set for hybrid CP."""
    from batch_planner.exact.verified import SchedulerImplementation, exact_path_status
    from batch_planner.request import PlanRequest, SchedulerKind

    assert exact_path_status(SchedulerKind.HYBRID_CP).active, exact_path_status(SchedulerKind.HYBRID_CP).reason
    served = served_bytes

    rng = random.Random(11)
    plans = 0
    for _ in range(300):
        ranks = rng.choice(POWERS[:8])
        cp = rng.choice([c for c in (1, 2, 4) if ranks % c == 0])
        max_seqlen = rng.choice(MAX_SEQLENS)
        count = rng.choice([1, 5, 40, 200])
        lengths = [int(length) for length in _lengths(rng.choice(KINDS), count, rng, max_seqlen)]
        request = PlanRequest.of(lengths, ranks // cp, cp, max_seqlen, scheduler=SchedulerKind.HYBRID_CP)
        exact = served(request, SchedulerImplementation.EXACT)
        assert exact == served(request, SchedulerImplementation.UPSTREAM), f"ranks={ranks} cp={cp} max_seqlen={max_seqlen} lengths={lengths}"
        # `compiled` has no hybrid-CP kernel: the pure-Python exact path, the same bytes.
        assert served(request, SchedulerImplementation.COMPILED) == exact, f"compiled: ranks={ranks} cp={cp} lengths={lengths}"
        plans += exact[0] == "plan"
    with capsys.disabled():
        print(f"\nwhole pipeline, hybrid CP exact vs upstream: 300 requests, {plans} plans, identical bytes and refusals")
    assert plans > 100
