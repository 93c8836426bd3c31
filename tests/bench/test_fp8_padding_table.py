"""docs/cost-model.md's FP8 padding table ("Padding for FP8") is what `python -m bench.fp8_padding`
prints today: the numbers in the docs can be reproduced."""

from __future__ import annotations

import re
from pathlib import Path

from batch_planner.request import SchedulerKind
from tests.support.megatron_builds import require_scheduler

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cost-model.md"
BLOCK = re.compile(r"<!-- fp8 padding table \(generated: python -m bench.fp8_padding\) -->\n(.*?)\n<!-- end fp8 padding table -->", re.S)


def test_the_docs_fp8_padding_table_is_the_scripts_output():
    require_scheduler(SchedulerKind.DYNAMIC_CP)  # the table's dynamic-CP columns need the dev build
    from bench.fp8_padding import table

    found = BLOCK.search(PAGE.read_text())
    assert found, "docs/cost-model.md has no generated FP8 padding table"
    assert found.group(1) == table(), "the table drifted: paste `python -m bench.fp8_padding` into docs/cost-model.md"
