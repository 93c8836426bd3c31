"""batch_planner/validation.py: what a sequence length is, and each request limit refused with
its field named."""

from __future__ import annotations

import pytest

from batch_planner.errors import InvalidRequestError
from batch_planner.request import PlanRequest
from batch_planner.validation import RequestLimits, sequence_lengths_of, validate_request


@pytest.mark.parametrize("values, words", [
    ([1, 2.5], "sample 1 has value 2.5 (float)"),
    ([1, True], "(bool)"),
    ([3, 0], "sample 1 has length 0"),
    ([], "sequence_lengths"),
    (5, "sequence_lengths"),
])
def test_what_is_not_a_length_is_refused_with_the_sample_named(values, words):
    with pytest.raises(InvalidRequestError, match="sequence_lengths") as refused:
        sequence_lengths_of(values)
    assert words in str(refused.value)


def test_integers_of_any_kind_are_lengths():
    numpy = pytest.importorskip("numpy")
    assert sequence_lengths_of([1, numpy.int64(2), 3]) == (1, 2, 3)


LIMITS = RequestLimits(max_samples_per_request=4, max_dp_cp_size=8, max_sequence_length=1000, max_tensor_parallel_size=2)


@pytest.mark.parametrize("request_, field", [
    (PlanRequest.of((10,) * 5, 2, 1, 512), "sequence_lengths"),  # too many samples
    (PlanRequest.of((10,), 16, 1, 512), "layout.data_parallel_size"),
    (PlanRequest.of((10,), 4, 4, 512), "layout"),  # DPxCP 16 past 8
    (PlanRequest.of((1001,), 2, 1, 512), "sequence_lengths"),  # a sample past the longest allowed
    (PlanRequest.of((10,), 2, 1, 512, job="no spaces"), "job"),
])
def test_each_limit_is_refused_with_its_field(request_, field):
    with pytest.raises(InvalidRequestError) as refused:
        validate_request(request_, LIMITS)
    assert refused.value.field == field and str(refused.value).startswith(f"{field}: ")
