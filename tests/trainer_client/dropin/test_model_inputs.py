"""A unit as model inputs (trainer_client/dropin/model_inputs.py), on one process, every rank of a
4-rank DPxCP plan in turn (odd lengths: every CP group pads): the `[1, rows]` tensors are the unit's
own fields on the device asked for; positions are the unit's place in each padded sequence, or a
field the samples carry (Bridge's, 0 on padding); the cu_seqlens are moved once, and Megatron-Core's
PackedSeqParams shares them; units made without PackedSeqParams give the same tensors without
importing Megatron-Core; a field the unit lacks is refused, naming it and the unit's fields."""

from __future__ import annotations

import sys

import pytest
import torch

from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest
from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.batch import GlobalBatch, JaggedField
from trainer_client.dropin import ModelInputs, model_inputs, packed_seq_params_on
from trainer_client.errors import UsageError

# At 64 tokens per rank: 150 needs CP4, 90 and 101 CP2, the rest CP1; none a multiple of 8.
LENGTHS = (150, 17, 90, 5, 30, 9, 70, 3, 41, 13, 27, 101)
STARTS = tuple(sum(LENGTHS[:i]) for i in range(len(LENGTHS)))
META = torch.device("meta")


def _units(rank: int, packed_seq_params: bool = True):
    """Rank `rank`'s packed units of the plan; token i of the batch holds i + 1 (0 on padding)."""
    plan = plan_batch(PlanRequest.of(LENGTHS, 4, 1, 64))
    ids = torch.arange(sum(LENGTHS)) + 1
    positions = torch.cat([torch.arange(n) + 1000 for n in LENGTHS])
    fields = {"tokens": ids, "labels": ids * 10, "loss_mask": torch.ones(len(ids)), "position_ids": positions}
    batch = GlobalBatch(LENGTHS, {name: JaggedField(values, STARTS) for name, values in fields.items()}, {})
    return micro_batches_for_rank(plan, batch, rank, None, pack_group_samples=True, with_packed_seq_params=packed_seq_params)


@pytest.mark.parametrize("rank", range(4))
def test_the_inputs_are_the_units_fields_on_the_device(rank):
    units = _units(rank)
    assert {u.local_cp_size for r in range(4) for u in _units(r)} == {1, 2, 4}
    for unit in units:
        inputs = model_inputs(unit, torch.device("cpu"))
        rows = unit.local_tokens
        for name, field in (("input_ids", "tokens"), ("labels", "labels"), ("loss_mask", "loss_mask")):
            tensor = getattr(inputs, name)
            assert tensor.shape == (1, rows) and torch.equal(tensor[0], unit.token_fields[field]), (rank, name)
        assert torch.equal(inputs.position_ids[0], unit.position_ids)
        assert bool((inputs.loss_mask[0][~unit.padding_mask] == 0).all()) and bool((inputs.input_ids[0][~unit.padding_mask] == 0).all())
        assert inputs.cu_seqlens.tolist() == unit.cu_seqlens.tolist() and inputs.cu_seqlens.dtype == torch.int32
        assert inputs.cu_seqlens_padded.tolist() == unit.cu_seqlens_padded.tolist()
        assert (inputs.max_seqlen, inputs.cp_size, inputs.cp_group) == (unit.max_seqlen, unit.local_cp_size, None)
        kwargs = inputs.megatron_kwargs()
        assert kwargs["attention_mask"] is None and kwargs["packed_seq_params"] is inputs.packed_seq_params
        assert kwargs["input_ids"] is inputs.input_ids and kwargs["position_ids"] is inputs.position_ids


def test_positions_come_from_the_unit_or_from_the_field_the_samples_carry():
    padded_somewhere = False
    for unit in (u for r in range(4) for u in _units(r)):
        own = model_inputs(unit, torch.device("cpu")).position_ids[0]
        carried = model_inputs(unit, torch.device("cpu"), positions="position_ids").position_ids[0]
        real = unit.padding_mask
        assert torch.equal(carried[real], own[real] + 1000)  # the same places, as each field says them
        assert bool((carried[~real] == 0).all())  # padding rows: the field's filler
        assert int(own.max()) < unit.max_seqlen  # a place in a padded sequence, padding rows included
        padded_somewhere |= bool((~real).any())
    assert padded_somewhere, "no unit pads: the lengths test nothing"


def test_the_cu_seqlens_move_once_and_the_packed_seq_params_share_them():
    for unit in (u for r in range(4) for u in _units(r)):
        before = unit.packed_seq_params
        inputs = model_inputs(unit, META)
        params = inputs.packed_seq_params
        assert inputs.input_ids.device == META and inputs.cu_seqlens.device == META
        assert params.cu_seqlens_q is params.cu_seqlens_kv is inputs.cu_seqlens
        assert params.cu_seqlens_q_padded is params.cu_seqlens_kv_padded is inputs.cu_seqlens_padded
        assert unit.packed_seq_params is before and before.cu_seqlens_q.device.type == "cpu"  # the unit is left as it was
        moved = packed_seq_params_on(unit, META)
        assert moved.cu_seqlens_q is moved.cu_seqlens_kv and moved.cu_seqlens_q.device == META


def test_units_without_packed_seq_params_need_no_megatron_core(monkeypatch):
    with_params = [model_inputs(u, torch.device("cpu")) for u in _units(1)]
    # Any import of Megatron-Core's PackedSeqParams now fails: nothing below may ask for it.
    monkeypatch.setitem(sys.modules, "megatron.core.packed_seq_params", None)
    with pytest.raises(ImportError):
        _units(1)
    plain = [model_inputs(u, torch.device("cpu")) for u in _units(1, packed_seq_params=False)]
    assert len(plain) == len(with_params) > 0
    for got, want in zip(plain, with_params):
        assert isinstance(got, ModelInputs) and got.packed_seq_params is None
        for name in ("input_ids", "position_ids", "labels", "loss_mask", "cu_seqlens", "cu_seqlens_padded"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.max_seqlen, got.cp_size) == (want.max_seqlen, want.cp_size)
        assert torch.equal(got.cu_seqlens, want.packed_seq_params.cu_seqlens_q)


def test_a_field_the_unit_lacks_is_refused_naming_it_and_the_units_fields():
    unit = _units(0)[0]
    with pytest.raises(UsageError) as refused:
        model_inputs(unit, torch.device("cpu"), tokens="input_ids", positions="positions")
    message = str(refused.value)
    assert "no token field ['input_ids', 'positions']" in message, message
    assert "its fields: ['labels', 'loss_mask', 'position_ids', 'tokens']" in message, message
