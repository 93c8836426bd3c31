"""Token-normalized loss without touching the loss: four real gloo processes with
Megatron-Core's parallel_state apply several dynamic-CP plans (CP sizes 1, 2 and 4 in one plan,
planned in-process); a plain per-token loss, normalized by each micro-batch's `global_real_tokens`,
summed over all ranks and micro-batches (and its gradient, all-reduced as Megatron does over DPxCP)
equals the single-process reference. Per-token outputs and a scalar per-sample field travel too."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from batch_planner.request import SchedulerKind
from tests.support.megatron_builds import require_scheduler
from tests.support.megatron_init import initialize_dpxcp_groups
from tests.support.launch import init_gloo, run_ranks
from tests.support.batches import token_batch

WORLD = 4
JOIN_DEADLINE_SECONDS = 120
# (lengths, layout, tp, pack the samples of a CP group into one unit as the packing schedulers do)
PLANS = [
    ((3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1), "zigzag", 1, False),
    ((3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1), "contiguous", 2, True),
    ((3900, 17, 2048, 1025, 5, 700, 700, 700, 2, 1500, 950, 3), "zigzag", 2, True),
    ((4000, 3999, 100, 1800, 1790, 64, 63, 62, 1000, 999), "contiguous", 1, False),
]


def _batch(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return token_batch(
        lengths, first=1,
        x=torch.nested.nested_tensor([torch.randn(n, generator=g, dtype=torch.float64) for n in lengths], layout=torch.jagged),
        temperature=0.5 + torch.rand(len(lengths), generator=g, dtype=torch.float64),
    )


def _reference(batch, w):
    """Single process, no CP: sum over real tokens of (x * w / temperature)^2 / real tokens."""
    xs = list(batch["x"].unbind())
    total = sum(int(x.numel()) for x in xs)
    return sum((((x * w) / t) ** 2).sum() for x, t in zip(xs, batch["temperature"])) / total


def _run_rank(rank: int, store_path: str, out_dir: str, schedulers: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # forked: never enter the parent's OpenMP pool
    from megatron.core import parallel_state

    from trainer_client import BatchPlannerClient, PlannerClientConfig, token_pieces

    init_gloo(rank, WORLD, store_path)
    initialize_dpxcp_groups(context_parallel_size=2)
    results = []
    try:
        for step, (scheduler, (lengths, layout, tp, packed)) in enumerate((s, p) for s in schedulers for p in PLANS):
            config = PlannerClientConfig(
                max_seqlen_per_dp_cp_rank=1024, scheduler=scheduler, cp_layout=layout, tensor_parallel_size=tp,
                context_parallel_size=2,  # planner_endpoint empty: planned in-process, no server needed
            )
            client = BatchPlannerClient(config, engine_config={"use_remove_padding": True})
            plan = client.plan_step(step, lengths)
            batch = _batch(lengths, seed=step)
            # packed: the packing schedulers' execution, all samples of a CP group in one pass.
            units = client.micro_batches(plan, batch, pack_group_samples=packed or None)
            w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
            loss = torch.zeros((), dtype=torch.float64)
            tokens = torch.zeros((), dtype=torch.long)
            pieces = []
            group_ops = 0
            for mb in units:
                if mb.local_cp_size > 1:  # the CP group is Megatron-Core's, and usable
                    check = torch.ones(1)
                    dist.all_reduce(check, group=mb.cp_group)
                    group_ops += int(check.item() == mb.local_cp_size)
                # The loss function is plain: it only sees this rank's shard, its mask and the
                # micro-batch's global real-token count; no CP-specific code.
                temperature = mb.per_token(mb.sample_fields["temperature"])
                per_token = ((mb.token_fields["x"] * w) / temperature) ** 2
                loss = loss + (per_token * mb.padding_mask).sum() / mb.global_real_tokens
                tokens += mb.real_local_tokens
                pieces += token_pieces(mb, (mb.token_fields["x"] * w).detach())
            loss.backward()
            grad = w.grad.clone()
            summed = torch.stack([loss.detach(), grad])
            dist.all_reduce(summed)  # Megatron all-reduces gradients over DPxCP
            dist.all_reduce(tokens)
            reference_w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
            reference = _reference(batch, reference_w)
            reference.backward()
            restored = client.restore_token_outputs(pieces, lengths)
            outputs_ok = all(torch.equal(out, x * 0.7) for out, x in zip(restored, batch["x"].unbind()))
            results.append(
                dict(
                    scheduler=scheduler, layout=layout, tp=tp, packed=packed,
                    cp_sizes=sorted(set(plan.sample_cp_sizes().values())),
                    loss=float(summed[0]), reference=float(reference.detach()),
                    grad=float(summed[1]), reference_grad=float(reference_w.grad),
                    tokens=int(tokens), global_tokens=sum(lengths),
                    outputs_ok=outputs_ok,
                    group_ops=group_ops,
                )
            )
            client.close()
        if rank == 0:
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump(results, f)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("scheduler", [SchedulerKind.HYBRID_CP, SchedulerKind.DYNAMIC_CP])
def test_per_token_loss_over_dynamic_cp_plans_equals_the_single_process_reference(tmp_path, scheduler):
    require_scheduler(scheduler)
    # Forked on CPU (the ranks inherit the imported Megatron-Core; 4 concurrent imports take ~50 s
    # of a small CI machine), with a deadline against a stuck child: tests/support/launch.py's run_ranks.
    run_ranks(_run_rank, (str(tmp_path / "store"), str(tmp_path), [scheduler.value]), WORLD, JOIN_DEADLINE_SECONDS)
    results = json.loads((tmp_path / "result.json").read_text())
    assert len(results) == len(PLANS)
    for r in results:
        assert len(r["cp_sizes"]) > 1, r  # CP size varies per sample: a dynamic plan
        assert r["tokens"] == r["global_tokens"], r  # each real token on exactly one rank
        assert r["loss"] == pytest.approx(r["reference"], rel=1e-12), r
        assert r["grad"] == pytest.approx(r["reference_grad"], rel=1e-12), r
        assert r["outputs_ok"], r
    assert {1, 2, 4} <= {c for r in results for c in r["cp_sizes"]}
    assert sum(r["group_ops"] for r in results) > 0
