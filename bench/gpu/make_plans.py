"""Plans the GPU benchmark runs, computed on the CPU with the real planner core (Megatron-Core).

    python -m bench.gpu.make_plans --out plans.json

Writes, for each (distribution, seed): the batch's lengths and three plans of the same batch:
the planner's hybrid-CP plan (`plan_batch`), static CP2 and static CP1 (bench/gpu/plans.py).
Dynamic CP is added only when the installed Megatron-Core has its scheduler.
"""

from __future__ import annotations

import argparse

from batch_planner.distributions import sample_lengths
from batch_planner.request import SchedulerKind
from batch_planner.schedulers import discover_schedulers
from bench.gpu.plans import hybrid_cp_plan, plan_to_json, save_plans, static_cp_plan

def build_batches(
    distributions: dict[str, int], seeds: list[int], samples: int, dp_cp_size: int
) -> list[dict]:
    """distributions: name -> max_seqlen_per_dp_cp_rank for its batches."""
    batches = []
    dynamic = discover_schedulers()[SchedulerKind.DYNAMIC_CP]
    for distribution, max_seqlen in distributions.items():
        for seed in seeds:
            lengths = sample_lengths(distribution, samples, seed)
            batches.append(batch_entry(f"{distribution}/seed{seed}", distribution, seed, lengths, dp_cp_size, max_seqlen, dynamic))
    return batches


def batch_entry(
    name: str, distribution: str, seed: int, lengths: list[int], dp_cp_size: int, max_seqlen: int, dynamic=None
) -> dict:
    """One batch and its three plans, JSON-ready."""
    dynamic = dynamic or discover_schedulers()[SchedulerKind.DYNAMIC_CP]
    plans = [
        hybrid_cp_plan(lengths, dp_cp_size, max_seqlen),
        static_cp_plan(lengths, dp_cp_size, dp_cp_size, max_seqlen),
        static_cp_plan(lengths, dp_cp_size, 1, max_seqlen),
    ]
    return {
        "name": name,
        "distribution": distribution,
        "seed": seed,
        "lengths": list(lengths),
        "max_seqlen_per_dp_cp_rank": max_seqlen,
        "dynamic_cp": "run" if dynamic.available else f"not run: {dynamic.reason}",
        "plans": [plan_to_json(p) for p in plans],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--distributions", default="lognormal_32k:16384,long_tail_16k:8192",
        help="name:max_seqlen_per_dp_cp_rank, comma-separated (samples longer than that need CP)",
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--dp-cp-size", type=int, default=2)
    args = parser.parse_args(argv)
    distributions = {name: int(limit) for name, limit in (d.split(":") for d in args.distributions.split(","))}
    batches = build_batches(distributions, [int(s) for s in args.seeds.split(",")], args.samples, args.dp_cp_size)
    save_plans(args.out, batches)
    for batch in batches:
        print(batch["name"], sum(batch["lengths"]), "tokens;", "dynamic CP:", batch["dynamic_cp"])


if __name__ == "__main__":
    main()
