"""The client's lifetime: `BatchPlannerClient` closes through `close()` (once, however often it is
called), at the end of a `with` block (an error in the block included), and at the latest when the
interpreter exits; closed, its read-ahead threads take no more work."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.megatron_builds import best_local_scheduler
from trainer_client import BatchPlannerClient, PlannerClientConfig

ROOT = Path(__file__).resolve().parents[2]


def config() -> PlannerClientConfig:
    return PlannerClientConfig(max_seqlen_per_dp_cp_rank=1024, scheduler=best_local_scheduler())


def _takes_no_more_work(client: BatchPlannerClient) -> bool:
    try:
        client.ahead._executor.submit(lambda: None)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return True
    return False


def test_a_with_block_closes_the_client_at_its_end_even_on_an_error():
    with pytest.raises(KeyError), BatchPlannerClient(config(), dp_cp_size=2, rank=0) as client:
        assert client.plan_step(0, [100, 200, 300]).micro_batches and not client.closed
        raise KeyError("the step failed")
    assert client.closed and _takes_no_more_work(client)


def test_close_closes_once_however_often_it_is_called(monkeypatch):
    client = BatchPlannerClient(config(), dp_cp_size=2, rank=0)
    closes = []
    monkeypatch.setattr(client.source, "close", lambda: closes.append("source"))
    client.close()
    client.close()
    with client:
        pass
    assert closes == ["source"] and client.closed and _takes_no_more_work(client)


def test_a_client_left_open_closes_at_interpreter_exit():
    code = textwrap.dedent(
        """
        from tests.support.megatron_builds import best_local_scheduler
        from trainer_client import BatchPlannerClient, PlannerClientConfig
        from trainer_client.service.plan_source import PlanSource

        closing = PlanSource.close
        def close(self):
            print("source closed", flush=True)
            closing(self)
        PlanSource.close = close

        client = BatchPlannerClient(PlannerClientConfig(max_seqlen_per_dp_cp_rank=1024, scheduler=best_local_scheduler()),
                                    dp_cp_size=2, rank=0)
        client.plan_step(0, [100, 200])
        print("end of program", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["end", "of", "program", "source", "closed"], done.stdout
