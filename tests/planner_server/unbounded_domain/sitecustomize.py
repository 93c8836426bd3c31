"""Test only: a server started with this folder on PYTHONPATH accepts every layout (its domain check
says yes to all), so Megatron-Core's own looping code really runs in it - what a wrong domain
would let through. tests/batch_planner/test_scheduler_domain.py uses it to show that shutdown is bounded even
then; nothing else puts it on a path."""

import batch_planner.domain as _domain

_domain.layout_refusal = lambda *args, **kwargs: None
