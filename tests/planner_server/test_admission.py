"""planner_server/admission.py: the in-flight bound, each job's share of it, and which requests
are planned inline (InlineBound)."""

from __future__ import annotations

import pytest

from batch_planner.v1 import planner_pb2 as pb
from planner_server.admission import Admission, InlineBound, JobShareExceeded, PoolOverloaded, request_bytes_bound


# --- Admission's per-job share ---


def held_by(admission: Admission, job: str) -> int:
    return admission._by_job.get(job, 0)


def test_a_job_past_its_share_is_refused_while_others_are_admitted():
    admission = Admission(8, job_share=0.5)
    assert admission.job_bound == 4
    for _ in range(4):
        admission.reserve(1, "burst")
    with pytest.raises(JobShareExceeded, match=r"job 'burst' holds 4 slots in flight.*its share is 4 \(0.5 of the server's bound of 8\)") as refused:
        admission.reserve(1, "burst")
    assert refused.value.job == "burst"
    admission.reserve(1, "quiet")
    admission.reserve(3, "")  # the shared bucket of requests without a job name
    assert admission.in_flight == 8
    with pytest.raises(PoolOverloaded) as full:
        admission.reserve(1, "third")
    assert not isinstance(full.value, JobShareExceeded)  # the total bound
    admission.release(1, "burst")
    admission.reserve(1, "third")
    assert (held_by(admission, "burst"), held_by(admission, "third"), admission.in_flight) == (3, 1, 8)


def test_auto_candidates_count_against_the_share():
    admission = Admission(8, job_share=0.5)
    admission.reserve(3, "auto-job")
    with pytest.raises(JobShareExceeded, match="needs 2 \\(auto: one per candidate, at most one per worker\\)"):
        admission.reserve(2, "auto-job")
    admission.reserve(1, "auto-job")


def test_share_one_turns_fairness_off_and_released_jobs_are_forgotten():
    admission = Admission(4, job_share=1.0)
    for _ in range(4):
        admission.reserve(1, "only")
    with pytest.raises(PoolOverloaded) as full:
        admission.reserve(1, "only")
    assert not isinstance(full.value, JobShareExceeded)
    admission.release(4, "only")
    assert held_by(admission, "only") == 0 and admission._by_job == {}
    assert Admission(3, job_share=0.1).job_bound == 1  # at least one slot


def test_inline_bound_admits_small_requests_on_few_ranks_only():
    bound = InlineBound(max_samples=8, max_ranks=4)
    assert bound.admits(8, 4)
    assert not bound.admits(9, 4)  # too many samples
    assert not bound.admits(8, 8)  # too many ranks
    assert not InlineBound().admits(1, 1)  # max_samples 0: nothing inline
    assert not InlineBound().admits(0, 0)


def test_the_request_bytes_bound_holds_every_request_within_the_limit():
    lengths = [(1 << 62) - 1] * 8  # the longest varints a length can take
    message = pb.PlanRequest(sequence_lengths=lengths, layout=pb.ParallelLayout(data_parallel_size=1 << 31, context_parallel_size=1 << 31),
                             max_seqlen_per_dp_cp_rank=(1 << 62) - 1, job="j" * 63)
    assert len(message.SerializeToString()) <= request_bytes_bound(8)
