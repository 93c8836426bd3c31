"""The seam's settings (trainer_client/dropin/settings.py): the user's planner settings from `planner=`
or the file `$BATCH_PLANNER_CONFIG` names, merged with what the trainer runs (`derived`), into the
client's PlannerClientConfig. A key set in both must agree; a file without its section, or with a
section that is not a mapping, is refused naming the file."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from batch_planner.request import CpLayout, SchedulerKind
from trainer_client.service.config import PlannerClientConfig
from trainer_client.dropin import CONFIG_ENV, NOT_FIXED, DerivedSettings, given_planner_settings, merged_settings, planner_config
from trainer_client.errors import ArgumentTypeError, ConfigError

DERIVED = DerivedSettings(max_seqlen_per_dp_cp_rank=4096, context_parallel_size=2, tensor_parallel_size=1, scheduler="dynamic_cp")
FIXED = {"max_seqlen_per_dp_cp_rank": 4096, "context_parallel_size": 2, "tensor_parallel_size": 1, "scheduler": "dynamic_cp"}


def test_the_environment_variable_is_named_once():
    assert CONFIG_ENV == "BATCH_PLANNER_CONFIG"


def test_merged_settings_put_the_trainers_values_in_and_leave_the_given_alone():
    given = {"planner_endpoint": "dns:///planner:50051", "deadline_seconds": 5.0, "context_parallel_size": 2}
    merged = merged_settings(given, DERIVED, "TrainerX")
    assert merged == {**given, **FIXED}
    assert given == {"planner_endpoint": "dns:///planner:50051", "deadline_seconds": 5.0, "context_parallel_size": 2}


@pytest.mark.parametrize("key, given_value", [("context_parallel_size", 4), ("scheduler", "static_packing"), ("max_seqlen_per_dp_cp_rank", None)])
def test_a_key_set_in_both_with_another_value_is_refused_naming_both(key, given_value):
    with pytest.raises(ConfigError) as caught:
        merged_settings({key: given_value}, DERIVED, "TrainerX")
    message = str(caught.value)
    assert message.startswith(f"{key}: the planner settings say {given_value!r} but TrainerX runs {FIXED[key]!r}"), message
    assert f"drop {key} from the planner settings" in message


def test_planner_config_is_the_client_config_of_both():
    config = planner_config({"planner_endpoint": "dns:///planner:50051", "fallback": False}, DERIVED, "TrainerX")
    assert isinstance(config, PlannerClientConfig)
    assert (config.planner_endpoint, config.fallback) == ("dns:///planner:50051", False)
    assert (config.max_seqlen_per_dp_cp_rank, config.context_parallel_size, config.scheduler) == (4096, 2, SchedulerKind.DYNAMIC_CP)


def test_planner_config_refuses_an_unknown_or_bad_setting_by_name():
    with pytest.raises(ConfigError, match="planer_endpoint"):
        planner_config({"planer_endpoint": "dns:///planner:50051"}, DERIVED, "TrainerX")
    with pytest.raises(ConfigError, match="cp_layout"):
        planner_config({"cp_layout": "diagonal"}, DERIVED, "TrainerX")
    with pytest.raises(ConfigError, match="max_seqlen_per_dp_cp_rank"):
        planner_config({}, dataclasses.replace(DERIVED, max_seqlen_per_dp_cp_rank=0), "TrainerX")


def test_derived_settings_fix_what_they_set_and_leave_the_rest_to_the_user():
    """A setting left NOT_FIXED is the user's; one fixed to None is fixed (a user's other value is refused);
    enums are given by their value, as the planner settings write them."""
    derived = DerivedSettings(4096, 2, 1, scheduler=SchedulerKind.DYNAMIC_CP, padding="verl", min_local_rows=None, cp_layout="contiguous")
    assert derived.fixed() == {**FIXED, "padding": "verl", "min_local_rows": None, "cp_layout": "contiguous"}
    assert derived.cp_layout is CpLayout.CONTIGUOUS and derived.min_cp_size is NOT_FIXED
    assert merged_settings({"min_cp_size": 2}, derived, "TrainerX")["min_cp_size"] == 2
    with pytest.raises(ConfigError, match="min_local_rows: the planner settings say 4 but TrainerX runs None"):
        merged_settings({"min_local_rows": 4}, derived, "TrainerX")


def test_derived_settings_refuse_a_bad_name_and_a_plain_dict():
    with pytest.raises(ConfigError) as caught:
        DerivedSettings(4096, 2, 1, cp_layout="diagonal")
    assert str(caught.value) == "derived setting cp_layout: 'diagonal' is not allowed; allowed: ['zigzag', 'contiguous']"
    with pytest.raises(ArgumentTypeError, match="derived: got a dict; expected .*DerivedSettings"):
        merged_settings({}, FIXED, "TrainerX")


def test_a_client_config_gives_its_non_default_settings_only():
    config = PlannerClientConfig(max_seqlen_per_dp_cp_rank=8192, cp_layout=CpLayout.CONTIGUOUS, deadline_seconds=7.5, job="j")
    given = given_planner_settings(config)
    # max_seqlen_per_dp_cp_rank is the trainer's to say (derived), so it is never "given".
    assert given == {"cp_layout": "contiguous", "deadline_seconds": 7.5, "job": "j"}
    assert planner_config(given, DERIVED, "TrainerX") == PlannerClientConfig.from_dict({**config.to_dict(), **FIXED})


def test_a_dict_is_given_as_a_copy(monkeypatch, tmp_path):
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "ignored.yaml"))  # planner= wins over the file
    settings = {"planner_endpoint": "dns:///planner:50051"}
    given = given_planner_settings(settings)
    assert given == settings and given is not settings
    assert given_planner_settings({}) == {}


def test_no_settings_at_all_plan_in_process_with_a_warning(monkeypatch, caplog):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="trainer_client.dropin.settings"):
        assert given_planner_settings(None) == {}
    assert any("planning in-process" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(CONFIG_ENV, "")
    assert given_planner_settings(None) == {}


def _file(tmp_path, monkeypatch, text: str):
    path = tmp_path / "planner.yaml"
    path.write_text(text)
    monkeypatch.setenv(CONFIG_ENV, str(path))
    return path


def test_the_files_section_is_the_given_settings(tmp_path, monkeypatch):
    _file(tmp_path, monkeypatch, "trainer:\n  steps: 10\nbatch_planner:\n  planner_endpoint: dns:///planner:50051\n  deadline_seconds: 3\n")
    assert given_planner_settings(None) == {"planner_endpoint": "dns:///planner:50051", "deadline_seconds": 3}


def test_an_empty_section_gives_nothing(tmp_path, monkeypatch):
    _file(tmp_path, monkeypatch, "batch_planner:\n")
    assert given_planner_settings(None) == {}


@pytest.mark.parametrize("text, found", [
    ("", "dict {}"),  # an empty file
    ("trainer:\n  steps: 10\n", "dict {'trainer'"),
    ("- batch_planner\n", "list ['batch_planner']"),
    ("batch_planner\n", "str 'batch_planner'"),  # a bare word holds the section's name without being one
    ("42\n", "int 42"),
])
def test_a_file_without_the_section_is_refused_naming_the_file(tmp_path, monkeypatch, text, found):
    path = _file(tmp_path, monkeypatch, text)
    with pytest.raises(ConfigError) as caught:
        given_planner_settings(None)
    message = str(caught.value)
    assert message.startswith(f"${CONFIG_ENV}={path}: no top-level section 'batch_planner'"), message
    assert f"(the file holds {found}" in message, message


@pytest.mark.parametrize("text, kind", [("batch_planner: [planner_endpoint]\n", "list"), ("batch_planner: fast\n", "str")])
def test_a_section_that_is_not_a_mapping_is_refused(tmp_path, monkeypatch, text, kind):
    path = _file(tmp_path, monkeypatch, text)
    with pytest.raises(ConfigError, match=rf"{CONFIG_ENV}=.*{path.name}: section 'batch_planner' must be a mapping of settings, got {kind}"):
        given_planner_settings(None)


def test_a_missing_file_names_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "absent.yaml"))
    with pytest.raises(FileNotFoundError, match="absent.yaml"):
        given_planner_settings(None)
