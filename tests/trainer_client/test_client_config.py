"""PlannerClientConfig from dicts and YAML: good values load, bad ones name the key and what is allowed."""

from __future__ import annotations

import pytest

from batch_planner.request import CpLayout, SchedulerKind
from trainer_client.service.config import ConfigError, PlannerClientConfig, WhoAsks


def test_from_dict_converts_enums_and_keeps_defaults():
    config = PlannerClientConfig.from_dict(
        {
            "planner_endpoint": "dns:///planner.ns.svc.cluster.local:50051",
            "max_seqlen_per_dp_cp_rank": 8192,
            "cp_layout": "contiguous",
            "scheduler": "hybrid_cp",
            "who_asks": "all_ranks",
            "deadline_seconds": 1,
            "tls": False,
        }
    )
    assert config.cp_layout is CpLayout.CONTIGUOUS
    assert config.scheduler is SchedulerKind.HYBRID_CP
    assert config.who_asks is WhoAsks.ALL_RANKS
    assert config.deadline_seconds == 1.0 and isinstance(config.deadline_seconds, float)
    assert config.fallback is True and config.max_attempts == 2
    assert PlannerClientConfig.from_dict(config.to_dict()) == config


def test_from_yaml_reads_a_section_of_a_trainer_config(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        "model: {layers: 2}\n"
        "batch_planner:\n"
        "  planner_endpoint: 127.0.0.1:50051\n"
        "  max_seqlen_per_dp_cp_rank: 4096\n"
        "  tls: true\n"
        "  tls_ca_file: /etc/planner/ca.pem\n"
        "  min_cp_size: null\n"
    )
    config = PlannerClientConfig.from_yaml(path, section="batch_planner")
    assert config.planner_endpoint == "127.0.0.1:50051"
    assert config.max_seqlen_per_dp_cp_rank == 4096 and config.tls_ca_file == "/etc/planner/ca.pem"
    with pytest.raises(ConfigError, match="no top-level section 'planner'"):
        PlannerClientConfig.from_yaml(path, section="planner")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"planner_endpoint": "x:1", "max_seqlen_per_dp_cp_rank": 1, "deadline": 1}, r"unknown key\(s\) \['deadline'\]"),
        ({"max_seqlen_per_dp_cp_rank": 1, "cp_layout": "ring"}, r"cp_layout: 'ring' is not allowed; allowed: \['zigzag', 'contiguous'\]"),
        ({"max_seqlen_per_dp_cp_rank": 1, "who_asks": "rank0"}, r"who_asks: 'rank0'.*'leader', 'all_ranks'"),
        ({"max_seqlen_per_dp_cp_rank": 1, "scheduler": "magic"}, r"scheduler: 'magic'"),
        ({}, r"max_seqlen_per_dp_cp_rank: 0 is not allowed.*required"),
        ({"max_seqlen_per_dp_cp_rank": "4096"}, r"max_seqlen_per_dp_cp_rank: '4096' is a str; expected a int"),
        ({"max_seqlen_per_dp_cp_rank": True}, r"max_seqlen_per_dp_cp_rank: True is a bool"),
        ({"max_seqlen_per_dp_cp_rank": 1, "deadline_seconds": 0}, r"deadline_seconds: 0.0 is not allowed; expected a number > 0"),
        ({"max_seqlen_per_dp_cp_rank": 1, "deadline_seconds": float("nan")}, r"deadline_seconds: nan"),
        ({"max_seqlen_per_dp_cp_rank": 1, "max_attempts": 0}, r"max_attempts: 0 is not allowed"),
        ({"max_seqlen_per_dp_cp_rank": 1, "fallback": "yes"}, r"fallback: 'yes' is a str; expected a bool"),
        ({"max_seqlen_per_dp_cp_rank": 1, "min_cp_size": 0}, r"min_cp_size: 0 is not allowed"),
        ({"max_seqlen_per_dp_cp_rank": 1, "planner_endpoint": "planner"}, r"planner_endpoint: 'planner' has no valid port"),
        ({"max_seqlen_per_dp_cp_rank": 1, "planner_endpoint": "http://planner:80"}, r"planner_endpoint: 'http://planner:80' is not allowed"),
        ({"max_seqlen_per_dp_cp_rank": 1, "tls_cert_file": "c.pem"}, r"tls_cert_file and tls_key_file: set both"),
        ({"max_seqlen_per_dp_cp_rank": 1, "tls": False, "tls_ca_file": "ca.pem"}, r"tls: False \(plaintext\)"),
        ({"max_seqlen_per_dp_cp_rank": 1, "backoff_multiplier": 0.5}, r"backoff_multiplier: 0.5"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(values, message):
    with pytest.raises(ConfigError, match=message):
        PlannerClientConfig.from_dict(values)


def test_a_non_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping, got list"):
        PlannerClientConfig.from_yaml(path)


def test_every_status_code_has_exactly_one_client_action():
    """one vocabulary (gRPC's names) and one retry / fallback / reject table."""
    import grpc

    from batch_planner.errors import CLIENT_ACTION, ErrorCode

    assert {code.value for code in ErrorCode} == {code.name for code in grpc.StatusCode}
    assert set(CLIENT_ACTION) == set(ErrorCode) - {ErrorCode.OK}
