"""Loss and gradient parity for models with attention on CP shards (tests/support/attention_model.py).

Whoever makes the shards (a drop-in under test, or `te_zigzag_shard` here) hands each rank's
forward passes to `packed_loss_and_grads`; `reference_loss_and_grads` runs the same model over
the whole samples, one at a time, without CP; `assert_parity` compares the two: the step's loss,
each real token's loss, and every parameter's gradient.

The loss is the per-token cross entropy times the loss mask, summed over every rank's passes and
divided by the loss mask's sum over all samples (Megatron-Core's `calculate_per_token_loss`
normalisation); gradients are summed over the ranks, as Megatron-Core's finalize_model_grads
all-reduces them over DP x CP. Each pass runs its backward at once (as Megatron-Core's schedules
do), and parameters held in a 16-bit type (a bf16 model on a GPU) accumulate their passes'
gradients in fp32 (`Fp32Grads`), as Megatron-Core's DDP does in its main_grad.
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


class Fp32Grads:
    """Each parameter's gradient summed in fp32 over backward passes (Megatron-Core's DDP keeps an
    fp32 main_grad): a bf16 parameter's gradient of each pass is added to an fp32 sum and cleared.
    fp32 parameters keep torch's own accumulation. `reset()` before a step, `read()` after it."""

    def __init__(self, models) -> None:
        self.params = {f"{i}.{name}" if len(models) > 1 else name: p
                       for i, m in enumerate(models) for name, p in m.named_parameters()}
        self.sums: dict[int, torch.Tensor] = {}
        for p in self.params.values():
            if p.dtype != torch.float32 and p.requires_grad:
                p.register_post_accumulate_grad_hook(self._add)

    def _add(self, p: torch.Tensor) -> None:
        found = self.sums.get(id(p))
        grad = p.grad.detach().float()
        self.sums[id(p)] = grad if found is None else found + grad
        p.grad = None

    def reset(self) -> None:
        self.sums.clear()
        for p in self.params.values():
            p.grad = None

    def read(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.params.items():
            if id(p) in self.sums:
                out[name] = self.sums[id(p)].clone()
            elif p.grad is not None:
                out[name] = p.grad.detach().float().clone()
            else:
                out[name] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return out


def fp32_grads(model) -> Fp32Grads:
    """The model's Fp32Grads, made once (its hooks stay on the parameters)."""
    found = getattr(model, "_fp32_grads", None)
    if found is None:
        found = Fp32Grads([model])
        object.__setattr__(model, "_fp32_grads", found)
    return found


def model_device(model) -> torch.device:
    return next(model.parameters()).device


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

    @classmethod
    def of(cls, inputs, token_ids: torch.Tensor | None = None) -> RankShard:
        """The shard of a drop-in's unit, from the seam's `model_inputs` (trainer_client/dropin/model_inputs.py)."""
        return cls(inputs.input_ids[0], inputs.labels[0], inputs.loss_mask[0], inputs.position_ids[0], inputs.packed_seq_params,
                   token_ids)

    def to(self, device) -> RankShard:
        """This shard with its tensors, and its PackedSeqParams' cu_seqlens, on `device`."""
        params = dataclasses.replace(self.packed_seq_params, **{
            name: getattr(self.packed_seq_params, name).to(device)
            for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
            if getattr(self.packed_seq_params, name, None) is not None
        })
        return RankShard(self.tokens.to(device), self.labels.to(device), self.loss_mask.to(device), self.position_ids.to(device),
                         params, self.token_ids)


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


def _fresh_pass(model, samples: list[Sample]):
    """Before a pass: the model's device, its fp32 gradients zeroed, MTP's loss tracker cleared, and
    the loss tokens of the whole batch (every pass normalises by them)."""
    grads_of = fp32_grads(model)
    grads_of.reset()
    _clear_mtp_tracker()
    return model_device(model), grads_of, float(sum(float(s.loss_mask.sum()) for s in samples))


def packed_loss_and_grads(model, shards: Sequence[RankShard], samples: Sequence[Sample], group=None, expert_group=None) -> LossAndGrads:
    """Runs this rank's `shards` forward and backward, each at once (on the model's device); every
    rank of `group` (default: the world, as DP x CP) calls it with its own shards (possibly none)
    and gets the same summed loss and gradients (fp32). Parameters Megatron-Core marks
    `allreduce=False` (MoE experts, which differ from rank to rank under expert parallelism) are
    summed over `expert_group` instead (Megatron-Core's expert-data-parallel group; None: not summed)."""
    device, grads_of, total = _fresh_pass(model, samples)
    loss = 0.0
    reported = []
    for shard in shards:
        shard = shard.to(device)
        per_token = _forward(model, shard.tokens, shard.position_ids, shard.labels, shard.loss_mask, shard.packed_seq_params)
        shard_loss = (per_token.float() * shard.loss_mask).sum() / total
        if shard_loss.requires_grad:
            shard_loss.backward()
        loss += float(shard_loss.detach())
        if shard.token_ids is not None:
            keep = shard.token_ids >= 0
            reported.append((shard.token_ids[keep], per_token.detach().float().cpu()[keep]))
    grads = grads_of.read()
    experts = [n for n, p in model.named_parameters() if getattr(p, "allreduce", True) is False]
    dense = [n for n in grads if n not in experts]
    flat = torch.cat([torch.tensor([loss], device=device)] + [grads[n].reshape(-1) for n in dense])
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
    return LossAndGrads(float(flat[0]), {n: g.cpu() for n, g in summed.items()}, token_losses, None if mtp is None else mtp.tolist())


def _unflatten(flat: torch.Tensor, names: Sequence[str], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for n in names:
        out[n] = flat[offset:offset + like[n].numel()].reshape(like[n].shape)
        offset += like[n].numel()
    return out


def reference_loss_and_grads(model, samples: Sequence[Sample], solo_group) -> LossAndGrads:
    """The same model over each whole sample alone, CP1 (`solo_group`: a process group of this rank
    alone, which Megatron-Core's dynamic-CP attention and RoPE ask for), no communication, each
    sample's backward at once (on the model's device, gradients in fp32)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    device, grads_of, total = _fresh_pass(model, samples)
    loss = 0.0
    token_losses = []
    for s in samples:
        cu = torch.tensor([0, len(s)], dtype=torch.int32, device=device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=len(s), max_seqlen_kv=len(s), local_cp_size=1,
                                 cp_group=solo_group)
        mask = s.loss_mask.to(device)
        per_token = _forward(model, s.tokens.to(device), torch.arange(len(s), device=device), s.labels.to(device), mask, params)
        sample_loss = (per_token.float() * mask).sum() / total
        sample_loss.backward()
        loss += float(sample_loss.detach())
        token_losses.append(per_token.detach().float().cpu())
    mtp = _mtp_losses()
    return LossAndGrads(loss, {n: g.cpu() for n, g in grads_of.read().items()}, torch.cat(token_losses), None if mtp is None else mtp.tolist())


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


def relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (0 when both are 0)."""
    scale = float(want.double().norm())
    difference = float((got.double() - want.double()).norm())
    return difference / scale if scale else difference


def worst_differences(got: LossAndGrads, want: LossAndGrads, samples: Sequence[Sample]) -> dict:
    """How far `got` is from `want`, each as a fraction of the reference's scale: the loss (of its
    own value), the real tokens' losses (the largest difference, of the largest loss), the worst
    parameter's gradient (the norm of its difference, of its own norm; and, for the record, its
    largest entry's difference, of its largest entry); the real tokens no rank reported; the worst
    gradient's name."""
    out: dict = {"loss": abs(got.loss - want.loss) / max(abs(want.loss), 1e-30), "missing_tokens": 0,
                 "token_losses": 0.0, "gradients": 0.0, "gradients_largest_entry": 0.0, "worst_gradient": None}
    if got.token_losses is not None:
        missing = torch.isnan(got.token_losses)
        out["missing_tokens"] = int(missing.sum())
        scale = float(want.token_losses.abs().max())
        out["token_losses"] = float((got.token_losses - want.token_losses)[~missing].abs().max()) / scale if scale else 0.0
    for name, g in want.grads.items():
        relative = relative_l2(got.grads[name], g)
        if relative > out["gradients"]:
            out["gradients"], out["worst_gradient"] = relative, name
        scale = float(g.abs().max())
        if scale:
            out["gradients_largest_entry"] = max(out["gradients_largest_entry"], float((got.grads[name] - g).abs().max()) / scale)
    return out


def beyond(worst: dict, tolerance: float) -> list[str]:
    """What of `worst_differences` exceeds `tolerance` (empty: parity), in words."""
    errors = [f"{out} tokens have no loss from any rank" for out in [worst["missing_tokens"]] if out]
    errors += [f"{key} differ by {worst[key]:.3g} of their scale (tolerance {tolerance:.3g})"
               for key in ("loss", "token_losses", "gradients") if worst[key] > tolerance]
    if worst["gradients"] > tolerance:
        errors[-1] += f"; worst: {worst['worst_gradient']}"
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
