"""The trainer client's own micro-batches through a model whose tokens interact: what
`micro_batches_for_rank` (trainer_client/plans/apply.py: batch_planner/padding.py's padding and
batch_planner/shards.py's shards, the path of `BatchPlannerClient.micro_batches` and of the Bridge
drop-in) hands a Megatron-Core GPTModel, against the same model over each whole sample alone.

One body for both engines (tests/support/attention_model.py): the CPU stand-in for Transformer Engine's
THD/CP attention (tests/trainer_client/attention/test_cp_attention_client.py) and Transformer Engine itself on a GPU
(tests/trainer_client/transformer_engine/test_te_client_units.py). Four ranks, DP2 x CP2 with the dev build's
dynamic-CP groups, one step of a dynamic-CP plan with CP1, CP2 and CP4 groups; sequence lengths
that are not multiples of 2 x CP, so every CP group pads; both layouts (contiguous: the model's
config says so, and Megatron-Core converts the shards to zigzag around attention).

`plant="rotated"` gives every rank of a CP group the shard of the next rank (`padded_unit_shard`
asked for group rank r + 1): a planted mistake the parity must catch."""

from __future__ import annotations

from typing import Literal

import torch

from tests.support.attention_parity import Sample, example_samples, token_offsets

WORLD = 4
MAX_SEQLEN = 48
LENGTHS = (150, 17, 90, 5, 30, 9, 70, 3, 40, 13, 26, 101)
"""Real lengths, none a multiple of 4: at MAX_SEQLEN tokens per rank, the plan has CP1, CP2 and CP4
groups (150 needs CP4, 70, 90 and 101 CP2 or more)."""

Plant = Literal["none", "rotated"]


def unit_batch(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The global batch as the client takes it (a mapping of jagged fields): each token's global id
    plus one too (0 on the padding rows the client adds)."""
    offsets = token_offsets(samples)

    def jagged(parts):
        return torch.nested.as_nested_tensor(parts, layout=torch.jagged)

    return {
        "input_ids": jagged([s.tokens for s in samples]), "labels": jagged([s.labels for s in samples]),
        "loss_mask": jagged([s.loss_mask for s in samples]),
        "token_ids_plus_one": jagged([torch.arange(len(s)) + offsets[i] + 1 for i, s in enumerate(samples)]),
    }


def client_units_rank(engine: str, variants: list[tuple[str, str]], rank: int) -> dict:
    """One rank: for each (layout, plant) of `variants`, the plan, its units from
    trainer_client.plans.apply, the packed run and the reference; records by "layout-plant"."""
    from tests.support.megatron_init import initialize_dpxcp_groups

    initialize_dpxcp_groups(context_parallel_size=2)
    return {f"{layout}-{plant}": _variant(engine, layout, plant) for layout, plant in variants}


def _variant(engine: str, layout: str, plant: str) -> dict:
    from unittest import mock

    import torch.distributed as dist

    from batch_planner.exact.verified import SchedulerImplementation
    from batch_planner.planner import plan_batch
    from batch_planner.request import CpLayout, PlanRequest, SchedulerKind
    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.attention_parity import RankShard, packed_loss_and_grads, reference_loss_and_grads, worst_differences
    from tests.support.megatron_init import parallel_state_cp_group
    from trainer_client.plans import apply
    from trainer_client.dropin import model_inputs
    from trainer_client.plans.megatron import megatron_cp_group_resolver

    samples = example_samples(LENGTHS)
    # contiguous: static CP1 in the model's config, as upstream allows contiguous for standard
    # attention (tests/support/attention_model.py); the dynamic groups are parallel_state's either way.
    cfg = AttentionModelConfig(engine=engine, cp_partition_mode=layout, context_parallel_size=2 if layout == "zigzag" else 1,
                               hidden_size=128 if engine == "transformer-engine" else 32)
    model = attention_gpt_model(cfg)
    reference = reference_loss_and_grads(model, samples, parallel_state_cp_group(1))
    request = PlanRequest.of([len(s) for s in samples], 2, 2, MAX_SEQLEN, scheduler=SchedulerKind.DYNAMIC_CP, cp_layout=CpLayout(layout))
    plan = plan_batch(request, implementation=SchedulerImplementation.UPSTREAM)  # Megatron-Core's own code: no compile per rank
    original = apply.padded_unit_shard
    rotated = (lambda padded, cp, r, lay: original(padded, cp, (r + 1) % cp, lay)) if plant == "rotated" else original
    with mock.patch.object(apply, "padded_unit_shard", rotated):
        units = apply.micro_batches_for_rank(plan, unit_batch(samples), dist.get_rank(), megatron_cp_group_resolver(plan),
                                             pack_group_samples=True)
    shards = [RankShard.of(model_inputs(u, torch.device("cpu"), tokens="input_ids"), u.token_fields["token_ids_plus_one"] - 1)
              for u in units]
    got = packed_loss_and_grads(model, shards, samples)
    return {
        "loss": got.loss, "reference": reference.loss, "worst": worst_differences(got, reference, samples),
        "cp_sizes": sorted({u.local_cp_size for u in units}),
        "padded_in_groups": sum(int((~u.padding_mask).sum()) for u in units if u.local_cp_size > 1),
    }
