"""Which CP group sizes Megatron-Core can build a process group for: the one home of that rule.

A plan may only use group sizes the trainer's `parallel_state` creates (plan invariant 3, see
docs/design.md, "Plan invariants"). Both builds create the same sizes over the DPxCP ranks:

- Megatron-LM dev (`initialize_model_parallel(dynamic_context_parallel=True)`,
  `create_dynamic_dp_cp_groups`): every power of two 2**i with i < floor(log2(DPxCP)) and
  2**i >= min_cp_size (size 1 included), plus the whole DPxCP group. It asserts an even DPxCP;
  for 24 ranks that is 1, 2, 4, 8 and 24 (no 16: 16 does not tile 24 ranks).
- 0.19 hybrid CP (`hybrid_context_parallel=True`, `create_hybrid_dp_cp_groups`): the same
  powers of two from 2, plus the whole group; CP1 runs without a group. Its scheduler needs a
  power-of-two DPxCP.

Static CP (and the static-packing scheduler) uses exactly the job's CP size.
"""

from __future__ import annotations

import math


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def megatron_cp_group_sizes(dp_cp_size: int, min_cp_size: int | None = None) -> frozenset[int]:
    """The group sizes parallel_state builds over `dp_cp_size` ranks (see the module doc)."""
    floor_log2 = int(math.log2(dp_cp_size))
    sizes = {2**i for i in range(floor_log2) if 2**i >= (min_cp_size or 1)}
    return frozenset(sizes | {dp_cp_size})


def largest_power_of_two_group(dp_cp_size: int) -> int:
    """The largest power-of-two group parallel_state builds over `dp_cp_size` ranks: the whole
    group when DPxCP is a power of two, else the largest partial one (8 for 24 ranks).

    Megatron-Core's schedulers give a sample a power-of-two CP size, so this bounds how long one
    sample may be: max_seqlen_per_dp_cp_rank x this.
    """
    return max(size for size in megatron_cp_group_sizes(dp_cp_size) if is_power_of_two(size))


def static_cp_sizes(dp_cp_size: int) -> list[int]:
    """The CP sizes a static-CP plan over `dp_cp_size` ranks may use, smallest first: the group
    sizes parallel_state builds that tile the ranks (auto's static candidates, the substitute's)."""
    return sorted(size for size in megatron_cp_group_sizes(dp_cp_size) if dp_cp_size % size == 0)
