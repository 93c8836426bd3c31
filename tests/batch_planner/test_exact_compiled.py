"""The compiled exact path in the processes that run it: a real server's workers (forked from the
forkserver that compiled the kernels) serve the same bytes as Megatron-Core's own code and say
they run compiled code; the on-disk cache is written and read back; the trainer client's fallback
compiles when it starts. Skipped, with the reason, where the compiler or dynamic CP is missing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from batch_planner.convert import request_to_proto
from batch_planner.exact import compiler
from batch_planner.exact.verified import SchedulerImplementation
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.v1 import planner_pb2 as pb
from tests.support.exact_corpus import corpus, served_bytes
from tests.support.megatron_builds import require_scheduler
from tests.support.planner_process import ROOT, planner_env


@pytest.fixture(scope="module", autouse=True)
def compiled_dynamic_cp():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    if not compiler.available():
        pytest.skip(f"the compiled exact path is not checked: {compiler.unavailable_reason()}")


def test_the_server_reports_compiled_dynamic_cp_and_its_workers_serve_upstreams_bytes(stub):
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=30)
    info = {pb.Scheduler.Name(s.scheduler): s for s in caps.schedulers}
    assert info["SCHEDULER_DYNAMIC_CP"].implementation == "compiled", info["SCHEDULER_DYNAMIC_CP"].implementation_reason
    assert "numba" in info["SCHEDULER_DYNAMIC_CP"].implementation_reason
    assert info["SCHEDULER_HYBRID_CP"].implementation == "exact"  # no kernel: the pure-Python exact path, said so
    served = 0
    for case in corpus(200, seed=7):
        if case.dp_cp & (case.dp_cp - 1) or case.micro_batch_group_size not in (None, 1):
            continue  # the server's domain; the corpus tests cover the rest in process
        request = PlanRequest.of(case.lengths, case.dp, case.cp, case.max_seqlen, scheduler=SchedulerKind.DYNAMIC_CP,
                                 min_cp_size=case.min_cp_size if case.min_cp_size > 1 else None)
        upstream = served_bytes(request, SchedulerImplementation.UPSTREAM)
        if upstream[0] != "plan":
            continue
        response = stub.Plan(request_to_proto(request), timeout=60)
        assert response.SerializeToString(deterministic=True) == upstream[1], case.describe()
        served += 1
    assert served > 20


def _run(code: str, cache: str) -> str:
    env = {**planner_env(), "NUMBA_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_kernels_are_cached_on_disk_and_loaded_by_the_next_process(tmp_path):
    code = (
        "from batch_planner.exact.prepare import prepare; "
        "from batch_planner.exact import compiled_dynamic_cp as c; "
        "prepare(always=True); print(sum(len(f.stats.cache_hits) for f in (c._pack, c._best, c._place)))"
    )
    assert _run(code, str(tmp_path)) == "0"  # compiled, and written
    assert list(tmp_path.rglob("*.nbi")) and list(tmp_path.rglob("*.nbc"))
    assert int(_run(code, str(tmp_path))) > 0  # loaded from the cache, not compiled


def test_the_trainer_clients_fallback_compiles_when_it_starts(tmp_path):
    code = (
        "from trainer_client.service.config import PlannerClientConfig; from trainer_client.service.metrics import TrainerMetrics; "
        "from trainer_client.service.plan_source import PlanSource; from batch_planner.exact import compiled_dynamic_cp as c; "
        "PlanSource(PlannerClientConfig(max_seqlen_per_dp_cp_rank=4096, context_parallel_size=2), TrainerMetrics()); "
        "print(len(c._pack.signatures))"
    )
    assert _run(code, str(tmp_path)) == "1"


def test_a_compiler_that_fails_at_start_leaves_the_pure_python_exact_path_planning(monkeypatch):
    """A stand-in for what this machine cannot produce (LLVM failing on a host): the kernels'
    compilation raises at start. The process must keep planning, on the pure-Python exact path,
    and say why."""
    from batch_planner.exact import compiled_dynamic_cp, prepare
    from batch_planner.exact.verified import exact_path_status, select_implementation

    def broken() -> None:
        raise RuntimeError("planted: LLVM cannot compile here")

    monkeypatch.setattr(compiled_dynamic_cp, "prepare", broken)
    monkeypatch.setattr(compiler, "_failed", "")
    select_implementation("compiled")
    try:
        assert exact_path_status(SchedulerKind.DYNAMIC_CP).compiled
        assert prepare.prepare() == 0.0
        status = exact_path_status(SchedulerKind.DYNAMIC_CP)
        assert status.active and not status.compiled
        assert "compiling failed (RuntimeError: planted: LLVM cannot compile here)" in status.reason
        request = PlanRequest.of((4096, 2048, 1024, 512), 2, 2, 4096, scheduler=SchedulerKind.DYNAMIC_CP)
        assert served_bytes(request, SchedulerImplementation.COMPILED) == served_bytes(request, SchedulerImplementation.UPSTREAM)
    finally:
        monkeypatch.undo()
        select_implementation(None)
    assert exact_path_status(SchedulerKind.DYNAMIC_CP).compiled
