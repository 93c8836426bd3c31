"""Trainer-side cost: applying a plan to a 1,024-sample batch on one rank, restoring outputs,
and memory.

    python -m bench.trainer_cost --out docs/bench

Needs trainer_client's apply/restore API. Until it is on main this benchmark writes a table that
says the figure was not measured, and why.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import argument_parser, markdown_table, write_report

NOT_MEASURED = (
    "not measured: trainer_client's apply/restore API was not on main when these benchmarks ran"
)


def run(out: Path, smoke: bool = False) -> Path:
    suffix = "_smoke" if smoke else ""
    table = markdown_table(
        ["batch", "what", "bar", "verdict"],
        [["1,024 samples, one rank", "apply a plan", "<= 5 ms", NOT_MEASURED],
         ["1,024 samples, one rank", "restore output order", "-", NOT_MEASURED],
         ["1,024 samples, one rank", "memory", "-", NOT_MEASURED]],
    )
    return write_report(
        out, f"trainer_cost{suffix}", "Trainer-side cost of applying a plan",
        (__doc__ or "").split("\n\n", 2)[2].strip(),
        [("Results", table)],
    )


def main(argv: list[str] | None = None) -> None:
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    print(run(args.out, args.smoke).read_text())


if __name__ == "__main__":
    main()
