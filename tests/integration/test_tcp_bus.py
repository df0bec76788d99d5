"""The bus off the loopback (issue 31): a real `axonserve serve --bus-transport tcp` whose every
bus socket speaks CURVE, on a non-loopback address of this machine when it has one (what a
multi-node launch advertises), with two worker ranks over gloo, a drafter and a snapshot sink so
that every kind of bound socket is there. It serves; every tcp socket it binds refuses a peer
without the launch's keys (no handshake, nothing delivered, not even a Shutdown); its
torch.distributed store and gloo listen on the bus host only; and no key is on a command line
or in the log."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import zmq
from actors.test_bus_hardening import _environ, _listening
from frontends.server import serve
from zmq.utils.monitor import recv_monitor_message

from axonserve.actors.security import KEYS_ENV, BusKeys
from axonserve.neuron.parallel import interface_of
from axonserve.protocol import Codec
from axonserve.protocol.messages import (
    AddRequest,
    GetEngineInfo,
    GetMetrics,
    Heartbeat,
    SamplingParams,
    Shutdown,
    StepResult,
)
from integration.test_faults import session_pids

# the sockets a launch binds -> the peer socket type that can talk to each (a mismatched type
# would fail its handshake anyway and prove nothing)
PEER = {
    "control": zmq.DEALER,
    "engine": zmq.DEALER,
    "plan": zmq.SUB,
    "result": zmq.PUSH,
    "stats": zmq.PUSH,
    "metrics": zmq.DEALER,
    "snapshot": zmq.PUSH,
    "drafter": zmq.DEALER,
}
# what an attacker would send to each: a Shutdown to the supervisor as the scheduler, work, results
HOSTILE = {
    "control": [Shutdown("unauthenticated peer")],
    "engine": [AddRequest("evil", [1, 2, 3], SamplingParams(max_tokens=1)), GetEngineInfo()],
    "result": [StepResult(step_id=1, request_ids=["evil"], sampled_token_ids=[1])],
    "stats": [Heartbeat("scheduler", 0.0)],
    "metrics": [GetMetrics()],
    "snapshot": [Heartbeat("x", 0.0)],
    "drafter": [Heartbeat("x", 0.0)],
}
BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}


def bus_host() -> str:
    """A non-loopback IPv4 address of this machine (the bus leaves the loopback as it would across
    machines), else the loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.123", 9))  # no packet is sent: the routing table picks the address
            host = s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    return host if interface_of(host) else "127.0.0.1"


class Launch:
    def __init__(self, srv, host: str):
        self.srv, self.host = srv, host
        self.pids = session_pids(srv.proc.pid)
        self.specs = {
            pid: json.loads(cmd.split("axonserve.actors.entry ", 1)[1])
            for pid, cmd in self.pids.items()
            if "axonserve.actors.entry" in cmd
        }
        addresses = next(iter(self.specs.values()))["addresses"]
        self.endpoints = {name: url for name, url in addresses.items() if isinstance(url, str) and url}
        keys = {_environ(pid).get(KEYS_ENV) for pid in self.specs}
        assert len(keys) == 1 and None not in keys, "every actor has the one launch's keys in its environment"
        self.keys = BusKeys.from_json(keys.pop())


@pytest.fixture(scope="module")
def launch(tiny_llama_dir, tmp_path_factory):
    host = bus_host()
    draft = json.dumps({"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 2})
    args = (
        "--bus-transport",
        "tcp",
        "--bus-host",
        host,
        "--num-kv-blocks",
        "128",
        "--served-model-name",
        "tiny",
        "--num-workers",
        "2",
        "--speculative-config",
        draft,
        "--snapshot",
        "requests=snap-*,tensors=logits",
        "--snapshot-dir",
        str(tmp_path_factory.mktemp("snap")),
    )
    with serve(tiny_llama_dir, *args, start_timeout=120, env={KEYS_ENV: ""}) as srv:
        yield Launch(srv, host)


def complete(base_url: str) -> dict:
    with httpx.Client(base_url=base_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.mark.timeout(180)
def test_the_engine_serves_over_a_curve_tcp_bus(launch):
    kinds = sorted(spec["kind"] for spec in launch.specs.values())
    assert kinds == ["drafter", "frontend", "metrics", "scheduler", "snapshot", "worker", "worker"]
    for name, url in launch.endpoints.items():  # every endpoint, the rendezvous too, on the bus host
        assert url.startswith(f"tcp://{launch.host}:"), (name, url)
    assert complete(launch.srv.base_url)["usage"]["completion_tokens"] == 6
    log = launch.srv.log_tail(2_000_000)
    assert "transport=tcp" in log and "curve=True" in log  # the launcher's `bus` line names the endpoints
    # torch.distributed's store and gloo, and every bus socket, listen on the bus host; the HTTP port
    # on --host (the loopback); nothing on every interface
    listening = _listening(launch.pids)
    workers = [pid for pid, spec in launch.specs.items() if spec["kind"] == "worker"]
    assert all(listening.get(pid) for pid in workers), listening  # rank 0's store, gloo pairs
    for pid, addrs in listening.items():
        for addr, port in addrs:
            assert addr in (launch.host, "127.0.0.1"), f"pid {pid} listens on {addr}:{port}"
    for pid in workers:
        assert {addr for addr, _ in listening[pid]} == {launch.host}


def _probes(launch: Launch, ctx: zmq.Context) -> list[tuple[str, str, zmq.Socket, zmq.Socket]]:
    """For every bound tcp socket, three peers that lack the keys, each sending what it would:
    (endpoint, how, socket, its monitor)."""
    stranger_public, stranger_secret = zmq.curve_keypair()
    ways = {
        "plain": lambda s: None,  # no CURVE at all
        "wrong server key": lambda s: (
            s.setsockopt(zmq.CURVE_SERVERKEY, zmq.curve_keypair()[0]),
            s.setsockopt(zmq.CURVE_PUBLICKEY, stranger_public),
            s.setsockopt(zmq.CURVE_SECRETKEY, stranger_secret),
        ),
        # the server's public key (as if leaked) but a client key of its own: the ZAP handler's case
        "stranger client key": lambda s: (
            s.setsockopt(zmq.CURVE_SERVERKEY, launch.keys.server_public),
            s.setsockopt(zmq.CURVE_PUBLICKEY, stranger_public),
            s.setsockopt(zmq.CURVE_SECRETKEY, stranger_secret),
        ),
    }
    out = []
    for name, kind in PEER.items():
        for how, setup in ways.items():
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            if name == "control":
                s.setsockopt(zmq.IDENTITY, b"scheduler")  # impersonating an actor
            setup(s)
            mon = s.get_monitor_socket()
            s.connect(launch.endpoints[name])
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
            for msg in HOSTILE.get(name, []):
                s.send_multipart(Codec.encode(msg))
            out.append((name, how, s, mon))
    return out


def _events(probes, seconds: float) -> dict[tuple[str, str], set[int]]:
    seen: dict[tuple[str, str], set[int]] = {(name, how): set() for name, how, _, _ in probes}
    poller = zmq.Poller()
    by_mon = {}
    for name, how, _, mon in probes:
        poller.register(mon, zmq.POLLIN)
        by_mon[mon] = (name, how)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for mon, _ in poller.poll(100):
            seen[by_mon[mon]].add(recv_monitor_message(mon)["event"])
    return seen


@pytest.mark.timeout(180)
def test_every_tcp_socket_refuses_a_peer_without_the_keys(launch):
    bound = {port for addrs in _listening(launch.pids).values() for addr, port in addrs if addr == launch.host}
    by_port = {int(url.rsplit(":", 1)[1]): name for name, url in launch.endpoints.items()}
    bus_bound = {by_port[p] for p in bound if p in by_port and by_port[p] != "dist_init"}
    assert bus_bound == set(PEER), bus_bound  # the probes cover every bus socket the launch binds
    ctx = zmq.Context()
    try:
        # a control: the launch's own keys complete a handshake and get an answer (the probe works)
        own = ctx.socket(zmq.DEALER)
        own.setsockopt(zmq.LINGER, 0)
        own.setsockopt(zmq.CURVE_SERVERKEY, launch.keys.server_public)
        own.setsockopt(zmq.CURVE_PUBLICKEY, launch.keys.client_public)
        own.setsockopt(zmq.CURVE_SECRETKEY, launch.keys.client_secret)
        own.connect(launch.endpoints["engine"])
        own.send_multipart(Codec.encode(GetEngineInfo()))
        assert own.poll(10_000), "the launch's own keys get no answer"
        own.close(linger=0)

        probes = _probes(launch, ctx)
        seen = _events(probes, 4.0)
        for (name, how), events in seen.items():
            assert zmq.EVENT_CONNECTED in events, f"{name} ({how}): never reached"
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, f"{name} ({how}): handshake succeeded"
            failed = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_DISCONNECTED}
            assert events & (failed | {zmq.EVENT_HANDSHAKE_FAILED_AUTH}), f"{name} ({how}): {events}"
            if how == "stranger client key":  # the ZAP handler refused it, on every binding socket
                assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events, f"{name}: no ZAP refusal {events}"
        for _, _, s, _ in probes:  # a plan never reaches a stranger's SUB
            if s.type == zmq.SUB:
                assert not s.poll(0)
        for _, _, s, mon in probes:
            s.disable_monitor()
            mon.close(linger=0)
            s.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    time.sleep(1.0)
    # nothing happened: no Shutdown, no request, no process gone; the engine still serves
    assert launch.srv.proc.poll() is None
    assert set(session_pids(launch.srv.proc.pid)) == set(launch.pids), "a process of the server exited"
    assert complete(launch.srv.base_url)["usage"]["completion_tokens"] == 6
    log = launch.srv.log_tail(2_000_000)
    assert "bus_peer_refused" in log  # refusals are logged
    for what in ("shutdown_requested", "actor_failed", "actor.restarting", "evil"):
        assert what not in log, what


@pytest.mark.timeout(120)
def test_no_key_is_on_a_command_line_or_in_the_log(launch):
    secrets = [getattr(launch.keys, f).decode() for f in ("server_secret", "client_secret")]
    publics = [getattr(launch.keys, f).decode() for f in ("server_public", "client_public")]
    for pid, cmd in session_pids(launch.srv.proc.pid).items():
        for key in secrets + publics:
            assert key not in cmd, f"pid {pid} has a bus key on its command line"
    assert KEYS_ENV not in _environ(launch.srv.proc.pid) or not _environ(launch.srv.proc.pid)[KEYS_ENV]
    log = launch.srv.log_tail(2_000_000)
    for key in secrets + publics:
        assert key not in log
