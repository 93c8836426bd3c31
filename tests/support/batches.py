"""The trainer-side batches the tests feed the client: a TensorDict of samples, "input_ids" one
jagged nested tensor, plus any per-sample fields a test adds."""

from __future__ import annotations

import torch


def token_ids(lengths, *, first: int = 0, traceable: bool = False) -> torch.Tensor:
    """One row per sample: `first`, `first` + 1, ... (its positions), or with `traceable`
    sample id * 100,000 + position, so a shard tells where its tokens came from."""
    rows = [(i * 100_000 if traceable else first) + torch.arange(n) for i, n in enumerate(lengths)]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def token_batch(lengths, *, first: int = 0, traceable: bool = False, **fields):
    """The batch of `lengths` samples: "input_ids" (token_ids), then `fields` in order."""
    from tensordict import TensorDict

    return TensorDict({"input_ids": token_ids(lengths, first=first, traceable=traceable), **fields}, batch_size=[len(lengths)])
