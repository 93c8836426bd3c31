"""examples/megatron_lm_pretrain_gpt.py against Megatron-LM's real `megatron.training.training`: it
runs the training script with the drop-in's wrappers in place of Megatron-LM's (through the drop-in's
`enabled()`, not a raw setattr), hands the script its own flags, and puts Megatron-LM's own back when
the script ends; `--check` says what it would replace and replaces nothing for good."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def example():
    spec = importlib.util.spec_from_file_location("megatron_lm_pretrain_gpt", ROOT / "examples" / "megatron_lm_pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def upstream():
    import megatron.training.training as training

    return training, training.wrap_data_iterator


def test_the_script_runs_with_the_drop_in_in_place_and_megatron_lms_own_comes_back(example, upstream, tmp_path, monkeypatch):
    from trainer_client.megatron_lm import wrap_data_iterator

    training, own = upstream
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(
        "import sys\nimport megatron.training.training as training\n"
        "SEEN.update(wrap=training.wrap_data_iterator, argv=list(sys.argv))\n"
    )
    seen: dict = {}
    monkeypatch.setattr(sys, "argv", ["megatron_lm_pretrain_gpt.py", str(script), "--sequence-packing-scheduler", "default_dynamic_cp"])
    monkeypatch.setattr(example.runpy, "run_path", lambda path, run_name: exec(Path(path).read_text(), {"SEEN": seen, "__name__": run_name}))
    example.main()
    assert seen["wrap"] is wrap_data_iterator, seen
    assert seen["argv"] == [str(script), "--sequence-packing-scheduler", "default_dynamic_cp"]
    assert training.wrap_data_iterator is own


def test_check_says_what_it_replaces_and_puts_it_back(example, upstream, monkeypatch, capsys):
    training, own = upstream
    monkeypatch.setattr(sys, "argv", ["megatron_lm_pretrain_gpt.py", "--check"])
    example.main()
    assert "swapped in megatron.training.training: wrap_data_iterator" in capsys.readouterr().out
    assert training.wrap_data_iterator is own
