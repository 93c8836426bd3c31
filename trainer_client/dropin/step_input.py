"""One step's input: read, checked, and its global layout agreed by all ranks of the DPxCP group; bad
input raises DropInInputError on every rank at the same step (docs/megatron-lm.md, "Bad input")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer_client.plans import megatron as mcore
from trainer_client.errors import DropInInputError, PlanMismatchError
from trainer_client.plans.together import fail_together
# Keys of a packed sample that describe it rather than hold one value per token.
HYBRID_METADATA_KEYS = ("cu_seqlens", "batch_idx", "max_seqlen")
LENGTH_KEYS = ("original_seq_len", "padded_seq_len")


@dataclass
class LocalBatch:
    """This DP rank's sub-samples of one step, as Megatron-Core unpacks them."""

    subsamples: list[dict[str, torch.Tensor]]
    rows: list[int]  # tokens held per sub-sample (dim 0 of its per-token fields)
    padded: list[int]  # the length the scheduler plans with
    original: list[int]  # the real length (packing: original_seq_len)

    @classmethod
    def of(cls, subsamples: list[dict[str, torch.Tensor]], padded=None, original=None) -> LocalBatch:
        rows = [_rows(s) for s in subsamples]
        return cls(subsamples, rows, list(padded or rows), list(original or padded or rows))

    def field_spec(self) -> tuple:
        """Per-token fields: name, dtype, trailing shape (of the first sub-sample)."""
        first = self.subsamples[0]
        return tuple(
            (name, first[name].dtype, tuple(first[name].shape[1:])) for name in sorted(first) if name not in LENGTH_KEYS
        )

    def problem(self) -> str | None:
        """Why this batch cannot be planned (empty, a sub-sample of length < 1, or sub-samples that disagree), or None."""
        if not self.subsamples:
            return "the local batch is empty (no sub-sample of non-zero length)"
        short = next(((i, length) for i, length in enumerate(self.padded) if length < 1), None)
        if short is not None:
            return (f"sub-sample {short[0]} has length {short[1]}; every sample needs at least one token "
                    "(drop empty samples from the data)")
        spec = self.field_spec()
        for i, (sample, rows) in enumerate(zip(self.subsamples, self.rows)):
            names = sorted(k for k in sample if k not in LENGTH_KEYS)
            if names != [name for name, _, _ in spec]:
                return f"sub-sample {i} has fields {names}, sub-sample 0 has {[n for n, _, _ in spec]}"
            bad = [k for k in names if sample[k].shape[0] != rows]
            if bad:
                return f"sub-sample {i}: field {bad[0]!r} has {sample[bad[0]].shape[0]} tokens, the others {rows}"
        return None


def _rows(subsample: dict[str, torch.Tensor]) -> int:
    per_token = [v for k, v in subsample.items() if k not in LENGTH_KEYS]
    return int(per_token[0].shape[0]) if per_token else 0


@dataclass(frozen=True)
class GlobalLayout:
    """The step's global batch as every rank sees it after one all-gather: ids in DP rank order."""

    rows: tuple[int, ...]
    padded: tuple[int, ...]
    original: tuple[int, ...]
    offsets: tuple[int, ...]  # DP rank d holds global ids offsets[d] .. offsets[d+1]-1
    fields: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # per-token fields: name, dtype, trailing shape


@dataclass
class ReadStep:
    """A step read ahead: its batch and layout, or why it cannot run, or the end of the data."""

    step: int
    local: LocalBatch | None = None
    layout: GlobalLayout | None = None
    error: str | None = None
    exhausted: bool = False


def check_packed_sample(sample: dict[str, torch.Tensor], where: str) -> str | None:
    """Why a packed sample's cu_seqlens do not describe its tokens, or None."""
    if "cu_seqlens" not in sample:
        return f"{where} has no 'cu_seqlens' (keys: {sorted(sample)})"
    cu = sample["cu_seqlens"].reshape(-1)
    if cu.numel() < 2 or cu.dtype.is_floating_point:
        return f"{where}: cu_seqlens must be an integer tensor of >= 2 entries, got {cu.dtype} {tuple(cu.shape)}"
    values = cu.tolist()
    if values[0] != 0:
        return f"{where}: cu_seqlens must start at 0, got {values[:4]}..."
    drops = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if drops:
        i = drops[0]
        return f"{where}: cu_seqlens decreases at index {i} ({values[i - 1]} -> {values[i]}); it must be non-decreasing"
    for key, value in sample.items():
        if key in HYBRID_METADATA_KEYS or not torch.is_tensor(value):
            continue
        tokens = value.reshape(-1).numel() if value.dim() == 2 and value.shape[0] == 1 else value.shape[0]
        if tokens != values[-1]:
            return f"{where}: cu_seqlens ends at {values[-1]} but field {key!r} holds {tokens} tokens"
    return None


def raise_on_bad_packed_sample(sample: dict[str, torch.Tensor], index: int) -> None:
    """DropInInputError when packed sample `index` of this rank's batch fails check_packed_sample."""
    problem = check_packed_sample(sample, f"packed sample {index} of this rank's batch")
    if problem:
        raise DropInInputError(problem)


def agree_on_step(step: int, local: LocalBatch | None, error: str | None, groups: mcore.DataGroups) -> ReadStep:
    """One all-gather over the DPxCP group: every rank learns every rank's lengths, or every rank
    gets the first failed rank's error, so all of them stop at the same step with the same message."""
    if error is None and local is not None:
        error = local.problem()
    failure = DropInInputError(f"step {step}: DPxCP rank {groups.dp_cp.rank()} (DP rank {groups.dp.rank()}): {error}") if error else None
    mine = None if failure is not None else {
        "dp_rank": groups.dp.rank(),
        "exhausted": local is None,
        "lengths": None if local is None else (local.rows, local.padded, local.original),
        "fields": None if local is None else local.field_spec(),
    }
    try:
        everyone = fail_together(failure, groups.dp_cp, mine, context="{message}")
    except DropInInputError as agreed:
        return ReadStep(step, error=str(agreed))
    problem = _group_problem(everyone)
    if problem:
        return ReadStep(step, error=f"step {step}: {problem}")
    if all(entry["exhausted"] for entry in everyone):
        return ReadStep(step, exhausted=True)
    return ReadStep(step, local, _layout(everyone, groups.dp.size()))


def agree_on_read(failure: BaseException | None, group: Any, who: str = "TP rank") -> None:
    """One all-gather over `group` (`who` names one of its ranks) before a step is planned: every rank
    plans the step, or none does. `failure`: what this rank's read raised (StopIteration at the end of
    its data). On every rank: a failed rank's error; StopIteration if all ended; PlanMismatchError if some did."""
    ended = isinstance(failure, StopIteration)
    everyone = fail_together(None if ended else failure, group, ended, context=who + " {rank} could not read this step: {message}")
    if all(everyone):
        raise StopIteration
    if any(everyone):
        first = everyone.index(True)
        raise PlanMismatchError(f"{who} {first} could not read this step (its data ended, the others read on); no {who} plans it")


def _group_problem(everyone: list[dict]) -> str | None:
    ended = [rank for rank, entry in enumerate(everyone) if entry["exhausted"]]
    if ended and len(ended) < len(everyone):
        return f"the data iterator ended on DPxCP ranks {ended} but not on the others"
    if ended:
        return None
    by_dp: dict[int, dict] = {}
    for rank, entry in enumerate(everyone):
        first = by_dp.setdefault(entry["dp_rank"], entry)
        if first["lengths"] != entry["lengths"]:
            return (
                f"DPxCP rank {rank} loaded different samples than its CP sibling of DP rank {entry['dp_rank']}; "
                "CP ranks of one DP rank must load the same data (shard the dataset by DP rank, not DPxCP rank)"
            )
    specs = {repr(entry["fields"]) for entry in everyone}
    if len(specs) > 1:
        return f"ranks hold different per-token fields: {sorted(specs)}"
    return None


def _layout(everyone: list[dict], dp_size: int) -> GlobalLayout:
    by_dp = {entry["dp_rank"]: entry for entry in everyone}
    rows, padded, original, offsets = [], [], [], [0]
    for dp_rank in range(dp_size):
        r, p, o = by_dp[dp_rank]["lengths"]
        rows += r
        padded += p
        original += o
        offsets.append(len(rows))
    return GlobalLayout(tuple(rows), tuple(padded), tuple(original), tuple(offsets), everyone[0]["fields"])
