"""The bus side of the vLLM bridge, without vLLM: `RankGroup` starts real axonserve ranks
through the rank host, drives them with plans, and owns their lives (clean stop, a dead rank
fails every wait, a dead executor process takes its ranks along)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from axonserve.config import EngineConfig
from axonserve.frontends.vllm_plugin.ranks import RankGroup, RanksFailed, alive
from axonserve.protocol.messages import NewRequestData, SamplingParams, StepPlan, StepResult
from tests.vllm_plugin.conftest import hf_reference, wait_gone

PROMPT = [500 + 7 * i for i in range(12)]


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(
        model=model,
        num_kv_blocks=8,
        max_model_len=128,
        heartbeat_timeout_s=60.0,
        ready_timeout_s=120.0,
        failure_grace_s=0.5,
        **kw,
    )


def _plan(step_id: int = 1) -> StepPlan:
    req = NewRequestData(f"r{step_id}", PROMPT, len(PROMPT), [0], 0, SamplingParams(temperature=0))
    return StepPlan(step_id=step_id, new=[req], num_scheduled_tokens=[len(PROMPT)])


@pytest.fixture
def group(vllm_model):
    groups: list[RankGroup] = []

    def make(**kw) -> RankGroup:
        g = RankGroup(_config(vllm_model, **kw))
        groups.append(g)
        return g

    yield make
    for g in groups:
        g.stop("test teardown")


def test_plan_in_result_out_clean_stop(group, hf_model):
    g = group(num_workers=2)
    info = g.start()
    assert info["num_kv_blocks"] == 8 and len(g.rank_pids) == 2
    g.send(_plan())
    result = g.recv("step 1")
    assert isinstance(result, StepResult) and not result.error
    assert result.request_ids == ["r1"] and result.sampled_token_ids == hf_reference(hf_model, PROMPT, 1)[0]
    pids = [g.host_pid, *g.rank_pids]
    g.stop()
    assert not wait_gone(pids, 5.0), "stop returns once the host and every rank exited"


def test_dead_rank_fails_the_wait_not_hangs(group):
    failed = threading.Event()
    reasons: list[str] = []
    g = group(num_workers=2)
    g.start(lambda why: (reasons.append(why), failed.set()))
    os.kill(g.rank_pids[1], signal.SIGKILL)
    assert failed.wait(60), "the failure callback never fired"
    assert "worker-1" in reasons[0]
    with pytest.raises(RanksFailed, match="worker-1"):
        g.send(_plan())
    assert not wait_gone([g.host_pid, *g.rank_pids]), "the host stops the surviving rank"


_EXECUTOR = """
import sys, time
from axonserve.config import EngineConfig
from axonserve.frontends.vllm_plugin.ranks import RankGroup
g = RankGroup(EngineConfig(model=sys.argv[1], num_kv_blocks=8, max_model_len=128, ready_timeout_s=120.0))
g.start()
print("PIDS", g.run_dir, *[g.host_pid, *g.rank_pids], flush=True)
time.sleep(600)
"""


def test_killed_executor_process_takes_its_ranks_along(vllm_model):
    """What vLLM's API server does to EngineCore on shutdown (SIGKILL, no teardown): the
    lifeline pipe closes and the host shuts the ranks down."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXECUTOR, vllm_model], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    pids: list[int] = []
    run_dir = ""
    try:
        line = next((ln for ln in proc.stdout if ln.startswith("PIDS ")), "")  # type: ignore[union-attr]
        run_dir, *rest = line.split()[1:]
        pids = [int(p) for p in rest]
        assert len(pids) == 2 and all(alive(p) for p in pids) and os.path.isdir(run_dir), line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert not wait_gone(pids), f"orphaned after the executor process was killed: {pids}"
    assert not os.path.exists(run_dir), "the host removes the socket directory the executor left"
