"""The replay's CPU side (bench/gpu/replay, docs/gpu-replay.md) on a fake kernel clock: the ring's
arithmetic, the link model, a pass's time, the event simulation of a step, plans as passes, the
fitted clock, and the in-process stand-in for a CP group's peers. The GPU side (the kernels and the
fused-attention calls) is tests/trainer_client/transformer_engine/test_te_replay_fidelity.py."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from batch_planner.distributions import sample_lengths
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from bench.gpu.replay.clock import FakeKernelClock, FittedKernelClock, attention_features, ring_steps
from bench.gpu.replay.in_process_peers import CpGroupStandIn, InProcessCpPeersStandIn
from bench.gpu.replay.links import LinkSpec
from bench.gpu.replay.passes import GroupPass, plan_passes
from bench.gpu.replay.shapes import RankShape
from bench.gpu.replay.simulate import kv_bytes, pass_seconds, replay_step, ring_seconds, ring_transfers, simulate_step

FREE_LINKS = LinkSpec(intra_node_bytes_per_second=1e30, intra_node_latency_seconds=0.0, inter_node_bytes_per_second=1e30,
                      inter_node_latency_seconds=0.0, tp_bytes_per_second=1e30)
ODD = (3001, 517, 97)


# ---------------------------------------------------------------- the ring's arithmetic


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_of_a_zigzag_ring_does_the_same_attention_work(cp):
    padded = [p - p % (2 * cp) + 2 * cp for p in ODD]  # multiples of 2 x CP, as the plan pads
    work = []
    for rank in range(cp):
        steps = ring_steps(cp, rank, padded)
        assert len(steps) == cp
        assert all(causal for _, _, causal in steps[0]) and not any(causal for step in steps[1:] for _, _, causal in step)
        # steps 1..rank: all its queries against half of the peer's keys; the rest: half its queries against all
        for step in steps[1:rank + 1]:
            assert [(q, kv) for q, kv, _ in step] == [(p // cp, p // (2 * cp)) for p in padded]
        for step in steps[rank + 1:]:
            assert [(q, kv) for q, kv, _ in step] == [(p // (2 * cp), p // cp) for p in padded]
        pairs = sum(q * kv / (2 if causal else 1) for step in steps for q, kv, causal in step)
        work.append(pairs)
    assert max(work) == pytest.approx(min(work))
    assert work[0] == pytest.approx(sum(p * p for p in padded) / (2 * cp))  # the causal half of L^2, split c ways


def test_the_features_closed_form_sums_the_ring_steps_calls():
    from bench.gpu.replay.clock import _tiles

    rng = random.Random(1)
    for _ in range(300):
        cp = rng.choice([1, 2, 4, 8, 16, 64])
        rank = rng.randrange(cp)
        padded = [2 * cp * rng.randint(1, 300) if cp > 1 else rng.randint(1, 5000) for _ in range(rng.randint(1, 6))]
        steps = ring_steps(cp, rank, padded)
        summed = [1.0, 1.0 if cp > 1 else 0.0, float(len(steps)), float(sum(len(s) for s in steps)),
                  float(sum(q for s in steps for q, _, _ in s)), float(sum(_tiles(q, kv, causal) for s in steps for q, kv, causal in s))]
        assert attention_features(cp, rank, padded) == summed, (cp, rank, padded)


def test_cp1_is_one_causal_call_over_whole_sequences():
    assert ring_steps(1, 0, ODD) == [[(n, n, True) for n in ODD]]
    features = dict(zip(("passes", "cp_passes", "steps", "sequence_steps", "query_rows"), attention_features(1, 0, ODD)))
    assert features == {"passes": 1, "cp_passes": 0, "steps": 1, "sequence_steps": 3, "query_rows": sum(ODD)}


def test_ring_seconds_overlaps_each_transfer_with_its_step():
    assert ring_seconds(8.0, [0.0]) == 8.0  # no ring
    assert ring_seconds(8.0, [0.5, 0.5, 0.5, 0.0]) == pytest.approx(8.0)  # compute-bound: the transfers hide
    assert ring_seconds(8.0, [5.0, 5.0, 5.0, 0.0]) == pytest.approx(3 * 5.0 + 2.0)  # link-bound; the last forward step sends nothing


def test_the_ring_sends_kv_forward_and_kv_with_its_gradients_backward():
    assert ring_transfers(1) == ([0], [0])
    assert ring_transfers(2) == ([1, 0], [1, 1])
    assert ring_transfers(4) == ([1, 1, 1, 0], [1, 2, 2, 1])
    for cp in (2, 4, 8, 64):
        forward, backward = ring_transfers(cp)
        assert len(forward) == len(backward) == cp and sum(forward) == cp - 1 and sum(backward) == 2 * (cp - 1)


# ---------------------------------------------------------------- links


def test_links_price_bytes_over_bandwidth_plus_latency_by_placement():
    links = LinkSpec(gpus_per_node=8, intra_node_bytes_per_second=100.0, intra_node_latency_seconds=1.0,
                     inter_node_bytes_per_second=10.0, inter_node_latency_seconds=2.0, tp_bytes_per_second=50.0)
    assert links.transfer_seconds(200, crosses_node=False) == 3.0
    assert links.transfer_seconds(200, crosses_node=True) == 22.0
    assert links.transfer_seconds(0, crosses_node=True) == 0.0
    assert not links.ring_crosses_node(range(0, 4), 1) and links.ring_crosses_node(range(6, 10), 1)
    assert links.ring_crosses_node(range(0, 2), 8)  # TP8: every DPxCP rank is a node of its own
    assert not links.ring_crosses_node(range(2, 4), 4)  # TP4: ranks 2 and 3 share GPUs 8..15
    assert links.ring_step_seconds(200, range(6, 10), 1) == 22.0 and links.ring_step_seconds(200, range(3, 4), 1) == 0.0
    assert links.tp_collective_seconds(800, 8) == pytest.approx(7 / 8 * 800 / 50 + 1.0)
    assert links.tp_collective_seconds(800, 1) == 0.0
    with pytest.raises(ValueError, match="spans nodes"):
        links.tp_collective_seconds(800, 16)
    assert "assumed, not measured" in links.describe()


# ---------------------------------------------------------------- a pass


def test_a_pass_is_its_layers_rings_and_collectives_on_the_slowest_member():
    shape = RankShape.of("llama3-70b")  # TP8: 8 heads and one KV head per rank, inter-node CP ring
    clock = FakeKernelClock()
    links = LinkSpec()
    group_pass = GroupPass(first_rank=4, cp_size=4, real=(16000, 3000), padded=(16000, 3008))
    tokens = group_pass.local_tokens
    got = pass_seconds(clock, shape, links, group_pass)
    attention = [clock.attention(4, r, group_pass.real, group_pass.padded) for r in range(4)]
    unit = kv_bytes(shape, tokens)
    assert unit == tokens * 2 * 1 * 128 * 2  # K and V of one KV head of 128, bf16
    one, two = links.transfer_seconds(unit, crosses_node=True), links.transfer_seconds(2 * unit, crosses_node=True)
    ring_forward = ring_seconds(max(a.forward for a in attention), [one, one, one, 0.0])
    ring_backward = ring_seconds(max(a.backward for a in attention), [one, two, two, one])
    tp = 8 * links.tp_collective_seconds(tokens * 8192 * 2, 8)
    want = 80 * (clock.rest(tokens).total + ring_forward + ring_backward + tp) + clock.head(tokens).total
    assert got.seconds == pytest.approx(want)
    free = pass_seconds(clock, shape, FREE_LINKS, group_pass)
    assert free.seconds == pytest.approx(free.compute) and free.ring_exposed == pytest.approx(0.0, abs=1e-12)
    assert got.compute == pytest.approx(free.compute) and got.seconds > got.compute


def test_slower_links_never_make_a_pass_faster():
    shape, clock = RankShape.of("llama3-8b"), FakeKernelClock()
    rng = random.Random(3)
    for _ in range(50):
        cp = rng.choice([1, 2, 4, 8])
        real = tuple(rng.randint(1, 9000) for _ in range(rng.randint(1, 4)))
        padded = tuple(-(-n // (2 * cp)) * (2 * cp) if cp > 1 else n for n in real)
        group_pass = GroupPass(rng.randrange(0, 16), cp, real, padded)
        fast = pass_seconds(clock, shape, LinkSpec(), group_pass).seconds
        slow = pass_seconds(clock, shape, dataclasses.replace(LinkSpec(), inter_node_bytes_per_second=1e9,
                                                              intra_node_bytes_per_second=1e9), group_pass).seconds
        assert slow >= fast


# ---------------------------------------------------------------- the step


def test_the_event_simulation_starts_a_group_when_all_its_members_are_free():
    # micro-batch 0: ranks 0-1 busy 5, ranks 2-3 busy 1; micro-batch 1: ranks 1-2 together (2), rank 3 alone (4).
    step = simulate_step([[(range(0, 2), 5.0), (range(2, 4), 1.0)], [(range(1, 3), 2.0), (range(3, 4), 4.0)]], ranks=4)
    assert step.event_seconds == 7.0  # ranks 1-2 wait for rank 1 (free at 5), end at 7; rank 3 ends at 5
    assert step.barrier_seconds == 5.0 + 4.0
    assert step.busy_seconds == 5 * 2 + 1 * 2 + 2 * 2 + 4
    assert step.utilization == pytest.approx(20 / 28)


def test_when_every_micro_batch_covers_every_rank_the_event_step_is_within_the_barrier_and_above_each_ranks_work():
    rng = random.Random(5)
    for _ in range(200):
        micro_batches = []
        for _ in range(rng.randint(1, 4)):
            edges = sorted(rng.sample(range(1, 8), rng.randint(0, 3)))
            bounds = [0, *edges, 8]
            micro_batches.append([(range(a, b), rng.uniform(0.1, 5.0)) for a, b in zip(bounds, bounds[1:])])
        step = simulate_step(micro_batches, 8)
        assert step.event_seconds <= step.barrier_seconds + 1e-12
        assert step.event_seconds >= max(sum(s for members, s in mb if r in members) for mb in micro_batches for r in range(8)) - 1e-12


# ---------------------------------------------------------------- plans as passes


@pytest.mark.parametrize("scheduler", [SchedulerKind.DYNAMIC_CP, SchedulerKind.HYBRID_CP, SchedulerKind.STATIC_PACKING])
def test_a_plan_replays_every_sample_once_padded_by_its_rule(scheduler):
    from batch_planner.schedulers import discover_schedulers

    found = discover_schedulers()[scheduler]
    if not found.available:
        pytest.skip(f"{scheduler.value}: {found.reason}")
    lengths = [n | 1 for n in sample_lengths("rl_rollout_16k", 96, 1)]  # odd: every group pads
    cp = 1 if scheduler is not SchedulerKind.STATIC_PACKING else 4
    plan = plan_batch(PlanRequest.of(lengths, 16 // cp, cp, 8192, scheduler=scheduler))
    passes = plan_passes(plan, lengths)
    seen = sorted(n for mb in passes for work in mb for p in work.passes for n in p.real)
    assert seen == sorted(lengths)
    for mb, micro_batch in zip(passes, plan.micro_batches):
        for work, group in zip(mb, [g for g in micro_batch.cp_groups if g.sample_ids]):
            assert work.ranks == group.ranks
            assert sum(sum(p.padded) for p in work.passes) == group.padded_tokens
            assert len(work.passes) == (1 if scheduler is not SchedulerKind.HYBRID_CP else len(group.sample_ids))
            for p in work.passes:
                assert all(q >= n and (q % (2 * p.cp_size) == 0 if p.cp_size > 1 else True) for n, q in zip(p.real, p.padded))
    step = replay_step(FakeKernelClock(), RankShape.of("llama3-8b"), LinkSpec(), passes, 16)
    assert 0 < step.event_seconds <= step.barrier_seconds + 1e-9


# ---------------------------------------------------------------- the fitted clock


def _measurements(clock: FakeKernelClock, noise: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    grid = [256, 1024, 4096, 16384]
    entry = {"rest": {}, "head": {}, "attention": [], "layer_check": []}
    for t in grid:
        entry["rest"][str(t)] = dataclasses.asdict(clock.rest(t))
        entry["head"][str(t)] = dataclasses.asdict(clock.head(t))
    for role, count in (("fit", 200), ("check", 50)):
        for index in range(count):
            cp = rng.choice([1, 2, 4, 8, 16])
            padded = [2 * cp * rng.randint(1, 4096 // cp) for _ in range(rng.randint(1, 5))]
            rank = rng.randrange(cp)
            t = clock.attention(cp, rank, padded, padded)
            entry["attention"].append({"role": role, "index": index, "cp_size": cp, "cp_rank": rank, "real": padded, "padded": padded,
                                       "forward": t.forward * (1 + rng.uniform(-noise, noise)),
                                       "backward": t.backward * (1 + rng.uniform(-noise, noise))})
    return entry


def test_the_fitted_clock_recovers_a_clock_it_can_express_and_interpolates_its_grid():
    fake = FakeKernelClock()
    fitted = FittedKernelClock(_measurements(fake, noise=0.0))
    for cp, rank, padded in [(1, 0, [777, 1201]), (4, 3, [4096, 808]), (16, 5, [32768])]:
        assert fitted.attention(cp, rank, padded, padded).total == pytest.approx(fake.attention(cp, rank, padded, padded).total, rel=1e-6)
    assert fitted.rest(1024).forward == pytest.approx(fake.rest(1024).forward)
    assert fitted.rest(2500).total == pytest.approx(fake.rest(2500).total)  # linear between grid points
    assert fitted.head(20000).total == pytest.approx(fake.head(20000).total)  # the last segment's line beyond the grid
    errors = fitted.check()["attention_check_passes"]
    assert len(errors) == 50 and max(abs(e) for e in errors) < 1e-6


def test_the_check_reports_the_noise_it_was_fitted_through():
    check = FittedKernelClock(_measurements(FakeKernelClock(), noise=0.04)).check()["attention_check_passes"]
    assert 0.001 < max(abs(e) for e in check) < 0.08


# ---------------------------------------------------------------- the in-process peers


def test_the_standin_answers_for_its_groups_and_records_what_the_ring_sends():
    group = CpGroupStandIn(4, 2)
    import torch.distributed as dist

    with InProcessCpPeersStandIn() as peers:
        assert dist.get_world_size(group) == 4 and dist.get_rank(group) == 2 and group.size() == 4 and group.rank() == 2
        assert dist.get_process_group_ranks(group) == [0, 1, 2, 3]
        kv = torch.ones(2, 10, 3, dtype=torch.bfloat16)
        buffer = torch.full_like(kv, 7.0)
        peers.phase = "forward"
        ops = [dist.P2POp(dist.isend, kv, 3, group), dist.P2POp(dist.irecv, buffer, 1, group)]
        assert all(work.wait() for work in dist.batch_isend_irecv(ops))
        peers.phase = "backward"
        dist.irecv(buffer, 1, group).wait()
        assert [(m.phase, m.op, m.peer, m.bytes) for m in peers.take()] == [
            ("forward", "send", 3, 120), ("forward", "recv", 1, 120), ("backward", "recv", 1, 120)]
        assert torch.equal(buffer, torch.full_like(kv, 7.0))  # a receive leaves its buffer as it was
        assert peers.take() == []
    assert dist.get_world_size is not peers._get_world_size  # restored
    with pytest.raises(ValueError, match="not in a group"):
        CpGroupStandIn(2, 2)


def test_the_standins_group_is_a_process_group_as_transformer_engine_requires():
    """Transformer Engine's DotProductAttention counts a CP group's ranks only for a
    torch.distributed.ProcessGroup (`isinstance(cp_group, dist_group_type)`) and runs anything else
    as CP 1: a plain object as the group read past the rank's rows on the GPU."""
    import torch.distributed as dist

    group = CpGroupStandIn(16, 4)
    assert isinstance(group, dist.ProcessGroup) and (group.size(), group.rank()) == (16, 4)
    assert CpGroupStandIn(16, 4) is not group and repr(group) == "CpGroupStandIn(size=16, rank=4)"


def test_a_planted_standin_that_reports_rank_zero_drops_the_half_kv_steps():
    padded = [4096, 1024]
    honest = ring_steps(4, 3, padded)
    planted = ring_steps(4, 0, padded)  # what Transformer Engine computes when told rank 0
    assert any(kv == p // 8 for step in honest[1:] for (_, kv, _), p in zip(step, padded))
    assert not any(kv == p // 8 for step in planted[1:] for (_, kv, _), p in zip(step, padded))
    assert math.isclose(sum(q * kv for s in honest[1:] for q, kv, _ in s), sum(q * kv for s in planted[1:] for q, kv, _ in s))


# ---------------------------------------------------------------- the report, end to end on a fake clock


def test_the_report_replays_every_scheduler_fits_the_cost_model_and_writes_its_rows(tmp_path):
    import json

    from bench.gpu.replay import report

    measurements = tmp_path / "kernels.json"
    clock = FakeKernelClock(per_token=3e-6, per_tile=3e-6, per_step=2e-5)
    measurements.write_text(json.dumps({"llama3-8b-tp1": _measurements(clock, noise=0.02)}))
    out = tmp_path / "replay"
    assert report.main(["--measurements", str(measurements), "--out", str(out), "--ranks", "32"]) == 0
    rows = json.loads((out / "summary.json").read_text())
    keys = {"model", "distribution", "ranks", "scheduler", "replayed_ms", "predicted_ms_default", "predicted_ms_fitted", "best_static_ms"}
    assert rows and all(keys <= set(r) for r in rows)
    assert {r["distribution"] for r in rows} == set(report.DISTRIBUTIONS) and {r["ranks"] for r in rows} == {32}
    for distribution in report.DISTRIBUTIONS:
        here = {r["scheduler"]: r for r in rows if r["distribution"] == distribution}
        assert {"dynamic_cp", "hybrid_cp", "auto"} <= set(here) and any(s.startswith("static_cp") for s in here)
        statics = [r["replayed_ms"] for s, r in here.items() if s.startswith("static_cp")]
        assert all(r["best_static_ms"] == min(statics) for r in here.values())
        auto = here["auto"]
        assert auto["regret"] >= 0 and auto["is_fastest"] == (auto["regret"] == 0)
    fitted = json.loads((out / "fitted.json").read_text())["llama3-8b-h100"]
    assert fitted["tensor_parallel_size"] == 1 and fitted["seconds_per_token"] > 0
    assert "assumed, not measured" in (out / "tables.md").read_text()
