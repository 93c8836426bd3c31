"""The trainer client's public functions refuse bad input clearly: lengths by the server's own rule
before any RPC or fallback, a batch that is not the planned batch, wrong types. Explicit cases (the
ones a new user tried) against a real planner on loopback, and a property over hostile values of
every argument: every failure is one of the documented exception types and names the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from batch_planner.errors import InvalidRequestError
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest
from tests.support.megatron_builds import best_local_scheduler
from trainer_client import BatchMismatchError, BatchPlannerClient, ConfigError, PlannerClientConfig
from trainer_client.plans.batch_check import check_batch_is_planned
from trainer_client.plans.outputs import OutputRestoreError
from trainer_client.service.rpc_client import PlanRejectedError

# With 4 ranks of 1,024 tokens: 3,000 needs CP4, 1,500-1,800 CP2, the rest CP1.
LENGTHS = (3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1)
NEXT_STEP = (2000, 1024, 1800, 700, 60, 301, 900, 97, 1000, 64, 333, 9)
PROFILE = settings(
    derandomize=True, database=None, deadline=None, max_examples=300,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def config(**values) -> PlannerClientConfig:
    return PlannerClientConfig(max_seqlen_per_dp_cp_rank=1024, scheduler=best_local_scheduler(), **values)


def jagged(lengths) -> TensorDict:
    return TensorDict(
        {"input_ids": torch.nested.nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)},
        batch_size=[len(lengths)],
    )


def metric(client: BatchPlannerClient, name: str, **labels) -> float:
    return client.metrics.registry.get_sample_value(name, {"training_job": "", **labels}) or 0.0


@pytest.fixture()
def local_client():
    """Plans in-process (no endpoint); the plan of LENGTHS for step 0."""
    client = BatchPlannerClient(config(), dp_cp_size=4, rank=0)
    plan = client.plan_step(0, LENGTHS)
    yield client, plan
    client.close()


# What a new user tried (the table): lengths, each refused before any call.
BAD_LENGTHS = [
    ("floats", [1.5, 2.9, 3.0], r"sequence_lengths: sample 0 has value 1.5 \(float\)"),
    ("strings", ["512", "64"], r"sequence_lengths: sample 0 has value '512' \(str\)"),
    ("bools", [True, 3], r"sequence_lengths: sample 0 has value True \(bool\)"),
    ("a negative", [100, 200, -3], r"sequence_lengths: sample 2 has length -3"),
    ("None", None, r"sequence_lengths: got None; expected a sequence of integer lengths"),
    ("a scalar", 4096, r"sequence_lengths: got the int 4096; expected a sequence"),
    ("NaN", [100, math.nan], r"sequence_lengths: sample 1 has value nan \(float\)"),
    ("a float tensor", torch.tensor([100.0, 7.0]), r"sequence_lengths: sample 0 has value 100.0 \(float\)"),
    ("a bool array", np.array([True, False]), r"sequence_lengths: sample 0 has value True \(bool\)"),
    ("a mapping", {0: 100}, r"sequence_lengths: got the dict \{0: 100\}"),
]


@pytest.mark.parametrize("lengths,words", [c[1:] for c in BAD_LENGTHS], ids=[c[0] for c in BAD_LENGTHS])
def test_bad_lengths_are_refused_in_the_client_before_any_rpc_or_fallback(planner, lengths, words):
    client = BatchPlannerClient(config(planner_endpoint=planner.address, tls=False), dp_cp_size=32, rank=0)
    try:
        for call in (client.prefetch, client.plan_step):
            with pytest.raises(PlanRejectedError, match=r"INVALID_ARGUMENT\): " + words) as refused:
                call(0, lengths)
            assert refused.value.code == "INVALID_ARGUMENT"
    finally:
        client.close()
    assert metric(client, "batch_planner_client_rpc_latency_seconds_count") == 0  # no RPC
    assert metric(client, "batch_planner_client_plans_total", source="fallback") == 0  # no fallback


def test_integer_arrays_and_tensors_are_lengths_and_plan_as_the_list(local_client):
    client, plan = local_client
    for lengths in (np.array(LENGTHS), torch.tensor(LENGTHS, dtype=torch.int32), [np.int64(n) for n in LENGTHS], range(1, 13)):
        planned = client.plan_step(1, lengths)
        assert (planned.plan_id == plan.plan_id) == (not isinstance(lengths, range))


def test_the_in_process_planner_refuses_what_is_not_an_integer_by_the_same_rule():
    for lengths, words in (((1.5, 2.0), "sample 0 has value 1.5"), ((7, "8"), "sample 1 has value '8'"), ((3, True), "sample 1 has value True")):
        with pytest.raises(InvalidRequestError, match=f"sequence_lengths: {words}") as refused:
            plan_batch(PlanRequest.of(lengths, 4, 1, 1024))
        assert refused.value.field == "sequence_lengths"


BAD_BATCHES = [
    ("a list of tensors", [torch.arange(3)], TypeError, r"batch: got a list of Tensor; expected a TensorDict"),
    ("input_ids a list", {"input_ids": [torch.arange(3)]}, TypeError, r"batch: field 'input_ids' is a list of Tensor"),
    ("None", None, TypeError, r"batch: got None; expected a TensorDict, or a mapping"),
    ("one token longer", jagged([n + 1 for n in LENGTHS]), BatchMismatchError,
     r"step 0: sample 0 of the batch has length 3001, the plan was made for length 3000"),
    ("in another order", jagged(LENGTHS[1:] + LENGTHS[:1]), BatchMismatchError,
     r"step 0: sample 0 of the batch has length 1500, the plan was made for length 3000"),
    ("the next step's", jagged(NEXT_STEP), BatchMismatchError, r"step 0: sample 0 of the batch has length 2000"),
    ("a sample short", jagged(LENGTHS[:-1]), BatchMismatchError, r"step 0: the plan was made for 12 samples but the batch holds 11"),
]


@pytest.mark.parametrize("batch,error,words", [c[1:] for c in BAD_BATCHES], ids=[c[0] for c in BAD_BATCHES])
def test_micro_batches_refuses_what_is_not_the_planned_batch(local_client, batch, error, words):
    client, plan = local_client
    with pytest.raises(error, match=words):
        client.micro_batches(plan, batch)
    assert client.micro_batches(plan, jagged(LENGTHS))  # the planned batch applies


def test_a_plan_this_client_did_not_hand_out_cannot_be_checked_and_is_refused(local_client):
    client, _ = local_client
    other = plan_batch(PlanRequest.of(NEXT_STEP, 4, 1, 1024))
    with pytest.raises(BatchMismatchError, match=f"plan {other.plan_id} is not one of the last 3 plans"):
        client.micro_batches(other, jagged(NEXT_STEP))
    with pytest.raises(TypeError, match="plan: got a str; expected the Plan plan_step returned"):
        client.micro_batches("plan", jagged(LENGTHS))


def test_the_check_names_the_first_sample_that_differs_and_the_step():
    check_batch_is_planned(LENGTHS, list(LENGTHS), step=3)  # equal: nothing
    with pytest.raises(BatchMismatchError, match="step 3: sample 4 of the batch has length 60, the plan was made for length 500"):
        check_batch_is_planned(LENGTHS, (*LENGTHS[:4], 60, *LENGTHS[5:]), step=3)
    with pytest.raises(BatchMismatchError, match="^sample 1 of the batch"):  # no step known (verl's mini-batches)
        check_batch_is_planned((1, 2), (1, 3))


@pytest.mark.parametrize("values,error,words", [
    (dict(dp_cp_size=0), ValueError, r"dp_cp_size: 0 is not allowed; expected an int >= 1"),
    (dict(dp_cp_size=True), TypeError, r"dp_cp_size: got True \(bool\)"),
    (dict(dp_cp_size=32.0), TypeError, r"dp_cp_size: got 32.0 \(float\)"),
    (dict(dp_cp_size=32, rank=32), ValueError, r"rank: 32 is not allowed; expected an int in 0..31"),
    (dict(dp_cp_size=32, rank=-1), ValueError, r"rank: -1 is not allowed"),
    (dict(dp_cp_size=32, rank="0"), TypeError, r"rank: got '0' \(str\)"),
    (dict(), ValueError, r"dp_cp_size: torch.distributed is not initialised"),
])
def test_an_impossible_group_layout_is_refused_at_construction(values, error, words):
    with pytest.raises(error, match=words):
        BatchPlannerClient(config(), **values)
    with pytest.raises(TypeError, match="config: got a dict; expected a PlannerClientConfig"):
        BatchPlannerClient({"max_seqlen_per_dp_cp_rank": 1024}, dp_cp_size=4)


@pytest.mark.parametrize("text,section,words", [
    ("a: [1, 2\n", None, r"not a YAML file"),
    ("- 1\n- 2\n", None, r"the config must be a mapping, got list"),
    ("model: {layers: 2}\n", "batch_planner", r"no top-level section 'batch_planner'; sections: \['model'\]"),
    ("batch_planner: 5\n", "batch_planner", r"section 'batch_planner' must be a mapping, got int"),
    ("batch_planner: [a]\n", "batch_planner", r"section 'batch_planner' must be a mapping, got list"),
    ("3: 4\n", None, r"key\(s\) \[3\] are not names"),
])
def test_config_files_that_are_not_settings_are_refused_naming_the_file(tmp_path, text, section, words):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        PlannerClientConfig.from_yaml(path, section=section)


def test_outputs_and_step_records_of_the_wrong_type_are_refused(local_client):
    client, plan = local_client
    units = client.micro_batches(plan, jagged(LENGTHS))
    with pytest.raises(TypeError, match=r"local_outputs: key '3' is a str; expected int sample ids"):
        client.restore_outputs(plan, {"3": 1.0})
    with pytest.raises(TypeError, match=r"local_outputs: got a list"):
        client.restore_outputs(plan, [1.0])
    with pytest.raises(ValueError, match=r"lengths: sample 0 has value 1.5 \(float\)"):
        client.restore_token_outputs([], [1.5])
    with pytest.raises(TypeError, match=r"pieces: item 0 is a int"):
        client.restore_token_outputs([3], LENGTHS)
    with pytest.raises(ValueError, match=r"seconds: nan is not allowed; expected a finite number of seconds >= 0"):
        client.record_step(units, math.nan)
    with pytest.raises(TypeError, match=r"micro_batches: got .*; expected the RankMicroBatches"):
        client.record_step([jagged(LENGTHS)], 1.0)


# -- hostile values of every argument ------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.binary(max_size=4), st.just(object()), st.just(np.int64(7)), st.just(np.float32(2.5)),
)
TENSORS = st.sampled_from([
    torch.tensor(3), torch.tensor([1.5, 2.0]), torch.tensor([[1, 2], [3, 4]]), torch.tensor([True]),
    torch.tensor([4, 5], dtype=torch.int16), torch.zeros(0, dtype=torch.long), np.array([1, 2]), np.array([0.5]),
])
HOSTILE = st.recursive(
    st.one_of(SCALARS, TENSORS),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.tuples(inner, inner), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=8,
)
LENGTHS_LIKE = st.one_of(HOSTILE, st.lists(st.integers(-3, 5000), max_size=14))
BATCHES = st.one_of(
    HOSTILE,
    st.lists(st.integers(1, 3001), min_size=1, max_size=14).map(jagged),
    st.permutations(LENGTHS).map(jagged),
    st.dictionaries(st.sampled_from(["input_ids", "labels", "t"]), st.one_of(HOSTILE, TENSORS), max_size=3),
)
DOCUMENTED = (TypeError, ValueError, OutputRestoreError)  # PlanRejectedError, BatchMismatchError, ConfigError are ValueErrors


def refused_clearly(call, *names: str) -> None:
    """`call()` succeeds, or raises a documented type whose message names one of `names`."""
    try:
        call()
    except DOCUMENTED as error:
        assert any(name in str(error) for name in names), f"{type(error).__name__}: {error} names none of {names}"


@PROFILE
@given(step=st.one_of(st.integers(0, 3), HOSTILE), lengths=LENGTHS_LIKE)
def test_hostile_steps_and_lengths(local_client, step, lengths):
    client, _ = local_client
    refused_clearly(lambda: client.prefetch(step, lengths), "step", "sequence_lengths")
    refused_clearly(lambda: client.plan_step(step, lengths), "step", "sequence_lengths")


@PROFILE
@given(
    plan=st.one_of(st.just("planned"), HOSTILE), batch=BATCHES,
    pad_token_id=st.one_of(st.just(0), SCALARS), pack=st.one_of(st.sampled_from([None, True, False]), SCALARS),
)
def test_hostile_micro_batches_arguments(local_client, plan, batch, pad_token_id, pack):
    client, planned = local_client
    plan = planned if plan == "planned" else plan
    refused_clearly(lambda: client.micro_batches(plan, batch, pad_token_id, pack), "plan", "batch", "pad_token_id", "pack_group_samples")


@PROFILE
@given(
    plan=st.one_of(st.just("planned"), HOSTILE), outputs=st.one_of(HOSTILE, st.dictionaries(SCALARS, SCALARS, max_size=4)),
    pieces=HOSTILE, lengths=LENGTHS_LIKE, seconds=st.one_of(SCALARS, st.floats()), units=HOSTILE,
)
def test_hostile_outputs_and_records(local_client, plan, outputs, pieces, lengths, seconds, units):
    client, planned = local_client
    plan = planned if plan == "planned" else plan
    refused_clearly(lambda: client.restore_outputs(plan, outputs), "plan", "local_outputs", "per-sample outputs")
    refused_clearly(lambda: client.restore_token_outputs(pieces, lengths), "pieces", "lengths", "per-token outputs")
    refused_clearly(lambda: client.record_step(units, seconds), "micro_batches", "seconds")


KEYS = sorted(PlannerClientConfig.__pydantic_fields__)


@PROFILE
@given(
    values=st.one_of(HOSTILE, st.dictionaries(st.sampled_from(KEYS), HOSTILE, max_size=3)),
    dp_cp_size=st.one_of(st.just(8), HOSTILE), rank=st.one_of(st.just(0), HOSTILE),
    text=st.one_of(st.text(max_size=30), st.sampled_from(["batch_planner: 3\n", "x: [\n", "- 1\n", "batch_planner:\n  tls: 2\n"])),
    section=st.one_of(st.none(), st.just("batch_planner"), SCALARS),
)
def test_hostile_configs_and_layouts(tmp_path_factory, values, dp_cp_size, rank, text, section):
    refused_clearly(lambda: PlannerClientConfig.from_dict(values), "config", "key", *KEYS)
    path = tmp_path_factory.mktemp("yaml") / "train.yaml"
    path.write_text(text)
    refused_clearly(lambda: PlannerClientConfig.from_yaml(path, section=section), str(path), "section", *KEYS)
    refused_clearly(lambda: BatchPlannerClient(config(), dp_cp_size=dp_cp_size, rank=rank).close(), "dp_cp_size", "rank")
