"""A drop-in for Megatron-LM's own training loop: the planner behind Megatron-Core's data-iterator
contract.

Two drop-ins, one for each contract Megatron-LM's `training.py` uses:

- `HybridCPDataLoaderWrapper(data_iterator, config, pg_collection=None)` (0.19.x,
  `--hybrid-context-parallel`): same constructor arguments as Megatron-Core's class, and each
  `next()` yields the same `(samples_this_rank_with_id, sample_id_groups)` that
  `hybrid_context_parallel_forward_backward` consumes.
- `wrap_data_iterator(data_iterator, config, num_microbatches, pg_collection=None)` (dev branch,
  `--sequence-packing-scheduler default_dynamic_cp | dp_balanced`): same arguments and the same
  return value, `(packed THD micro-batch iterator, number of micro-batches, sum of sequence lengths,
  sum of squared sequence lengths)`.

What changes against Megatron-Core's wrappers: the schedule comes from the batch planner
(`BatchPlannerClient`: planned one step ahead, one rank asks, every rank checks it holds the same
plan for the same batch, in-process fallback with the same Megatron-Core scheduler when the
service fails) instead of every rank running the scheduler on the step's critical path. The data
path is Megatron-Core's: the same unpacking of packed samples (its own helpers), the same global
sample ids (DP rank order), the same packing into THD micro-batches (its own helpers). Samples
move with one all-to-all per field inside the DP group, so each rank receives exactly the samples
it runs and no rank ever holds the global batch.

Plan-ahead reads one global batch ahead: while step k is handed out, the local part of step k+1
is already read from the wrapped iterator and its lengths are all-gathered, so the plan for k+1 is
made while step k trains. Memory: at most two local batches (this rank's share of steps k and
k+1) per rank, never a global one.

Bad input (inconsistent `cu_seqlens`, an empty local batch, CP siblings that loaded different
data, fields that differ between ranks) is found while reading and raised as `DropInInputError`
on every rank of the DPxCP group at the step that holds it; a sample longer than the DPxCP group
can hold is refused by the planner (`PlanRejectedError`, every rank, same step).

Planner settings: `planner=` (a `PlannerClientConfig` or dict), else the YAML file named by
`$BATCH_PLANNER_CONFIG` (section `batch_planner`), else in-process planning only. The sizes and the
scheduler come from Megatron's own config (see docs/megatron-lm.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from batch_planner.plan import Plan
from batch_planner.request import SchedulerKind
from trainer_client import megatron as mcore
from trainer_client.client import BatchPlannerClient
from trainer_client.compatibility import check_dynamic_cp_support
from trainer_client.config import ConfigError, PlannerClientConfig

log = logging.getLogger(__name__)

CONFIG_ENV = "BATCH_PLANNER_CONFIG"
# Keys of a packed sample that describe it rather than hold one value per token.
_HYBRID_METADATA_KEYS = ("cu_seqlens", "batch_idx", "max_seqlen")
_LENGTH_KEYS = ("original_seq_len", "padded_seq_len")
_PACKING_SCHEDULERS = {"default_dynamic_cp": SchedulerKind.DYNAMIC_CP, "dp_balanced": SchedulerKind.STATIC_PACKING}


class DropInInputError(ValueError):
    """A step's input cannot be planned or routed; raised on every rank of the DPxCP group."""


# ---------------------------------------------------------------------------------------------
# Planner settings: the planner's own (endpoint, TLS, deadlines) + sizes from Megatron's config


def planner_config_for(
    megatron_config: Any, scheduler: SchedulerKind, cp_size: int, planner: PlannerClientConfig | dict | None = None
) -> PlannerClientConfig:
    """The client config: the planner's settings, with the sizes and scheduler Megatron runs.

    A size also set in the planner settings must equal Megatron's (ConfigError names both)."""
    given = _given_planner_settings(planner)
    derived = {
        "max_seqlen_per_dp_cp_rank": int(megatron_config.max_seqlen_per_dp_cp_rank),
        "context_parallel_size": cp_size,
        "tensor_parallel_size": int(getattr(megatron_config, "tensor_model_parallel_size", 1) or 1),
        "scheduler": scheduler.value,
    }
    if scheduler is SchedulerKind.DYNAMIC_CP:
        derived["min_cp_size"] = getattr(megatron_config, "min_dynamic_context_parallel_size", None)
    if scheduler is SchedulerKind.STATIC_PACKING:
        derived["max_seqs_per_micro_batch"] = mcore.max_real_seqs_per_micro_batch(megatron_config)
    for key, value in derived.items():
        if key in given and given[key] != value:
            raise ConfigError(
                f"{key}: the planner settings say {given[key]!r} but Megatron runs {value!r}; drop {key} "
                "from the planner settings (the drop-in takes it from Megatron's arguments)"
            )
    return PlannerClientConfig.from_dict({**given, **derived})


def _given_planner_settings(planner: PlannerClientConfig | dict | None) -> dict[str, Any]:
    if isinstance(planner, PlannerClientConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(PlannerClientConfig)}
        values = planner.to_dict()
        return {k: v for k, v in values.items() if k != "max_seqlen_per_dp_cp_rank" and v != _plain(defaults[k])}
    if isinstance(planner, dict):
        return dict(planner)
    path = os.environ.get(CONFIG_ENV)
    if not path:
        log.warning("no planner settings (planner= or $%s): planning in-process", CONFIG_ENV)
        return {}
    import yaml

    with open(path) as handle:
        data = yaml.safe_load(handle) or {}
    if "batch_planner" not in data:
        raise ConfigError(f"${CONFIG_ENV}={path}: no top-level section 'batch_planner'")
    return dict(data["batch_planner"] or {})


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


# ---------------------------------------------------------------------------------------------
# One step's input: read, checked, and its global layout agreed by all ranks


@dataclass
class LocalBatch:
    """This DP rank's sub-samples of one step, as Megatron-Core unpacks them."""

    subsamples: list[dict[str, torch.Tensor]]
    rows: list[int]  # tokens held per sub-sample (dim 0 of its per-token fields)
    padded: list[int]  # the length the scheduler plans with
    original: list[int]  # the real length (packing: original_seq_len)


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
        if key in _HYBRID_METADATA_KEYS or not torch.is_tensor(value):
            continue
        tokens = value.reshape(-1).numel() if value.dim() == 2 and value.shape[0] == 1 else value.shape[0]
        if tokens != values[-1]:
            return f"{where}: cu_seqlens ends at {values[-1]} but field {key!r} holds {tokens} tokens"
    return None


def _local_batch(subsamples: list[dict[str, torch.Tensor]], padded=None, original=None) -> LocalBatch:
    rows = [_rows(s) for s in subsamples]
    return LocalBatch(subsamples, rows, list(padded or rows), list(original or padded or rows))


def _rows(subsample: dict[str, torch.Tensor]) -> int:
    per_token = [v for k, v in subsample.items() if k not in _LENGTH_KEYS]
    return int(per_token[0].shape[0]) if per_token else 0


def _field_spec(local: LocalBatch) -> tuple:
    first = local.subsamples[0]
    return tuple(
        (name, first[name].dtype, tuple(first[name].shape[1:])) for name in sorted(first) if name not in _LENGTH_KEYS
    )


def _local_problem(local: LocalBatch) -> str | None:
    if not local.subsamples:
        return "the local batch is empty (no sub-sample of non-zero length)"
    spec = _field_spec(local)
    for i, (sample, rows) in enumerate(zip(local.subsamples, local.rows)):
        names = sorted(k for k in sample if k not in _LENGTH_KEYS)
        if names != [name for name, _, _ in spec]:
            return f"sub-sample {i} has fields {names}, sub-sample 0 has {[n for n, _, _ in spec]}"
        bad = [k for k in names if sample[k].shape[0] != rows]
        if bad:
            return f"sub-sample {i}: field {bad[0]!r} has {sample[bad[0]].shape[0]} tokens, the others {rows}"
    return None


def agree_on_step(step: int, local: LocalBatch | None, error: str | None, groups: mcore.DataGroups) -> ReadStep:
    """One all-gather over the DPxCP group: every rank learns every rank's lengths, or every rank's
    error, so all of them stop at the same step with the same message."""
    if error is None and local is not None:
        error = _local_problem(local)
    mine = {
        "dp_rank": groups.dp.rank(),
        "exhausted": local is None and error is None,
        "error": error,
        "lengths": None if (local is None or error) else (local.rows, local.padded, local.original),
        "fields": None if (local is None or error) else _field_spec(local),
    }
    everyone: list[Any] = [None] * groups.dp_cp.size()
    dist.all_gather_object(everyone, mine, group=groups.dp_cp)
    problem = _group_problem(everyone)
    if problem:
        return ReadStep(step, error=f"step {step}: {problem}")
    if all(entry["exhausted"] for entry in everyone):
        return ReadStep(step, exhausted=True)
    return ReadStep(step, local, _layout(everyone, groups.dp.size()))


def _group_problem(everyone: list[dict]) -> str | None:
    for rank, entry in enumerate(everyone):
        if entry["error"]:
            return f"DPxCP rank {rank} (DP rank {entry['dp_rank']}): {entry['error']}"
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


# ---------------------------------------------------------------------------------------------
# The plan as Megatron-Core's schedulers return it, and moving the samples to where they run


def sample_id_groups(plan: Plan) -> list[list[list[int]]]:
    """`sample_id_groups[micro_batch][dp_cp_rank] -> [global sample ids]`, Megatron-Core's shape."""
    return [
        [list(mb.group_of_rank(rank).sample_ids) for rank in range(plan.dp_cp_size)] for mb in plan.micro_batches
    ]


@dataclass
class Traffic:
    """Bytes this rank received for one step against the size of the whole global batch."""

    received_bytes: int = 0
    global_batch_bytes: int = 0
    collectives: int = 0


def route_samples(
    local: LocalBatch, layout: GlobalLayout, groups: Any, id_groups: list[list[list[int]]], traffic: Traffic
) -> dict[int, dict[str, torch.Tensor]]:
    """Every sample this DPxCP rank runs, by global id (sorted), moved from the DP rank that loaded
    it with one all-to-all per field inside the DP group (CP siblings of a DP rank hold the same
    samples, so each rank receives from the lane of its own CP rank, as Megatron-Core does)."""
    dcp_ranks = dist.get_process_group_ranks(groups.dp_cp)
    lane = [dcp_ranks.index(r) for r in dist.get_process_group_ranks(groups.dp)]  # DPxCP rank of each DP member
    runs = [sorted({i for mb in id_groups for i in mb[position]}) for position in range(len(dcp_ranks))]
    me, my_dp = groups.dp_cp.rank(), groups.dp.rank()
    mine = range(layout.offsets[my_dp], layout.offsets[my_dp + 1])
    send = [[i for i in runs[lane[d]] if i in mine] for d in range(len(lane))]
    receive = [[i for i in runs[me] if layout.offsets[d] <= i < layout.offsets[d + 1]] for d in range(len(lane))]
    device = _transport_device(groups.dp, local)
    received: dict[int, dict[str, torch.Tensor]] = {i: {} for d in receive for i in d}
    for name, dtype, trailing in layout.fields:
        width = _numel(trailing)
        rows_in = [sum(layout.rows[i] for i in ids) * width for ids in receive]
        outgoing = [local.subsamples[i - mine.start][name].reshape(-1) for ids in send for i in ids]
        payload = torch.cat(outgoing).to(device) if outgoing else torch.empty(0, dtype=dtype, device=device)
        incoming = _exchange(payload, [sum(layout.rows[i] for i in ids) * width for ids in send], rows_in, groups.dp)
        traffic.received_bytes += incoming.numel() * incoming.element_size()
        traffic.global_batch_bytes += sum(layout.rows) * width * incoming.element_size()
        traffic.collectives += 1
        cursor = 0
        for i in (i for ids in receive for i in ids):
            count = layout.rows[i] * width
            received[i][name] = incoming[cursor : cursor + count].view(layout.rows[i], *trailing)
            cursor += count
    return dict(sorted(received.items()))


def _exchange(payload: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], dp_group: Any) -> torch.Tensor:
    if len(send_sizes) == 1:
        return payload
    incoming = payload.new_empty(sum(receive_sizes))
    dist.all_to_all_single(incoming, payload, receive_sizes, send_sizes, group=dp_group)
    return incoming


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _transport_device(group: Any, local: LocalBatch) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    first = next(iter(local.subsamples[0].values()))
    return first.device


# ---------------------------------------------------------------------------------------------
# Reading one step ahead and planning it while the current step trains


@dataclass
class PlannedStep:
    """One step, planned and routed: what the drop-ins hand to Megatron-Core."""

    step: int
    plan: Plan
    sample_id_groups: list[list[list[int]]]
    samples: dict[int, dict[str, torch.Tensor]]
    layout: GlobalLayout
    traffic: Traffic
    source: str | None


@dataclass
class StepPlanner:
    """Reads step k+1 while step k is handed out, plans it ahead, and routes step k's samples."""

    read_local: Callable[[], LocalBatch]  # raises StopIteration at the end of the data
    groups: mcore.DataGroups
    client: BatchPlannerClient
    transformer_config: Any = None
    _ahead: ReadStep | None = field(default=None, init=False)
    _step: int = field(default=0, init=False)

    def next_step(self) -> PlannedStep:
        current = self._ahead if self._ahead is not None else self._read(self._step)
        self._ahead = None
        if current.exhausted:
            raise StopIteration
        if current.error is None:
            self._ahead = self._read(current.step + 1)  # one global batch ahead: its plan is made while this step trains
        self._step = current.step + 1
        if current.error is not None:
            raise DropInInputError(current.error)
        return self._plan_and_route(current)

    def _read(self, step: int) -> ReadStep:
        local, error = None, None
        try:
            local = self.read_local()
        except StopIteration:
            pass
        except DropInInputError as problem:
            error = str(problem)
        read = agree_on_step(step, local, error, self.groups)
        if read.layout is not None:
            self.client.prefetch(step, list(read.layout.padded))
        return read

    def _plan_and_route(self, current: ReadStep) -> PlannedStep:
        assert current.layout is not None and current.local is not None
        plan = self.client.plan_step(current.step, list(current.layout.padded))
        check_dynamic_cp_support(planner_config=self.client.config, transformer_config=self.transformer_config, plan=plan)
        id_groups = sample_id_groups(plan)
        traffic = Traffic()
        samples = route_samples(current.local, current.layout, self.groups, id_groups, traffic)
        return PlannedStep(current.step, plan, id_groups, samples, current.layout, traffic, self.client.last_source)

    def close(self) -> None:
        self.client.close()


def _client(config: PlannerClientConfig, groups: mcore.DataGroups) -> BatchPlannerClient:
    return BatchPlannerClient(config, group=groups.dp_cp, cp_groups=None)


def _transformer_config(config: Any) -> Any:
    """Megatron's config is checked centrally when it is Megatron-Core's TransformerConfig."""
    return config if type(config).__name__ == "TransformerConfig" or hasattr(config, "transformer_impl") else None


# ---------------------------------------------------------------------------------------------
# 0.19.x: HybridCPDataLoaderWrapper


class HybridCPDataLoaderWrapper:
    """Drop-in for `megatron.core.datasets.data_schedule.HybridCPDataLoaderWrapper`.

    Each DP rank's `data_iterator` yields a list of packed samples (dicts with `cu_seqlens` and 1-D
    per-token fields) per step, as for Megatron-Core's wrapper. `next()` yields
    `(samples_this_rank_with_id, sample_id_groups)`: this rank's sub-samples by global id and the
    plan in Megatron-Core's shape; TP ranks other than the first (whose `data_iterator` is None)
    get `(None, None)`, as from Megatron-Core's wrapper.

    Extra keyword `planner`: the planner settings (see the module docstring).
    """

    def __init__(self, data_iterator, config, pg_collection=None, *, planner: PlannerClientConfig | dict | None = None):
        self.data_iterator = data_iterator
        self.config = config
        self.groups = mcore.DataGroups.of(pg_collection)
        self.total_hdp_gpus = self.groups.dp_cp.size()
        self.last_step: PlannedStep | None = None
        self._planner: StepPlanner | None = None
        if data_iterator is None:
            return
        cp_size = self.total_hdp_gpus // self.groups.dp.size()
        planner_config = planner_config_for(config, SchedulerKind.HYBRID_CP, cp_size, planner)
        self._planner = StepPlanner(self._read_local, self.groups, _client(planner_config, self.groups), _transformer_config(config))

    @property
    def client(self) -> BatchPlannerClient | None:
        return self._planner.client if self._planner else None

    def __iter__(self):
        return self

    def __next__(self):
        if self._planner is None:
            return None, None  # TP ranks > 0: Megatron-Core broadcasts within the TP group
        self.last_step = self._planner.next_step()
        return self.last_step.samples, self.last_step.sample_id_groups

    def _read_local(self) -> LocalBatch:
        batch = next(self.data_iterator)
        for index, sample in enumerate(batch):
            problem = check_packed_sample(sample, f"packed sample {index} of this rank's batch")
            if problem:
                raise DropInInputError(problem)
        return _local_batch(mcore.unpack_hybrid_cp_batch(batch))

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()


# ---------------------------------------------------------------------------------------------
# dev branch: wrap_data_iterator (dynamic CP and static packing)


# Per wrapped iterator (by id; the iterator is held so that its id is not reused).
_packing_planners: dict[int, tuple[Any, "_PackingDropIn"]] = {}


@dataclass
class _PackingDropIn:
    """The state wrap_data_iterator keeps per wrapped iterator between steps (for plan-ahead)."""

    data_iterator: Any
    config: Any
    num_microbatches: int
    groups: mcore.DataGroups
    scheduler: SchedulerKind
    planner: StepPlanner | None = None

    def read_local(self) -> LocalBatch:
        items = [next(self.data_iterator) for _ in range(self.num_microbatches)]
        batch = [sample for item in items for sample in (item if isinstance(item, list) else [item])]
        for index, sample in enumerate(batch):
            if "padded_seq_len" not in sample:
                problem = check_packed_sample(sample, f"packed sample {index} of this rank's batch")
                if problem:
                    raise DropInInputError(problem)
        if not batch:
            raise DropInInputError("the local batch is empty (the data iterator yielded no samples)")
        subsamples = mcore.unpack_packing_batch(batch)
        padded = [int(s["padded_seq_len"].reshape(-1)[0]) for s in subsamples]
        original = [int(s["original_seq_len"].reshape(-1)[0]) for s in subsamples]
        kept = [{k: v for k, v in s.items() if k in _packing_keys(self.groups, self.config)} for s in subsamples]
        return _local_batch(kept, padded, original)


def _packing_keys(groups: mcore.DataGroups, config: Any) -> set[str]:
    """The fields this pipeline stage needs (Megatron-Core's own choice), plus the two lengths."""
    first = groups.pp is None or groups.pp.rank() == 0
    last = groups.pp is None or groups.pp.rank() == groups.pp.size() - 1
    keys = set(_LENGTH_KEYS)
    if first:
        keys |= {"tokens", "position_ids"}
    if last:
        keys |= {"labels", "loss_mask"}
    return keys


def wrap_data_iterator(data_iterator, config, num_microbatches, pg_collection=None, *, planner=None):
    """Drop-in for the dev branch's `megatron.core.datasets.data_schedule.wrap_data_iterator`.

    Returns `(data_iterator over this rank's packed THD micro-batches, number of micro-batches,
    sum of the global batch's sequence lengths, sum of their squares)`, built with Megatron-Core's
    own packing helpers; TP ranks other than the first get None and the broadcast numbers.
    """
    groups = mcore.DataGroups.of(pg_collection)
    if (getattr(config, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
        raise ConfigError(
            "virtual_pipeline_model_parallel_size > 1: the planner drop-in for wrap_data_iterator does not "
            "hand out per-VPP-stage iterators yet; use Megatron-Core's wrap_data_iterator for VPP"
        )
    device = _device(groups)
    if data_iterator is None:
        values = mcore.broadcast_scalars([0, 0.0, 0.0], groups.tp, device)
        return None, int(values[0]), values[1], values[2]
    state = _packing_state(data_iterator, config, num_microbatches, groups, planner)
    step = state.planner.next_step()
    scheduler = state.scheduler
    dynamic = scheduler is SchedulerKind.DYNAMIC_CP
    samples = {
        i: {**fields, **_length_tensors(step.layout, i, device)} for i, fields in step.samples.items()
    }
    packed = mcore.build_packed_microbatches(samples, step.sample_id_groups, groups.dp_cp.rank(), device, dynamic)
    sums = [len(step.sample_id_groups), float(sum(step.layout.padded)), float(sum(p * p for p in step.layout.padded))]
    count, total, squares = mcore.broadcast_scalars(sums, groups.tp, device)
    iterator = mcore.create_packed_data_iterator(packed, groups.tp, config, dynamic)
    _last_steps[id(data_iterator)] = step
    return iterator, int(count), total, squares


_last_steps: dict[int, PlannedStep] = {}


def last_planned_step(data_iterator) -> PlannedStep | None:
    """The step wrap_data_iterator last handed out for `data_iterator` (plan, traffic, source)."""
    return _last_steps.get(id(data_iterator))


def _length_tensors(layout: GlobalLayout, sample_id: int, device) -> dict[str, torch.Tensor]:
    return {
        "original_seq_len": torch.tensor([layout.original[sample_id]], device=device),
        "padded_seq_len": torch.tensor([layout.padded[sample_id]], device=device),
    }


def _packing_state(data_iterator, config, num_microbatches, groups, planner) -> _PackingDropIn:
    held = _packing_planners.get(id(data_iterator))
    state = held[1] if held is not None else None
    if state is not None:
        if state.num_microbatches != num_microbatches:
            raise ConfigError(
                f"num_microbatches changed from {state.num_microbatches} to {num_microbatches} (batch-size "
                "ramp-up): the drop-in reads one global batch ahead with the old count; turn ramp-up off"
            )
        return state
    name = getattr(config, "sequence_packing_scheduler", None)
    if name not in _PACKING_SCHEDULERS:
        raise ConfigError(f"sequence_packing_scheduler: {name!r} is not allowed; allowed: {sorted(_PACKING_SCHEDULERS)}")
    scheduler = _PACKING_SCHEDULERS[name]
    state = _PackingDropIn(data_iterator, config, num_microbatches, groups, scheduler)
    cp_size = groups.dp_cp.size() // groups.dp.size()
    client = _client(planner_config_for(config, scheduler, cp_size, planner), groups)
    state.planner = StepPlanner(state.read_local, groups, client, _transformer_config(config))
    _packing_planners[id(data_iterator)] = (data_iterator, state)
    return state


def _device(groups: mcore.DataGroups) -> torch.device:
    if dist.get_backend(groups.dp_cp) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def close_wrapped(data_iterator) -> None:
    """Stops the planner client wrap_data_iterator made for `data_iterator`."""
    held = _packing_planners.pop(id(data_iterator), None)
    _last_steps.pop(id(data_iterator), None)
    if held is not None and held[1].planner is not None:
        held[1].planner.close()
