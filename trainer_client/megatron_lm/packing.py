"""The drop-in for the dev branch's `wrap_data_iterator` (`--sequence-packing-scheduler
default_dynamic_cp | dp_balanced`): dynamic CP and static packing into THD micro-batches, pipeline
stages included (docs/megatron-lm.md). Megatron-LM calls it once per step with the same iterator (with
virtual stages, the same list), so the state kept between steps lives on one `PackingDropIn` per wrapped iterator."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from batch_planner.padding import group_padded_lengths, row_multiple_of
from batch_planner.plan import Plan
from batch_planner.request import SchedulerKind
from trainer_client.plans import megatron as mcore
from trainer_client.refusals.compatibility import MEGATRON_SCHEDULER_NAMES, Changed, check
from trainer_client.dropin.device import data_device, model_device
from trainer_client.dropin.registry import Registry
from trainer_client.dropin.stages import StageData
from trainer_client.dropin.step_input import LocalBatch, raise_on_bad_packed_sample
from trainer_client.dropin.step_planner import PlannedStep, StepPlanner
from trainer_client.megatron_lm.checks import start_planner
from trainer_client.megatron_lm.refusals import SOURCE
from trainer_client.megatron_lm.version import require


@dataclass
class PackingDropIn:
    """One wrapped iterator: its read-ahead planner and the step it last handed out."""

    data_iterator: Any
    config: Any
    num_microbatches: int
    groups: mcore.DataGroups
    scheduler: SchedulerKind
    stage: StageData
    planner: StepPlanner = field(init=False)
    last_step: PlannedStep | None = None

    @classmethod
    def start(cls, data_iterator, config, num_microbatches: int, groups: mcore.DataGroups, planner) -> PackingDropIn:
        name = getattr(config, "sequence_packing_scheduler", None)
        check({SOURCE: {"sequence_packing_scheduler": name}})
        scheduler = MEGATRON_SCHEDULER_NAMES[name]
        wrapper = cls(data_iterator, config, num_microbatches, groups, scheduler, StageData.of(groups, config))
        # The gate: the upstream names it calls outside Megatron-Core's public API, after the model's refusals.
        wrapper.planner = start_planner(wrapper.read_local, config, scheduler, groups, planner, gate=lambda: require("wrap_data_iterator"))
        return wrapper

    def next_step(self, num_microbatches: int) -> tuple[Any, int, float, float]:
        """wrap_data_iterator's answer for the next step."""
        changed = Changed.of(self.num_microbatches, num_microbatches)
        step = self.last_step = self.planner.next_step({SOURCE: {"num_microbatches": changed}})
        device = model_device()
        dynamic = self.scheduler is SchedulerKind.DYNAMIC_CP
        padded = plan_padded_lengths(step.plan, step.layout.padded)
        lengths = {"original_seq_len": step.layout.original, "padded_seq_len": padded}
        samples = {
            i: {**{k: v.to(device) for k, v in topped_up(fields, padded[i] - step.layout.padded[i]).items()},
                **{k: torch.tensor([v[i]], device=device) for k, v in lengths.items()}}
            for i, fields in step.samples.items()
        }
        packed = mcore.build_packed_microbatches(samples, step.sample_id_groups, self.groups.dp_cp.rank(), device, dynamic)
        sums = [len(step.sample_id_groups), float(sum(padded)), float(sum(p * p for p in padded))]
        count, total, squares = mcore.broadcast_scalars(sums, self.groups.tp, data_device(self.groups.tp))
        iterator = mcore.create_packed_data_iterator(packed, self.groups.tp, self.config, dynamic, self.stage.vpp_needs_data)
        return iterator, int(count), total, squares

    def read_local(self) -> LocalBatch:
        source = _first_iterator(self.data_iterator)
        items = [next(source) for _ in range(self.num_microbatches)]
        batch = [sample for item in items for sample in (item if isinstance(item, list) else [item])]
        for index, sample in enumerate(batch):
            if "padded_seq_len" not in sample:
                raise_on_bad_packed_sample(sample, index)
        subsamples = mcore.unpack_packing_batch(batch) if batch else []  # empty: LocalBatch.problem says so
        padded = [int(s["padded_seq_len"].reshape(-1)[0]) for s in subsamples]
        original = [int(s["original_seq_len"].reshape(-1)[0]) for s in subsamples]
        keys = self.stage.keys
        return LocalBatch.of([{k: v for k, v in s.items() if k in keys} for s in subsamples], padded, original)

    def close(self) -> None:
        self.planner.close()


def plan_padded_lengths(plan: Plan, lengths: Sequence[int]) -> list[int]:
    """Each sample's length in its pass's buffer as the plan pads it, from the dataset's padded
    `lengths` (global ids): with a precision that needs each rank's rows a multiple of something
    (FP8), `group_padded_lengths` of each CP group's samples, whose last sequence is topped up
    (batch_planner/padding.py), as the seam's units pad them (trainer_client/plans/apply.py);
    otherwise `lengths` themselves, which Megatron-Core's packing takes as the dataset gives them."""
    multiple = row_multiple_of(plan)
    out = list(lengths)
    if multiple == 1:
        return out
    for micro_batch in plan.micro_batches:
        for group in micro_batch.cp_groups:
            ids = group.sample_ids
            padded = group_padded_lengths([lengths[i] for i in ids], group.size, plan.tensor_parallel_size, plan.cp_layout,
                                          plan.padding, plan.min_local_rows, multiple)
            for i, length in zip(ids, padded):
                out[i] = length
    return out


def topped_up(fields: dict[str, torch.Tensor], extra: int) -> dict[str, torch.Tensor]:
    """A sample's per-token fields with `extra` padding rows after its own: zeros (token 0, label
    0, loss mask 0), and positions that go on counting."""
    if extra <= 0:
        return fields
    out = {}
    for name, value in fields.items():
        if name == "position_ids" and value.dim() == 1:
            tail = value[-1] + 1 + torch.arange(extra, dtype=value.dtype, device=value.device)
        else:
            tail = value.new_zeros((extra, *value.shape[1:]))
        out[name] = torch.cat([value, tail])
    return out


# The wrappers in use, one per wrapped iterator, until close_wrapped, the end of a closing_wrapped()
# block, disable(), or the interpreter's exit.
_wrappers: Registry[PackingDropIn] = Registry()


def wrap_data_iterator(data_iterator, config, num_microbatches, pg_collection=None, *, planner=None):
    """Drop-in for the dev branch's `megatron.core.datasets.data_schedule.wrap_data_iterator`: its arguments
    and return value (docs/megatron-lm.md, "What stays the same"), plus the keyword `planner`."""
    groups = mcore.DataGroups.of(pg_collection)
    if _first_iterator(data_iterator) is None:  # TP ranks > 0: the TP broadcasts only, as upstream's
        values = mcore.broadcast_scalars([0, 0.0, 0.0], groups.tp, data_device(groups.tp))
        dynamic = MEGATRON_SCHEDULER_NAMES.get(getattr(config, "sequence_packing_scheduler", None)) is SchedulerKind.DYNAMIC_CP
        return mcore.create_packed_data_iterator(None, groups.tp, config, dynamic), int(values[0]), values[1], values[2]
    wrapper = _wrappers.get(data_iterator, lambda: PackingDropIn.start(data_iterator, config, num_microbatches, groups, planner))
    return wrapper.next_step(num_microbatches)


def last_planned_step(data_iterator) -> PlannedStep | None:
    """The step wrap_data_iterator last handed out for `data_iterator` (plan, traffic, source)."""
    wrapper = _wrappers.find(data_iterator)
    return wrapper.last_step if wrapper is not None else None


def close_wrapped(data_iterator) -> None:
    """Stops the planner client wrap_data_iterator made for `data_iterator`."""
    _wrappers.close(data_iterator)


def close_all_wrapped() -> None:
    """Stops the planner client of every iterator wrap_data_iterator wrapped."""
    _wrappers.close()


@contextmanager
def closing_wrapped() -> Iterator[None]:
    """A block at whose end the planner client of every iterator wrap_data_iterator wrapped stops
    (those left open stop at the interpreter's exit anyway)."""
    with _wrappers:
        yield


def _first_iterator(data_iterator):
    """The iterator a step is read from: with virtual stages, the first of the list that is not
    None (all of a stage's virtual stages read one dataset), as Megatron-Core's schedulers pick it."""
    if isinstance(data_iterator, (list, tuple)):
        return next((it for it in data_iterator if it is not None), None)
    return data_iterator
