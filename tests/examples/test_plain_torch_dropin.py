"""examples/plain_torch_dropin.py, the drop-in built only from the seam, in a plain PyTorch loop: four
gloo ranks DP2 x CP2 with the seam's process groups (dpxcp_groups), a real planner on loopback, each DP
rank's loader yielding its half of every step's global batch (lengths that are not multiples of
2 x CP: tests/support/dropin_attention.step_samples), and the attention model with the CPU stand-in for
Transformer Engine's THD/CP attention (tests/support/attention_model.py). The loop runs the model on each
unit the example hands out and sums the loss normalised over the global batch's loss tokens
(tests/support/attention_parity.packed_loss_and_grads, which also all-reduces the gradients over DPxCP).

Each step, in both CP layouts: the loss, every real token's loss and every gradient equal the same
model over each whole sample alone (no CP); every real token is trained exactly once; the step has
CP groups of more than one size, and CP groups that pad."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks
from tests.support.dropin_attention import assert_planned_step

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

WORLD = 4  # DP2 x CP2
CP = 2
STEPS = 2
LAYOUTS = ("zigzag", "contiguous")
TOLERANCE = 1e-4  # fp32 on the CPU: only the order of additions differs (tests/trainer_client/attention/test_cp_attention_client.py)


def plain_loop_rank(endpoint: str, rank: int) -> dict:
    """One rank: the example's groups, then each layout's loader and loop; records by layout."""
    from trainer_client.dropin import dpxcp_groups
    from tests.support.megatron_init import initialize_dpxcp_groups

    initialize_dpxcp_groups(context_parallel_size=CP)  # Megatron-Core's parallel_state, for the model alone
    groups, cp_group_for = dpxcp_groups(CP)
    return {layout: _train(endpoint, groups, cp_group_for, layout) for layout in LAYOUTS}


def _train(endpoint: str, groups, cp_group_for, layout: str) -> list[dict]:
    import torch.distributed as dist

    from examples.plain_torch_dropin import PlannedLoader
    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.attention_parity import RankShard, packed_loss_and_grads, reference_loss_and_grads, worst_differences
    from tests.support.dropin_attention import MAX_SEQLEN_PER_RANK, dp_rank_batches, step_samples, units_record
    from tests.support.megatron_init import parallel_state_cp_group
    from trainer_client.dropin import model_inputs

    # Contiguous: static CP1 in the model's config, as upstream allows it (tests/support/attention_model.py).
    model = attention_gpt_model(AttentionModelConfig(cp_partition_mode=layout, context_parallel_size=CP if layout == "zigzag" else 1))
    planner = {"planner_endpoint": endpoint, "deadline_seconds": 30.0, "fallback": False, "job": f"plain-torch-{layout}"}
    data = dp_rank_batches(STEPS, groups.dp.rank(), groups.dp.size())
    records = []
    with PlannedLoader(data, groups, cp_group_for, max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_RANK, cp_layout=layout, planner=planner) as loader:
        for step, units in enumerate(loader):
            samples = step_samples(step, groups.dp.size())
            shards = [RankShard.of(model_inputs(u, torch.device("cpu")), u.token_fields["token_ids_plus_one"] - 1) for u in units]
            # The loop's normaliser, from its units alone: the global batch's loss tokens.
            loss_tokens = torch.tensor([sum(float(u.token_fields["loss_mask"].sum()) for u in units)])
            dist.all_reduce(loss_tokens)
            got = packed_loss_and_grads(model, shards, samples)
            want = reference_loss_and_grads(model, samples, parallel_state_cp_group(1))
            records.append({**units_record(units, samples), "worst": worst_differences(got, want, samples),
                            "source": loader.last_step.source, "loss_tokens": float(loss_tokens)})
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory, planner) -> dict[str, list[list[dict]]]:
    """Each layout's records: per rank, per step (one run of the ranks)."""
    require_dynamic_build()
    per_rank = run_attention_ranks(partial(plain_loop_rank, planner.address), WORLD, tmp_path_factory.mktemp("ranks"))
    assert all("raised" not in r for r in per_rank), [r.get("raised") for r in per_rank]
    return {layout: [r[layout] for r in per_rank] for layout in LAYOUTS}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_plain_loop_trains_the_planned_units_as_whole_samples(runs, layout):
    per_rank = runs[layout]
    assert all(len(steps) == STEPS for steps in per_rank), per_rank
    for step in range(STEPS):
        assert_planned_step([steps[step] for steps in per_rank], TOLERANCE, (layout, step))
