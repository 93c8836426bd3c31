"""What the drop-ins' attention tests share: the attention model (tests/support/attention_model.py) trained
on the micro-batches a drop-in hands out, read the way Megatron-LM's own forward step reads them
(Megatron-Core's `get_batch_on_this_rank_for_sequence_packing`: the CP slice of each packed
micro-batch, its `PackedSeqParams` with the micro-batch's CP group), through Megatron-Core's
pipeline schedules, against the same pipeline run over each whole sample alone at CP1.

CPU stand-in (named as such): `thd_partitioned_indices_standin` answers for Transformer Engine's
`thd_get_partitioned_indices` (a CUDA kernel), which Megatron-Core's `get_cp_slice_for_thd` calls
to cut a packed micro-batch for one CP rank. It follows Transformer Engine's documented
DualChunkSwap contract (tests/attention_parity.te_zigzag_rows: chunks r and 2c-1-r of each padded
sequence's 2c chunks), not this project's code; a shard swapped, or cut from another layout,
gives the wrong tokens to the attention stand-in and the parity fails."""

from __future__ import annotations

from typing import Sequence

import torch

from tests.support.attention_parity import Sample, beyond, example_samples, te_zigzag_rows, token_offsets

SAMPLES_PER_DP_RANK = 6
PAD_MULTIPLE = 8
"""Every sample is padded to a multiple of 2 x 4 (the largest CP group of a DPxCP group of 4), as a
dataset for dynamic CP pads them: Transformer Engine's THD layout needs 2 x CP."""
MAX_SEQLEN_PER_RANK = 40


def thd_partitioned_indices_standin(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """CPU stand-in for Transformer Engine's `thd_get_partitioned_indices` (module docstring)."""
    assert int(cu_seqlens_padded[-1]) == int(total_tokens), (cu_seqlens_padded, total_tokens)
    return te_zigzag_rows(cu_seqlens_padded, cp_size, cp_rank)


def stand_in_for_te_partitioning_on_cpu() -> None:
    if torch.cuda.is_available():
        return
    from megatron.core.datasets import data_schedule_utils

    data_schedule_utils.get_thd_partitioned_indices = thd_partitioned_indices_standin


def step_samples(step: int, dp_size: int) -> list[Sample]:
    """The global batch of `step`: SAMPLES_PER_DP_RANK samples per DP rank, in DP rank order
    (Megatron-Core's global ids), short and long, each step different."""
    g = torch.Generator().manual_seed(31 + step)
    lengths = [int(x) for x in torch.randint(3, 70, (SAMPLES_PER_DP_RANK * dp_size,), generator=g)]
    lengths[step % len(lengths)] = 100 + step  # one long sample a step: a CP group of 4
    return example_samples(lengths)


def dp_rank_batches(steps: int, dp_rank: int, dp_size: int):
    """What DP rank `dp_rank`'s data loader yields in a loop that hands lists of samples (the
    examples' drop-ins): its samples of each step's global batch, each with its tokens' global ids
    plus one (0 on the padding rows the plan adds) to check who trained them."""
    for step in range(steps):
        samples = step_samples(step, dp_size)
        offsets = token_offsets(samples)
        mine = range(dp_rank * SAMPLES_PER_DP_RANK, (dp_rank + 1) * SAMPLES_PER_DP_RANK)
        yield [{"tokens": samples[i].tokens, "labels": samples[i].labels, "loss_mask": samples[i].loss_mask,
                "token_ids_plus_one": torch.arange(len(samples[i])) + offsets[i] + 1} for i in mine]


def units_record(units, samples: Sequence[Sample]) -> dict:
    """What one rank's units of a step hold (samples from `dp_rank_batches`), for `assert_planned_step`:
    the global ids of the real tokens they train, the CP sizes, the padding rows of CP groups, and
    the step's tokens and loss tokens."""
    return {
        "trained": sorted(int(i) for u in units for i in u.token_fields["token_ids_plus_one"][u.padding_mask] - 1),
        "tokens": token_offsets(samples)[-1], "cp_sizes": sorted({u.local_cp_size for u in units}),
        "padded_in_groups": sum(int((~u.padding_mask).sum()) for u in units if u.local_cp_size > 1),
        "reference_loss_tokens": float(sum(float(s.loss_mask.sum()) for s in samples)),
    }


def assert_planned_step(records: Sequence[dict], tolerance: float, where: object) -> None:
    """Every rank's record of one step (`units_record`'s, with the plan's `source`, the loop's
    `loss_tokens` and its `worst` differences from the whole samples): the planner on loopback
    planned it, with CP groups of more than one size and CP groups that pad; every real token trained
    exactly once; the loop's normaliser and its loss and gradients those of the whole samples."""
    assert records[0]["source"] == "service", records[0]  # DPxCP rank 0 asked the planner on loopback
    assert len({size for r in records for size in r["cp_sizes"]}) > 1, [r["cp_sizes"] for r in records]
    assert sum(r["padded_in_groups"] for r in records) > 0, "no CP group pads: the lengths test nothing"
    trained = sorted(i for r in records for i in r["trained"])
    assert trained == list(range(records[0]["tokens"])), "a real token trained twice or never"
    for rank, r in enumerate(records):
        assert r["loss_tokens"] == r["reference_loss_tokens"] > 0, (where, rank, r)
        assert beyond(r["worst"], tolerance) == [], (where, rank, r["worst"])


def padded_length(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def dataset_item(sample: Sample) -> dict[str, torch.Tensor]:
    """One sample as a varlen dataset yields it for Megatron-Core's packing schedulers: 1-D fields
    padded to `padded_length` (padding: token 0, loss mask 0), with its real and padded length."""
    n, p = len(sample), padded_length(len(sample))
    pad = p - n
    return {
        "tokens": torch.cat([sample.tokens, sample.tokens.new_zeros(pad)]),
        "labels": torch.cat([sample.labels, sample.labels.new_zeros(pad)]),
        "loss_mask": torch.cat([sample.loss_mask, sample.loss_mask.new_zeros(pad)]).float(),
        "position_ids": torch.arange(p),
        "original_seq_len": torch.tensor([n]),
        "padded_seq_len": torch.tensor([p]),
    }


def dp_rank_items(steps: int, dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """Everything DP rank `dp_rank`'s data iterator yields over `steps` steps (new dicts each call:
    Megatron-Core's scheduler deletes the fields a stage does not keep)."""
    out = []
    for step in range(steps):
        samples = step_samples(step, dp_size)
        out += [dataset_item(s) for s in samples[dp_rank * SAMPLES_PER_DP_RANK:(dp_rank + 1) * SAMPLES_PER_DP_RANK]]
    return out


def packing_config(model_config, scheduler: str = "default_dynamic_cp"):
    """The model's TransformerConfig with the sequence-packing fields Megatron-LM sets from its
    arguments (set after the config's own checks, which ask for Transformer Engine >= 2.9 with a
    packing scheduler: GPU trainers have it, this machine cannot)."""
    config = model_config
    config.sequence_packing_scheduler = scheduler
    config.max_seqlen_per_dp_cp_rank = MAX_SEQLEN_PER_RANK
    config.min_dynamic_context_parallel_size = 1
    return config


def packed_forward_step(config, vpp_size: int | None):
    """Megatron-LM's forward step for packed sequences: Megatron-Core's
    `get_batch_on_this_rank_for_sequence_packing` (this virtual stage's fields, the CP slice, the
    micro-batch's CP group), then the model; its loss function returns {"loss": [loss, tokens]}."""
    from megatron.core.datasets.data_schedule import get_batch_on_this_rank_for_sequence_packing
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    def forward_step(data_iterator, model):
        vp_stage = getattr(model, "vp_stage", None)
        mtp = mtp_on_this_rank(config, ignore_virtual=False, vp_stage=vp_stage)
        tokens, labels, loss_mask, _, position_ids, params, _ = get_batch_on_this_rank_for_sequence_packing(
            data_iterator, vpp_size=vpp_size, mtp_on_this_rank=mtp, vp_stage=vp_stage, dynamic_cp=True, config=config,
        )
        output = model(input_ids=tokens, position_ids=position_ids, attention_mask=None, labels=labels,
                       loss_mask=loss_mask, packed_seq_params=params)

        def loss_func(per_token):
            mask = loss_mask.reshape(-1)
            loss = (per_token.reshape(-1) * mask).sum()
            return loss, mask.sum().to(torch.int), {"loss": torch.stack([loss.detach(), mask.sum()])}

        return output, loss_func

    return forward_step


def expert_sums(models, expert_parallel: int):
    """How MoE experts' gradients compare (None: no experts): (their names, the group Megatron-Core
    sums them over, the expert-data-parallel group, and the factor of the reference's: the
    reference runs every sample on every rank of an expert-parallel group, whose all-to-all sends
    each expert every token `expert_parallel` times)."""
    from megatron.core import parallel_state

    names = {f"{i}.{n}" for i, m in enumerate(models) for n, p in m.named_parameters() if getattr(p, "allreduce", True) is False}
    if not names:
        return None
    return names, parallel_state.get_expert_data_parallel_group(), 1.0 / expert_parallel


def grad_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], group, experts=None) -> list[str]:
    """Gradients summed over `group` (Megatron-Core reduces them over DP x CP; experts': `experts`,
    from `expert_sums`) against the reference's, each relative to its largest entry."""
    import torch.distributed as dist

    errors = []
    expert_names, expert_group, factor = experts or (set(), None, 1.0)
    if experts is not None and not expert_names:
        errors.append("no expert parameters")
    for name, reference in want.items():
        summed = got[name].clone()
        if name in expert_names:
            reference = reference * factor
            dist.all_reduce(summed, group=expert_group)
        else:
            dist.all_reduce(summed, group=group)
        scale = float(reference.abs().max())
        diff = float((summed - reference).abs().max())
        if diff > 1e-6 + 1e-4 * scale:
            errors.append(f"gradient of {name} differs by {diff:.3g} (largest entry {scale:.3g})")
    return errors


def same_micro_batches(ours: Sequence[dict], theirs: Sequence[dict]) -> list[str]:
    """Where two lists of packed micro-batches differ: count, keys, any tensor (bitwise)."""
    if len(ours) != len(theirs):
        return [f"{len(ours)} micro-batches, upstream {len(theirs)}"]
    problems = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if sorted(a) != sorted(b):
            problems.append(f"micro-batch {i}: fields {sorted(a)}, upstream {sorted(b)}")
            continue
        for key in a:
            x, y = torch.as_tensor(a[key]), torch.as_tensor(b[key])
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                problems.append(f"micro-batch {i}: field {key!r} differs")
    return problems
