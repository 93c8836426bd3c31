"""A small CPU training loop that gets every step's plan from the batch planner, one step ahead.

    python -m planner_server --port 50051 &
    python examples/train_loop.py --planner-endpoint 127.0.0.1:50051 --steps 10 --metrics-port 9500
    python examples/train_loop.py --planner-endpoint 127.0.0.1:50051 --nproc 4      # 4 gloo ranks
    torchrun --nproc-per-node 4 examples/train_loop.py --planner-endpoint 127.0.0.1:50051

The model is a toy (embedding + linear, next-token loss) with no attention, so a CP shard can be
computed on its own; a real Megatron model takes `mb.packed_seq_params` (it carries the CP group)
and does the rest. With one process the loop plays every rank of a `--simulated-ranks` DPxCP group
in turn. Every rank holds the same global batch (the client's input contract).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_planner.distributions import sample_lengths  # noqa: E402
from trainer_client import BatchPlannerClient, PlannerClientConfig  # noqa: E402
from trainer_client.plans.apply import micro_batches_for_rank  # noqa: E402
from trainer_client.plans.batch import unbind_batch  # noqa: E402

VOCAB = 512


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--planner-endpoint", default="127.0.0.1:50051", help="host:port or dns:///name:port; '' plans in-process")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="samples per global batch")
    p.add_argument("--distribution", default="long_tail_16k", help="sequence length distribution")
    p.add_argument("--max-seqlen-per-rank", type=int, default=8192)
    p.add_argument("--metrics-port", type=int, default=-1, help="serve /metrics here (rank r: port + r; 0 = any; -1 = off)")
    p.add_argument("--nproc", type=int, default=1, help="spawn this many gloo ranks")
    p.add_argument("--simulated-ranks", type=int, default=2, help="DPxCP ranks one process plays in turn")
    p.add_argument("--min-step-seconds", type=float, default=0.0, help="make each step at least this long")
    p.add_argument("--calibration-min-observations", type=int, default=16, help="distinct timed units before the fit is used")
    p.add_argument("--linger-seconds", type=float, default=0.0, help="keep serving metrics this long after the last step")
    return p.parse_args(argv)


def forward_backward(model, mb) -> torch.Tensor:
    """Next-token loss on real tokens whose successor is in this shard; normalised by the global
    batch's real tokens, so the sum over ranks is the whole batch's mean loss. Returns this shard's
    share of each sample's loss (the unit's samples, in order)."""
    logits = model(mb.input_ids)
    target_ok = mb.padding_mask[1:] & mb.padding_mask[:-1] & (mb.position_ids[1:] == mb.position_ids[:-1] + 1)
    losses = torch.nn.functional.cross_entropy(logits[:-1], mb.input_ids[1:], reduction="none")
    per_token = torch.cat([losses * target_ok, losses.new_zeros(1)]) / mb.global_real_tokens
    per_token.sum().backward()
    return torch.stack([part.sum() for part in per_token.detach().split(mb.shard_token_counts)])


def synthetic_batch(step: int, args) -> TensorDict:
    """The same global batch on every rank: seeded by the step."""
    lengths = sample_lengths(args.distribution, args.batch_size, seed=step)
    generator = torch.Generator().manual_seed(step)
    tokens = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    return TensorDict({"input_ids": torch.nested.nested_tensor(tokens, layout=torch.jagged)}, batch_size=[len(lengths)])


def lengths_of(batch: TensorDict) -> list[int]:
    return batch["input_ids"].offsets().diff().tolist()


def train(args) -> None:
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    config = PlannerClientConfig(
        planner_endpoint=args.planner_endpoint, tls=False, max_seqlen_per_dp_cp_rank=args.max_seqlen_per_rank,
        job="example", deadline_seconds=2.0,
        # Closed-loop calibration: fit the cost model to the timed units every 2 steps.
        calibration_update_interval_steps=2, calibration_min_observations=args.calibration_min_observations,
    )
    if distributed:
        client = BatchPlannerClient(config)  # the DPxCP group and CP groups come from parallel_state
        my_ranks = [client.rank]
    else:
        client = BatchPlannerClient(config, dp_cp_size=args.simulated_ranks, rank=0)
        my_ranks = list(range(args.simulated_ranks))
    if args.metrics_port >= 0:
        port = client.serve_metrics(args.metrics_port + rank if args.metrics_port else 0)
        print(f"rank {rank}: METRICS on port {port}", flush=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, VOCAB))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = {0: synthetic_batch(0, args)}
    client.prefetch(0, lengths_of(batches[0]))
    for step in range(args.steps):
        started = time.perf_counter()
        batch = batches.pop(step)
        plan = client.plan_step(step, lengths_of(batch))
        if step + 1 < args.steps:  # plan the next step while this one trains
            batches[step + 1] = synthetic_batch(step + 1, args)
            client.prefetch(step + 1, lengths_of(batches[step + 1]))

        global_batch = unbind_batch(batch)
        units, outputs, local_loss = [], {}, 0.0
        optimizer.zero_grad()
        for as_rank in my_ranks:
            for mb in (client.micro_batches(plan, global_batch) if distributed
                       else micro_batches_for_rank(plan, global_batch, as_rank)):
                units.append(mb)
                with client.timed(mb):  # what this unit's forward+backward really cost
                    sample_loss = forward_backward(model, mb)
                local_loss += float(sample_loss.sum())
                if mb.cp_group is not None:  # each sample's loss over its whole CP group
                    dist.all_reduce(sample_loss, group=mb.cp_group)
                if mb.is_cp_leader:  # one sample per unit under hybrid CP, several when packed
                    outputs.update(zip(mb.sample_ids, sample_loss))
        if distributed:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        per_sample_loss = client.restore_outputs(plan, outputs)  # in sample order, each exactly once
        assert len(per_sample_loss) == len(lengths_of(batch))
        elapsed = time.perf_counter() - started
        if elapsed < args.min_step_seconds:
            time.sleep(args.min_step_seconds - elapsed)
            elapsed = args.min_step_seconds
        client.record_step(units, elapsed)
        report = client.end_step()  # every 2 steps: gather the timed units and refit (a collective)
        real = sum(mb.real_local_tokens for mb in units)
        padding = sum(mb.padding_local_tokens for mb in units)
        if rank == 0:
            print(
                f"step {step}: plan from {client.last_source}, {len(plan.micro_batches)} micro-batches, "
                f"{real} tokens in this process ({100 * padding / max(1, real + padding):.2f}% padding), "
                f"{real / elapsed:,.0f} tokens/s, loss share {local_loss:.4f}",
                flush=True,
            )
            if report is not None and report.steps:
                s = report.steps[-1]
                calibrated = client.calibration.model_for(s.step) != client.calibration.prior
                print(
                    f"step {s.step}: predicted {s.predicted_seconds * 1e3:.2f} ms, measured {s.measured_seconds * 1e3:.2f} ms "
                    f"({100 * s.relative_error:.1f}% off) under the {'calibrated' if calibrated else 'preset'} cost model; "
                    f"fit: {report.fit.result if report.fit else '-'}",
                    flush=True,
                )
    client.close()
    if args.linger_seconds > 0:
        time.sleep(args.linger_seconds)


def init_distributed() -> None:
    dist.init_process_group("gloo")
    if dist.get_world_size() >= 2:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(hybrid_context_parallel=True)


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    init_distributed()
    train(args)
    dist.destroy_process_group()


def main(argv=None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        init_distributed()
        train(args)
        dist.destroy_process_group()
    elif args.nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(args.nproc, port, args), nprocs=args.nproc)
    else:
        train(args)


if __name__ == "__main__":
    main()
