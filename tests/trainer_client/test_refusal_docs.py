"""The refusal tables of docs/ are generated from what the drop-ins register (trainer_client/refusals/refusal_docs.py):
every marked table equals the generated one, and the check itself fails on a table that drifted."""

from __future__ import annotations

import shutil
from pathlib import Path

from trainer_client.refusals import refusal_docs

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_generated_table_in_the_docs_is_the_registered_table():
    assert refusal_docs.drifted(DOCS) == [], "a refusal table drifted: run python -m trainer_client.refusals.refusal_docs"


def test_the_docs_hold_the_whole_table_and_bridges_own():
    pages = {page.name: page.read_text() for page in DOCS.glob("*.md")}
    whole = refusal_docs.whole_table(["trainer_client.megatron_lm", "trainer_client.megatron_bridge", "trainer_client.verl"])
    assert whole in pages["trainer-client.md"]
    assert refusal_docs.own_table("trainer_client.megatron_bridge") in pages["megatron-bridge.md"]
    # Every drop-in's rows are in the whole table, each naming where it applies.
    assert "| megatron_lm `sequence_packing_scheduler` |" in whole and "in verl's drop-in |" in whole
    assert "| engine `use_megatron_fsdp`; bridge `ddp.use_megatron_fsdp`; bridge `dist.use_megatron_fsdp` |" in whole


def test_the_check_fails_on_a_drifted_table_and_the_writer_mends_it(tmp_path, capsys):
    page = tmp_path / "trainer-client.md"
    shutil.copy(DOCS / "trainer-client.md", page)
    page.write_text(page.read_text().replace("| engine `use_remove_padding` | false |", "| engine `use_remove_padding` | true |"))
    assert refusal_docs.main(["--check", "--docs", str(tmp_path)]) == 1
    assert "trainer-client.md: its refusal table drifted" in capsys.readouterr().err
    assert refusal_docs.main(["--docs", str(tmp_path)]) == 0
    assert page.read_text() == (DOCS / "trainer-client.md").read_text()
    assert refusal_docs.main(["--check", "--docs", str(tmp_path)]) == 0
