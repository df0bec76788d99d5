"""The tcp bus's CURVE (actors/security.py) on real sockets: a bus socket made through
`bus_socket` + `attach` on tcp:// admits only this launch's keys, ipc:// stays as it was, a
process without keys refuses to start, and keys never show in a repr. Plus `Addresses.tcp`,
the bus settings' validation and the interface lookup that pins gloo to the bus host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from axonserve.actors import security
from axonserve.actors.runtime import SMALL_MESSAGE_BYTES, attach, bus_socket
from axonserve.config import TCP_ENDPOINTS, ActorSpec, Addresses, EngineConfig, free_ports
from axonserve.neuron.parallel import interface_of


@pytest.fixture
def keys(monkeypatch):
    """This process's bus keys for the test (and none afterwards)."""
    monkeypatch.delenv(security.KEYS_ENV, raising=False)
    k = security.BusKeys.generate()
    security.install(k)
    yield k
    security.install(None)


@pytest.fixture
def no_keys(monkeypatch):
    monkeypatch.delenv(security.KEYS_ENV, raising=False)
    security.install(None)


def handshake(address: str, setup, kind: int = zmq.DEALER, timeout: float = 1.5) -> tuple[bool, set[int]]:
    """Connect a socket of `kind` prepared by `setup` (its CURVE options, or none), send one message;
    (did the handshake succeed, the monitor events seen)."""
    ctx = zmq.Context()
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    setup(s)
    mon = s.get_monitor_socket()
    try:
        s.connect(address)
        s.send(b"hello")
        events: set[int] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and zmq.EVENT_HANDSHAKE_SUCCEEDED not in events:
            if mon.poll(50):
                events.add(recv_monitor_message(mon)["event"])
        return zmq.EVENT_HANDSHAKE_SUCCEEDED in events, events
    finally:
        s.disable_monitor()
        mon.close(linger=0)
        s.close(linger=0)
        ctx.term()


def curve(server_public: bytes, client: tuple[bytes, bytes] | None = None):
    def setup(s: zmq.Socket) -> None:
        public, secret = client or zmq.curve_keypair()
        s.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        s.setsockopt(zmq.CURVE_PUBLICKEY, public)
        s.setsockopt(zmq.CURVE_SECRETKEY, secret)

    return setup


@pytest.mark.timeout(60)
def test_a_tcp_bus_socket_admits_only_the_launch_keys(keys):
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    server = bus_socket(ctx, zmq.ROUTER, SMALL_MESSAGE_BYTES)
    try:
        attach(server, address, bind=True)
        assert server.getsockopt(zmq.CURVE_SERVER) == 1
        assert server.getsockopt(zmq.MAXMSGSIZE) == SMALL_MESSAGE_BYTES  # bus_socket's limit kept

        # the launch's own client: admitted, and its message arrives
        ok, _ = handshake(address, lambda s: security.secure(s, address, server=False))
        assert ok
        assert server.poll(2000) and server.recv_multipart()[1] == b"hello"

        # right server key, a stranger's client key: the ZAP handler refuses it
        ok, events = handshake(address, curve(keys.server_public))
        assert not ok and zmq.EVENT_HANDSHAKE_FAILED_AUTH in events
        # no CURVE at all; a wrong server key: no handshake either
        for setup in (lambda s: None, curve(zmq.curve_keypair()[0])):
            ok, events = handshake(address, setup)
            assert not ok and events & {
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_DISCONNECTED,
            }
        assert not server.poll(300)  # none of their messages was delivered
    finally:
        security.release(ctx)
        ctx.destroy(linger=0)  # returns: the ZAP thread is gone


@pytest.mark.timeout(30)
def test_a_connecting_tcp_socket_is_a_curve_client_and_ipc_is_untouched(keys):
    ctx = zmq.Context()
    try:
        client = bus_socket(ctx, zmq.DEALER)
        attach(client, "tcp://127.0.0.1:9")  # connects lazily: nothing needs to listen
        assert client.getsockopt(zmq.CURVE_SERVER) == 0
        assert client.getsockopt(zmq.MECHANISM) == zmq.CURVE
        plain = bus_socket(ctx, zmq.ROUTER)
        attach(plain, f"ipc://{tempfile.mkdtemp()}/s", bind=True)
        assert plain.getsockopt(zmq.MECHANISM) == zmq.NULL
    finally:
        ctx.destroy(linger=0)


def test_without_keys_a_tcp_socket_refuses_and_ipc_works(no_keys):
    ctx = zmq.Context()
    try:
        for bind in (True, False):
            with pytest.raises(security.BusKeysMissing, match=security.KEYS_ENV):
                attach(bus_socket(ctx, zmq.ROUTER), "tcp://127.0.0.1:9", bind=bind)
        attach(bus_socket(ctx, zmq.ROUTER), f"ipc://{tempfile.mkdtemp()}/s", bind=True)
        security.check(Addresses.in_dir("/tmp/x", 1234))  # ipc bus (its tcp rendezvous is torch's): fine
        with pytest.raises(security.BusKeysMissing, match="control"):
            security.check(Addresses.tcp("127.0.0.1"))
    finally:
        ctx.destroy(linger=0)


def test_an_actor_with_a_tcp_bus_and_no_keys_exits_at_start(no_keys):
    spec = ActorSpec(
        kind="metrics", name="metrics", config=EngineConfig(model="none"), addresses=Addresses.tcp("127.0.0.1")
    )
    env = {k: v for k, v in os.environ.items() if k != security.KEYS_ENV}
    env["AXONSERVE_PARENT_PID"] = str(os.getpid())
    r = subprocess.run(
        [sys.executable, "-m", "axonserve.actors.entry", msgspec.json.encode(spec).decode()],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "bus_keys_missing" in r.stderr and "unauthenticated" in r.stderr


def test_keys_travel_as_json_and_never_show_in_a_repr(no_keys, monkeypatch):
    k = security.BusKeys.generate()
    assert security.KEYS_ENV in k.env() and list(k.env()) == [security.KEYS_ENV]
    again = security.BusKeys.from_json(k.env()[security.KEYS_ENV])
    assert again.to_json() == k.to_json()
    for secret in (k.server_secret, k.client_secret, k.server_public, k.client_public):
        assert secret.decode() not in repr(k) and secret.decode() not in str(k)
    with pytest.raises(security.BusKeysMissing):
        security.BusKeys.from_json("{}")
    with pytest.raises(ValueError):
        security.BusKeys(b"short", k.server_secret, k.client_public, k.client_secret)
    monkeypatch.setenv(security.KEYS_ENV, k.to_json())  # a child: from its environment
    assert security.bus_keys().to_json() == k.to_json()
    assert security.launch_keys() is security.bus_keys()  # a launcher given keys keeps them


def test_addresses_tcp_puts_every_endpoint_on_the_host():
    a = Addresses.tcp("127.0.0.1", dist_init=True, avoid={8000})
    urls = [getattr(a, name) for name in (*TCP_ENDPOINTS, "dist_init")]
    assert all(u.startswith("tcp://127.0.0.1:") for u in urls), urls
    ports = a.tcp_ports()
    assert len(ports) == len(urls) and 8000 not in ports  # distinct, the HTTP port avoided
    assert not Addresses.tcp("127.0.0.1").dist_init
    assert Addresses.tcp("::1").engine.startswith("tcp://[::1]:")


def test_bus_settings_are_checked():
    assert EngineConfig(model="m").bus_transport == "ipc"
    assert EngineConfig(model="m", bus_transport="tcp", bus_host="10.1.2.3").bus_host == "10.1.2.3"
    for bad, match in (
        (dict(bus_transport="udp"), "bus_transport"),
        (dict(bus_transport="tcp", bus_host="0.0.0.0"), "wildcard"),
        (dict(bus_transport="tcp", bus_host="::"), "wildcard"),
        (dict(bus_transport="tcp", bus_host="node-1"), "IP address"),
        (dict(bus_host="10.1.2.3"), "tcp"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="m", **bad)


def test_cli_bus_flags_reach_the_config(tiny_llama_dir, monkeypatch):
    from axonserve import cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.setdefault("config", cli.engine_config(args)) and 0)
    with pytest.raises(SystemExit):
        cli.main(["serve", tiny_llama_dir, "--bus-transport", "tcp", "--bus-host", "127.0.0.1"])
    assert seen["config"].bus_transport == "tcp" and seen["config"].bus_host == "127.0.0.1"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "axonserve.cli",
            "serve",
            tiny_llama_dir,
            "--bus-transport",
            "tcp",
            "--bus-host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "wildcard" in r.stderr, r.stderr[-2000:]


def test_interface_of_finds_the_interface_holding_an_address():
    assert interface_of("127.0.0.1") in ("lo", "lo0")
    assert interface_of("203.0.113.77") is None  # not this machine's (TEST-NET-3)
    assert interface_of("not-an-ip") is None
    json.dumps(interface_of("::1"))  # an IPv6 lookup answers (None without IPv6)


@pytest.mark.timeout(30)
async def test_a_client_without_keys_refuses_a_tcp_engine(no_keys):
    from axonserve.frontends.client import AsyncEngineClient

    with pytest.raises(security.BusKeysMissing):
        await AsyncEngineClient.connect("tcp://127.0.0.1:9", timeout=1)
