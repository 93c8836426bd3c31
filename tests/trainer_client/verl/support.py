"""Shared by the verl tests: mini-batches shaped like verl's, and comparing micro-batches."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu


def mini_batch(lengths: list[int], seed: int) -> TensorDict:
    """A replicated mini-batch as verl's engine gets it: jagged per-token fields, a per-sample
    tensor and a non-tensor value."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 32000, (n,), generator=gen) for n in lengths]
    batch = TensorDict(
        {
            "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            "loss_mask": torch.nested.as_nested_tensor([(t % 3 > 0).float() for t in ids], layout=torch.jagged),
            "uid": torch.arange(len(lengths)) + 1000 * seed,
        },
        batch_size=[len(lengths)],
    )
    tu.assign_non_tensor_data(batch, "temperature", 0.7)
    return batch


def long_tail(count: int, longest: int, seed: int) -> list[int]:
    """`count` lengths, most short, a few up to `longest` (at least 1 token each)."""
    gen = torch.Generator().manual_seed(seed)
    short = torch.randint(1, max(2, longest // 8), (count,), generator=gen)
    long = torch.randint(max(1, longest // 2), longest + 1, (count,), generator=gen)
    pick = torch.rand(count, generator=gen) < 0.2
    return [int(n) for n in torch.where(pick, long, short)]


def assert_same_micro_batches(ours: list[TensorDict], theirs: list[TensorDict], where: str) -> None:
    """Key by key, tensor by tensor (values, dtypes, jagged offsets) and every non-tensor value."""
    assert len(ours) == len(theirs), f"{where}: {len(ours)} micro-batches, verl's {len(theirs)}"
    for index, (a, b) in enumerate(zip(ours, theirs)):
        at = f"{where}, micro-batch {index}"
        assert sorted(a.keys()) == sorted(b.keys()), f"{at}: keys {sorted(a.keys())} vs verl's {sorted(b.keys())}"
        assert a.batch_size == b.batch_size, f"{at}: batch size {a.batch_size} vs {b.batch_size}"
        for key in a.keys():
            x, y = _value(a, key), _value(b, key)
            assert type(x) is type(y), f"{at}, {key!r}: {type(x).__name__} vs {type(y).__name__}"
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and x.is_nested == y.is_nested, f"{at}, {key!r}: {x.dtype} vs {y.dtype}"
                if x.is_nested:
                    assert torch.equal(x.offsets(), y.offsets()), f"{at}, {key!r}: offsets differ"
                    assert torch.equal(x.values(), y.values()), f"{at}, {key!r}: values differ"
                else:
                    assert torch.equal(x, y), f"{at}, {key!r}: {x} vs {y}"
            else:
                assert x == y, f"{at}, {key!r}: {x!r} vs verl's {y!r}"


def _value(td: TensorDict, key: str):
    value = td.get(key)
    if isinstance(value, torch.Tensor):
        return value
    return tu.get_non_tensor_data(td, key, None)


def fake_outputs(micro_batches: list[TensorDict]) -> list[dict]:
    """What verl's engine hands `postprocess_dynamic_cp_batch` per micro-batch: per-sample model
    outputs (here a function of each sample's tokens), the loss, metrics and the DCP keys."""
    from verl.utils.dynamic_cp_scheduler import DCP_GROUP_LEADER, DCP_SAMPLE_IDS

    outputs = []
    for mb in micro_batches:
        ids = tu.get_non_tensor_data(mb, DCP_SAMPLE_IDS, None)
        parts = [t.float() * 0.5 for t in mb["input_ids"].unbind()]
        outputs.append(
            {
                "model_output": {"log_probs": torch.nested.as_nested_tensor(parts, layout=torch.jagged)},
                "loss": float(sum(ids)),
                "metrics": {"first_id": float(min(ids))},
                DCP_GROUP_LEADER: tu.get_non_tensor_data(mb, DCP_GROUP_LEADER, None),
                DCP_SAMPLE_IDS: ids,
            }
        )
    return outputs
