"""Megatron-LM's own test cases of dynamic CP's scheduler, run on every implementation.

Megatron-LM's unit tests (tests/unit_tests in the Megatron-LM repository, at a dev commit later
than the pinned build; the installed wheel ships none) assert what `DefaultDynamicCPScheduler`
returns on a few inputs. This test sends the same public inputs through Megatron-Core's own code,
the pure-Python exact path and the compiled one, and asserts the answer those tests expect from
each. Their code is not used: only the inputs and the expected groups.

Not covered: their `min_cp_size=3` constructor refusal (the installed build's constructor does not
refuse it; validation.py refuses a non-power-of-two min_cp_size before any scheduler runs) and the
tests of data movement around the scheduler (rerouting, THD batches), which are no part of planning.
"""

from __future__ import annotations

import pytest

from batch_planner.exact import compiler
from batch_planner.request import SchedulerKind
from batch_planner.schedulers import _load_class
from tests.support.megatron_builds import require_scheduler
from tests.batch_planner.test_exact_differential import Case, _exact

# (max_seqlen_per_dp_cp_rank, cp, dp, lengths, expected sample_id_groups), from their tests:
CASES = {
    # test_default_dynamic_cp_scheduler_uses_packing_aware_grouping: a short sample joins the long
    # one's CP2 group rather than a group of its own.
    "packing-aware grouping": (4096, 2, 1, (6144, 2048), [[[0, 1], [0, 1]]]),
    # test_next_hdp_group_packing_aware_fills_non_power_of_two_group, as the scheduler's one
    # micro-batch: two samples fill all 14 ranks of a non-power-of-two DPxCP.
    "non-power-of-two fill": (100, 1, 14, (50, 50), [[[0, 1]] * 14]),
    # test_dynamic_cp_two_samples_five_images_share_cp8: the scheduler's assignment of its four samples.
    "two samples share CP8": (128, 8, 2, (768, 256, 512, 512), [[[0, 1]] * 8 + [[2]] * 4 + [[3]] * 4]),
}

IMPLEMENTATIONS = ("upstream", "exact", "compiled")


@pytest.fixture(scope="module", autouse=True)
def dynamic_cp_build():
    require_scheduler(SchedulerKind.DYNAMIC_CP)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_megatron_lm_scheduler_cases(name, implementation):
    max_seqlen, cp, dp, lengths, expected = CASES[name]
    if implementation == "compiled" and not compiler.available():
        pytest.skip(f"the compiled exact path is not checked: {compiler.unavailable_reason()}")
    if implementation == "upstream":
        scheduler = _load_class(SchedulerKind.DYNAMIC_CP)(max_seqlen, cp, dp, None)
        got = scheduler.get_groups_and_subsamples(list(enumerate(lengths)))
    else:
        got = _exact(Case(lengths, dp, cp, max_seqlen, 1, None, name), implementation)
    assert got == expected
