"""CPU smoke test of the GPU benchmark's plan execution (bench/gpu), 2 gloo processes.

What runs here is the benchmark's own code path: the planner's hybrid-CP plan from `plan_batch`
(real Megatron-Core), static CP2 and static CP1, executed rank by rank with a tiny decoder in fp32
and SDPA's math backend. What does not: PyTorch's ring attention (`context_parallel`) dispatches
only CUDA SDPA kernels, so CP2 groups use bench.gpu.cp_attention.AllGatherAttention here (same
zigzag sharding, K/V all-gathered over gloo); the ring path is checked on the GPU run against the
same single-device reference (docs/gpu-benchmark.md).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from bench.gpu.make_plans import batch_entry
from bench.gpu.plans import BenchPlan, plan_from_json
from tests.support.launch import init_gloo, run_ranks

pytestmark = pytest.mark.slow  # spawns two torch processes (about 10 s of imports each)

LENGTHS = [240, 40, 70, 24, 130, 10, 90, 60]  # 240 and 130 need CP2 at 128 tokens per rank
MAX_SEQLEN_PER_RANK = 128


def _worker(rank: int, plans: list[BenchPlan], out_dir: str) -> None:
    import torch.distributed as dist

    from bench.gpu.correctness import check_cp_attention
    from bench.gpu.execute import PlanExecutor, SampleInputs
    from bench.gpu.groups import build_cp_groups
    from bench.gpu.model import DecoderConfig, DecoderStack

    torch.set_num_threads(1)
    init_gloo(rank, 2, os.path.join(out_dir, "store"))
    device = torch.device("cpu")
    groups, _ = build_cp_groups(2, {2}, prefer_megatron=False)
    check = check_cp_attention(groups[(0, 2)], 64, 2, 16, torch.float32, device, seed=3, tolerance=1e-5)
    torch.manual_seed(0)
    model = DecoderStack(DecoderConfig(hidden_size=32, num_heads=2, num_layers=2))
    executor = PlanExecutor(model, SampleInputs(tuple(LENGTHS), 32, torch.float32, device, seed=0), groups, device)
    results = {}
    for plan in plans:
        step = executor.run_step(plan)
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        results[plan.name] = {
            "executed": [(r.index, r.cp_size, r.first_rank, r.sample_ids) for r in step.micro_batches],
            "grads": grads,
            "busy": [r.busy_seconds for r in step.micro_batches],
        }
    torch.save({"check": check, "results": results}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def smoke_run():
    batch = batch_entry("smoke", "fixed", 0, LENGTHS, 2, MAX_SEQLEN_PER_RANK)
    plans = [plan_from_json(p) for p in batch["plans"]]
    with tempfile.TemporaryDirectory() as out_dir:
        # Spawned, as the benchmark starts its ranks; a rank that fails fails the test with its traceback.
        run_ranks(_worker, (plans, out_dir), 2, deadline_seconds=240, start_method="spawn")
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    return plans, ranks


def test_the_planner_plan_mixes_cp_sizes(smoke_run):
    plans, _ = smoke_run
    hybrid = next(p for p in plans if p.name == "hybrid_cp")
    sizes = {g.size for mb in hybrid.micro_batches for g in mb.cp_groups}
    assert sizes == {1, 2}, f"expected CP1 and CP2 groups in the hybrid plan, got {sizes}"


def test_each_rank_runs_exactly_its_micro_batches_in_plan_order(smoke_run):
    plans, ranks = smoke_run
    for plan in plans:
        executed_samples = []
        for rank, data in enumerate(ranks):
            expected = [
                (i, g.size, g.first_rank, g.sample_ids)
                for i, g in enumerate(plan.rank_schedule(rank))
                if g is not None
            ]
            executed = [tuple(e[:3]) + (tuple(e[3]),) for e in data["results"][plan.name]["executed"]]
            assert executed == expected, f"{plan.name}, rank {rank}"
            assert all(t > 0 for t in data["results"][plan.name]["busy"])
            executed_samples += [s for _, size, first, ids in executed if first == rank for s in ids]
        assert sorted(executed_samples) == list(range(len(LENGTHS))), plan.name


def test_cp2_attention_shard_matches_the_single_process_reference(smoke_run):
    _, ranks = smoke_run
    for data in ranks:
        check = data["check"]
        assert check.passed, check
        assert check.output_rel_error < 1e-5 and check.grad_kv_rel_error < 1e-5


def test_every_plan_computes_the_same_gradient(smoke_run):
    # Same batch, same loss over real tokens: CP sharding, packing and padding must not change it.
    plans, ranks = smoke_run
    reference = ranks[0]["results"]["static_cp1"]["grads"]
    for plan in plans:
        for data in ranks:
            grads = data["results"][plan.name]["grads"]
            rel = ((grads - reference).norm() / reference.norm()).item()
            assert rel < 1e-4, f"{plan.name}: gradient differs from static CP1 by {rel:.2e}"
