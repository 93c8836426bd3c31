"""Pipeline-parallel runs of the attention model (tests/support/attention_model.py) through Megatron-Core's
own schedule (`get_forward_backward_func()`: 1F1B, or interleaved with virtual stages), on gloo.

`pipeline_loss_and_grads` runs one step over this rank's micro-batches (RankShards of
tests/support/attention_parity.py, one per micro-batch, the same list on every stage of a pipeline) and
returns the loss summed over micro-batches (last stage) and this rank's parameter gradients. The
reference is the same pipeline over each whole sample alone at CP1 (`whole_sample_shards`), so a
test compares what CP and packing change, stage by stage, with Megatron-Core's schedule moving
the activations either way.

CPU stand-ins, each named as such (on top of tests/support/megatron_init.py's and CudaDeviceRequestsOnCpu):
`stand_in_for_pipeline_calls_on_cpu` makes `torch.cuda.is_current_stream_capturing()` answer False
(no stream captures on a CPU): Megatron-Core's batched p2p asks it after every exchange before
its `torch.cuda.synchronize()`."""

from __future__ import annotations

from typing import Sequence

import torch

from tests.support.attention_parity import RankShard, Sample


def stand_in_for_pipeline_calls_on_cpu() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.is_current_stream_capturing = lambda: False


def _forward_step(data_iterator, model):
    shard = next(data_iterator)
    losses = model(input_ids=shard.tokens[None], position_ids=shard.position_ids[None], attention_mask=None,
                   labels=shard.labels[None], loss_mask=shard.loss_mask[None], packed_seq_params=shard.packed_seq_params)

    def loss_func(output):
        loss = (output.reshape(-1) * shard.loss_mask).sum()
        tokens = shard.loss_mask.sum().to(torch.int)
        return loss, tokens, {"loss": torch.stack([loss.detach(), tokens.float()])}

    return losses, loss_func


def pipeline_loss_and_grads(models: Sequence[torch.nn.Module], shards: Sequence[RankShard]) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward-backward step of `shards` (this rank's micro-batches, in order) over this rank's
    model chunks (one per virtual stage). Returns (the summed loss of the micro-batches, 0.0 off
    the last stage; each parameter's gradient, named '<chunk>.<name>'). Gradients are the raw sums
    (the config's calculate_per_token_loss=True and no finalize_model_grads)."""
    iterators = [iter(list(shards)) for _ in models]
    loss, _, grads = run_pipeline(models, iterators, len(shards), _forward_step)
    return loss, grads


def run_pipeline(models: Sequence[torch.nn.Module], iterators: Sequence, num_microbatches: int, forward_step,
                 forward_only: bool = False) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One forward-backward step through Megatron-Core's schedule: `iterators` one per model chunk,
    `forward_step(data_iterator, model)` as Megatron-Core calls it, its loss function returning
    {"loss": [loss, tokens]}. Returns (the summed loss and loss-mask tokens of the micro-batches,
    0.0 off the last stage; each parameter's gradient, named '<chunk>.<name>': none with
    `forward_only`, which leaves the gradients as they are)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        for m in models:
            m.zero_grad(set_to_none=True)
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=list(iterators) if len(models) > 1 else iterators[0],
        model=list(models) if len(models) > 1 else models[0], num_microbatches=num_microbatches, seq_length=0,
        micro_batch_size=1, forward_only=forward_only,
    )
    if forward_only:
        loss = float(sum(float(r["loss"][0]) for r in results))
        return loss, float(sum(float(r["loss"][1]) for r in results)), {}
    loss = float(sum(float(r["loss"][0]) for r in results))
    tokens = float(sum(float(r["loss"][1]) for r in results))
    grads = {
        f"{i}.{name}": (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for i, m in enumerate(models) for name, p in m.named_parameters()
    }
    return loss, tokens, grads


def whole_sample_shards(samples: Sequence[Sample], solo_group) -> list[RankShard]:
    """The reference's micro-batches: each sample whole, alone, at CP1 (`solo_group`: a group of
    this rank alone)."""
    from tests.support.attention_parity import shard

    return [shard(samples, [i], solo_group) for i in range(len(samples))]
