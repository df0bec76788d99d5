"""`--distributed-executor-backend ray` on a real two-node Ray cluster on this machine.

The cluster (`ray.cluster_utils.Cluster`: a head raylet and a second raylet with their own CPUs,
started by this module and shut down after it) places each worker rank in a placement-group bundle;
the bus goes over CURVE tcp. `-tp 2` with STRICT_SPREAD puts the two ranks on distinct nodes (asked
from Ray's state API) and serves transformers' greedy text; a rank's Ray actor killed mid-generation
is noticed through Ray and healed (its streams resume); after the server stops no Ray actor or
placement group of it is left. Without Ray installed these tests skip, except under CI."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import hf_greedy
from frontends.server import serve

from axonserve.frontends.tokenizer import Tokenizer

from .test_faults import wait_until
from .test_self_healing import Streams

N = 12
PROMPTS = [f"Node test {i}: the river flows to" for i in range(4)]


@pytest.fixture(scope="module")
def ray_cluster():
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as e:
        msg = f"the Ray tests need ray[default] (the test extra): {e}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1"},
    )
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()  # this process's driver (the state API's) first: the cluster refuses otherwise
        cluster.shutdown()


def ray_state(address: str):
    """Ray's state API from a driver of its own (this test process)."""
    import ray
    from ray.util import state

    if not ray.is_initialized():
        ray.init(address=address, namespace="axonserve-test", log_to_driver=False)
    return state


def alive_rank_hosts(address: str) -> list:
    state = ray_state(address)
    return state.list_actors(filters=[("class_name", "=", "RankHost"), ("state", "=", "ALIVE")])


def reference(model_dir: str) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.load(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [tok.decode(hf_greedy(model, tok.encode(p), N)) for p in PROMPTS]


def texts(base_url: str) -> list[str]:
    def one(p: str) -> str:
        body = {"model": "tiny", "prompt": p, "max_tokens": N, "min_tokens": N, "temperature": 0}
        r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.mark.timeout(400)
def test_tp2_ranks_on_two_nodes_parity_healing_and_cleanup(ray_cluster, tiny_llama_dir):
    address = ray_cluster.address
    want = reference(tiny_llama_dir)
    args = (
        "--served-model-name", "tiny", "--num-kv-blocks", "256", "--max-model-len", "512",
        "--distributed-executor-backend", "ray", "-tp", "2",
        "--ray-placement-strategy", "STRICT_SPREAD", "--ray-cpus-per-worker", "1",
    )  # fmt: skip
    with serve(tiny_llama_dir, *args, env={"RAY_ADDRESS": address}, start_timeout=300) as srv:
        hosts = alive_rank_hosts(address)
        assert len(hosts) == 2 and len({h.node_id for h in hosts}) == 2, hosts  # one rank per node
        assert texts(srv.base_url) == want

        # a rank's Ray actor dies mid-generation (as when its node is lost): Ray reports it, the
        # group is replaced in the same bundles, the streams resume
        import ray

        streams = Streams(srv.base_url, [f"Story {i}: once upon a time" for i in range(4)])
        wait_until(streams.started, 60, "every stream's first tokens")
        victim = next(h for h in hosts if "-rank1-" in h.name)
        t0 = time.monotonic()
        ray.kill(ray.get_actor(victim.name, namespace="axonserve"), no_restart=True)
        streams.join(200)
        assert not streams.errors and streams.finish == ["length"] * 4, (streams.errors, streams.finish)
        print(f"\nray: rank actor killed, streams done {time.monotonic() - t0:.1f} s later")
        after = alive_rank_hosts(address)
        assert len(after) == 2 and len({h.node_id for h in after}) == 2, after
        assert {h.name for h in after}.isdisjoint({h.name for h in hosts})
        assert texts(srv.base_url) == want
    # stopped: nothing of this launch stays in the cluster
    wait_until(lambda: not alive_rank_hosts(address), 30, "no RankHost left")
    state = ray_state(address)
    groups = state.list_placement_groups(filters=[("state", "=", "CREATED")])
    assert not groups, groups


def test_ray_backend_without_ray_names_the_extra(monkeypatch, tiny_llama_dir):
    import importlib.util

    from axonserve.config import EngineConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'axonserve\[ray\]'"):
        EngineConfig(model=tiny_llama_dir, distributed_executor_backend="ray")
