"""Loss and gradient parity for models with attention on CP shards (tests/attention_model.py).

Whoever makes the shards (a drop-in under test, or `te_zigzag_shard` here) hands each rank's
forward passes to `packed_loss_and_grads`; `reference_loss_and_grads` runs the same model over
the whole samples, one at a time, without CP; `assert_parity` compares the two: the step's loss,
each real token's loss, and every parameter's gradient.

The loss is the per-token cross entropy times the loss mask, summed over every rank's passes and
divided by the loss mask's sum over all samples (Megatron-Core's `calculate_per_token_loss`
normalisation); gradients are summed over the ranks, as Megatron-Core's finalize_model_grads
all-reduces them over DP x CP.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Sample:
    """One whole sequence: 1-D fields of equal length."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclasses.dataclass
class RankShard:
    """One forward pass on this rank: its THD shard (1-D fields, padding rows included) and the
    PackedSeqParams the model gets."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object
    token_ids: torch.Tensor | None = None
    """Each row's global token id (`token_id(samples, sample, position)`), -1 on padding rows;
    None: per-token losses are not compared."""


@dataclasses.dataclass
class LossAndGrads:
    loss: float
    grads: dict[str, torch.Tensor]
    token_losses: torch.Tensor | None  # [all tokens of all samples], NaN where no rank reported one
    mtp_losses: list[float] | None = None
    """Per MTP layer: its masked loss summed over every token and the tokens it counts (what
    Megatron-Core's MTPLossLoggingHelper accumulates with calculate_per_token_loss); None: no MTP."""


EXAMPLE_LENGTHS = (17, 5, 30, 9, 40, 3, 12, 26)
"""Sequence lengths the attention tests share: short and long, most of them needing padding to
2 x CP for CP2 and CP4."""


def example_samples(lengths: Sequence[int] = EXAMPLE_LENGTHS) -> list[Sample]:
    """Deterministic samples of `lengths`: random tokens, labels the next token, a loss mask with
    about a fifth of the tokens off and the last one off."""
    out = []
    for i, n in enumerate(lengths):
        g = torch.Generator().manual_seed(100 + i)
        tokens = torch.randint(0, 64, (n,), generator=g)
        mask = (torch.rand(n, generator=g) < 0.8).float()
        mask[-1] = 0.0
        out.append(Sample(tokens, torch.roll(tokens, -1), mask))
    return out


def token_offsets(samples: Sequence[Sample]) -> list[int]:
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s))
    return offsets


def _forward(model, tokens, position_ids, labels, loss_mask, packed_seq_params) -> torch.Tensor:
    losses = model(input_ids=tokens[None], position_ids=position_ids[None], attention_mask=None, labels=labels[None],
                   loss_mask=loss_mask[None], packed_seq_params=packed_seq_params)
    return losses.reshape(-1)


def _clear_mtp_tracker() -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def _mtp_losses() -> torch.Tensor | None:
    """[loss sums..., token counts...] of the MTP layers since the tracker was cleared; None: no MTP ran."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if "loss_sums" not in tracker:
        return None
    return torch.cat([tracker["loss_sums"], tracker["num_tokens"]]).detach().clone()


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for name, p in model.named_parameters()}


def packed_loss_and_grads(model, shards: Sequence[RankShard], samples: Sequence[Sample], group=None, expert_group=None) -> LossAndGrads:
    """Runs this rank's `shards` forward and backward; every rank of `group` (default: the world,
    as DP x CP) calls it with its own shards (possibly none) and gets the same summed loss and
    gradients. Parameters Megatron-Core marks `allreduce=False` (MoE experts, which differ from
    rank to rank under expert parallelism) are summed over `expert_group` instead (Megatron-Core's
    expert-data-parallel group; None: not summed)."""
    model.zero_grad(set_to_none=True)
    _clear_mtp_tracker()
    total = float(sum(float(s.loss_mask.sum()) for s in samples))
    loss = torch.zeros(())
    reported = []
    for shard in shards:
        per_token = _forward(model, shard.tokens, shard.position_ids, shard.labels, shard.loss_mask, shard.packed_seq_params)
        loss = loss + (per_token * shard.loss_mask).sum() / total
        if shard.token_ids is not None:
            keep = shard.token_ids >= 0
            reported.append((shard.token_ids[keep], per_token.detach()[keep]))
    if loss.requires_grad:
        loss.backward()
    grads = _grads(model)
    experts = [n for n, p in model.named_parameters() if getattr(p, "allreduce", True) is False]
    dense = [n for n in grads if n not in experts]
    flat = torch.cat([loss.detach().reshape(1)] + [grads[n].reshape(-1) for n in dense])
    dist.all_reduce(flat, group=group)
    summed = _unflatten(flat[1:], dense, grads)
    if experts:
        flat_experts = torch.cat([grads[n].reshape(-1) for n in experts])
        if expert_group is not None:
            dist.all_reduce(flat_experts, group=expert_group)
        summed.update(_unflatten(flat_experts, experts, grads))
    mtp = _mtp_losses()
    if mtp is not None:
        dist.all_reduce(mtp, group=group)
    token_losses = None
    if all(s.token_ids is not None for s in shards):
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, reported, group=group)
        token_losses = torch.full((token_offsets(samples)[-1],), float("nan"))
        for ids, values in (pair for rank_pairs in everyone for pair in rank_pairs):
            if not torch.isnan(token_losses[ids]).all():
                raise AssertionError(f"token ids {sorted(set(ids.tolist()))[:8]}... reported by more than one rank")
            token_losses[ids] = values
    return LossAndGrads(float(flat[0]), summed, token_losses, None if mtp is None else mtp.tolist())


def _unflatten(flat: torch.Tensor, names: Sequence[str], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for n in names:
        out[n] = flat[offset:offset + like[n].numel()].reshape(like[n].shape)
        offset += like[n].numel()
    return out


def reference_loss_and_grads(model, samples: Sequence[Sample], solo_group) -> LossAndGrads:
    """The same model over each whole sample alone, CP1 (`solo_group`: a process group of this rank
    alone, which Megatron-Core's dynamic-CP attention and RoPE ask for), no communication."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model.zero_grad(set_to_none=True)
    _clear_mtp_tracker()
    total = float(sum(float(s.loss_mask.sum()) for s in samples))
    loss = torch.zeros(())
    token_losses = []
    for s in samples:
        cu = torch.tensor([0, len(s)], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=len(s), max_seqlen_kv=len(s), local_cp_size=1,
                                 cp_group=solo_group)
        per_token = _forward(model, s.tokens, torch.arange(len(s)), s.labels, s.loss_mask, params)
        loss = loss + (per_token * s.loss_mask).sum() / total
        token_losses.append(per_token.detach())
    loss.backward()
    mtp = _mtp_losses()
    return LossAndGrads(float(loss.detach()), _grads(model), torch.cat(token_losses), None if mtp is None else mtp.tolist())


def parity_errors(got: LossAndGrads, want: LossAndGrads, samples: Sequence[Sample], rtol: float = 1e-4, atol: float = 1e-6) -> list[str]:
    """What differs beyond float tolerance (empty: parity): the loss, any real token's loss, any
    parameter's gradient (compared relative to that gradient's largest entry)."""
    errors = []
    if abs(got.loss - want.loss) > atol + rtol * abs(want.loss):
        errors.append(f"loss {got.loss!r} != reference {want.loss!r}")
    if (got.mtp_losses is None) != (want.mtp_losses is None) or any(
        abs(g - w) > atol + rtol * abs(w) for g, w in zip(got.mtp_losses or [], want.mtp_losses or [])
    ):
        errors.append(f"MTP loss sums and token counts {got.mtp_losses} != reference {want.mtp_losses}")
    if got.token_losses is not None:
        real = torch.cat([torch.ones(len(s), dtype=torch.bool) for s in samples])
        missing = torch.isnan(got.token_losses) & real
        if missing.any():
            errors.append(f"{int(missing.sum())} tokens have no loss from any rank (first: {missing.nonzero()[0].item()})")
        diff = (got.token_losses - want.token_losses).abs()
        bad = (diff > atol + rtol * want.token_losses.abs()) & ~missing
        if bad.any():
            errors.append(f"{int(bad.sum())} token losses differ (largest difference {float(diff[bad].max()):.3g})")
    for name, g in want.grads.items():
        scale = float(g.abs().max())
        diff = float((got.grads[name] - g).abs().max())
        if diff > atol + rtol * scale:
            errors.append(f"gradient of {name} differs by {diff:.3g} (largest entry {scale:.3g})")
    return errors


def token_id(offsets: Sequence[int], sample: int, position: int) -> int:
    return offsets[sample] + position


def padded_to(length: int, cp_size: int) -> int:
    """The shortest length >= `length` that Transformer Engine's THD CP layout takes: a multiple of
    2 x CP size (CP1: unchanged)."""
    multiple = 2 * cp_size if cp_size > 1 else 1
    return -(-length // multiple) * multiple


def thd_batch(samples: Sequence[Sample], sample_ids: Sequence[int], cp_size: int) -> dict[str, torch.Tensor]:
    """The unsharded THD micro-batch of `sample_ids`, each padded to `padded_to` (padding rows:
    token 0, loss mask 0, token id -1), with whole-sequence cu_seqlens, real and padded."""
    offsets = token_offsets(samples)
    fields: dict[str, list[torch.Tensor]] = {"tokens": [], "labels": [], "loss_mask": [], "position_ids": [], "token_ids": []}
    real, padded = [0], [0]
    for i in sample_ids:
        s, n = samples[i], len(samples[i])
        p = padded_to(n, cp_size)
        pad = p - n
        fields["tokens"].append(torch.cat([s.tokens, s.tokens.new_zeros(pad)]))
        fields["labels"].append(torch.cat([s.labels, s.labels.new_zeros(pad)]))
        fields["loss_mask"].append(torch.cat([s.loss_mask, s.loss_mask.new_zeros(pad)]))
        fields["position_ids"].append(torch.arange(p))
        fields["token_ids"].append(torch.cat([torch.arange(n) + offsets[i], torch.full((pad,), -1)]))
        real.append(real[-1] + n)
        padded.append(padded[-1] + p)
    batch = {k: torch.cat(v) for k, v in fields.items()}
    batch["cu_seqlens"] = torch.tensor(real, dtype=torch.int32)
    batch["cu_seqlens_padded"] = torch.tensor(padded, dtype=torch.int32)
    return batch


def te_zigzag_rows(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rows of an unsharded THD batch that group rank `cp_rank` holds in Transformer Engine's
    DualChunkSwap layout (`get_batch_on_this_cp_rank`'s documented contract): chunks r and 2c-1-r
    of each sequence's 2c chunks."""
    bounds = cu_seqlens_padded.tolist()
    rows = []
    for start, stop in zip(bounds, bounds[1:]):
        chunk = (stop - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            rows.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(rows)


def contiguous_rows(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rows group rank `cp_rank` holds in Megatron-Core's contiguous layout
    (`get_cp_slice_for_thd(cp_partition_mode="contiguous")`): interval r of c equal intervals of
    the whole padded buffer."""
    total = int(cu_seqlens_padded[-1])
    return torch.arange(cp_rank * total // cp_size, (cp_rank + 1) * total // cp_size)


def shard(samples: Sequence[Sample], sample_ids: Sequence[int], cp_group, layout: str = "zigzag") -> RankShard:
    """This rank's RankShard of a micro-batch of `sample_ids` on `cp_group` (None: CP1 on a group
    of this rank alone is the caller's to pass as `cp_group`), in `layout`."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    batch = thd_batch(samples, sample_ids, cp_size)
    if cp_size == 1:
        rows = torch.arange(batch["tokens"].numel())
    elif layout == "zigzag":
        rows = te_zigzag_rows(batch["cu_seqlens_padded"], cp_size, cp_rank)
    else:
        rows = contiguous_rows(batch["cu_seqlens_padded"], cp_size, cp_rank)
    longest = int((batch["cu_seqlens_padded"][1:] - batch["cu_seqlens_padded"][:-1]).max())
    extra = {"cp_partition_mode": layout} if any(f.name == "cp_partition_mode" for f in dataclasses.fields(PackedSeqParams)) else {}
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=batch["cu_seqlens"], cu_seqlens_kv=batch["cu_seqlens"],
        cu_seqlens_q_padded=batch["cu_seqlens_padded"], cu_seqlens_kv_padded=batch["cu_seqlens_padded"],
        max_seqlen_q=longest, max_seqlen_kv=longest, local_cp_size=cp_size, cp_group=cp_group, **extra,
    )
    return RankShard(batch["tokens"][rows], batch["labels"][rows], batch["loss_mask"][rows], batch["position_ids"][rows],
                     params, batch["token_ids"][rows])
