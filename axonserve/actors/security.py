"""ZeroMQ CURVE on the tcp bus: off the loopback, only this launch's processes may talk on it.

An ipc:// bus lives in a 0700 run directory, so only the launching user reaches it. A tcp:// bus
(`--bus-transport tcp`, or a backend that spreads actors over machines) is reachable by anything
that can route to the host, and every socket on it would otherwise take plans, requests and
Shutdowns from anyone. So every tcp socket speaks CURVE: a binding socket is a CURVE server whose
ZAP handler (one authenticator thread per zmq context) admits only this launch's client public
key; a connecting socket is a CURVE client that must know the server's public key. A peer
without the keys never completes a handshake, so nothing it sends is delivered.

Keys: one server keypair (every binding socket) and one client keypair (every connecting
socket) per launch, made by the supervisor (`launch_keys`). Per-actor keys would not isolate
anything: every actor of a launch is trusted with the same bus, each binder would have to know
every connector's key in advance, and every restart would have to hand them out again. Children
get the keys in one environment variable, `AXONSERVE_BUS_KEYS` (JSON of z85 strings): never on a
command line (visible to every local user) and never in a log line (`BusKeys` hides them in its
repr). A process with a tcp bus and no keys fails at once (`BusKeysMissing`) rather than run
unauthenticated.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import structlog
import zmq
import zmq.auth.thread

log = structlog.get_logger()

KEYS_ENV = "AXONSERVE_BUS_KEYS"
ZAP_DOMAIN = "axonserve"
_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


class BusKeysMissing(RuntimeError):
    """A tcp bus endpoint and no CURVE keys: refusing to run unauthenticated."""


class BusKeys:
    """The CURVE keys of one launch (z85 bytes). Its repr never shows them."""

    __slots__ = _FIELDS

    def __init__(self, server_public: bytes, server_secret: bytes, client_public: bytes, client_secret: bytes):
        for name, value in zip(_FIELDS, (server_public, server_secret, client_public, client_secret), strict=True):
            value = value.encode() if isinstance(value, str) else bytes(value)
            if len(value) != 40:  # z85 of a 32-byte key
                raise ValueError(f"bus key {name} is not a 40-character z85 CURVE key")
            object.__setattr__(self, name, value)

    @classmethod
    def generate(cls) -> BusKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name).decode() for name in _FIELDS})

    @classmethod
    def from_json(cls, text: str) -> BusKeys:
        try:
            data = json.loads(text)
            return cls(**{name: data[name] for name in _FIELDS})
        except (ValueError, TypeError, KeyError) as e:
            raise BusKeysMissing(f"${KEYS_ENV} is not valid bus keys JSON ({type(e).__name__})") from None

    def env(self) -> dict[str, str]:
        """What a child process's environment needs to join this launch's bus."""
        return {KEYS_ENV: self.to_json()}

    def __repr__(self) -> str:
        return "BusKeys(<hidden>)"

    __str__ = __repr__


_lock = threading.Lock()
_keys: BusKeys | None = None
_auths: dict[int, zmq.auth.thread.ThreadAuthenticator] = {}  # zmq context (underlying) -> its ZAP thread


def install(keys: BusKeys | None) -> None:
    """Use `keys` for this process's tcp sockets (the launcher: its own and in-process clients')."""
    global _keys
    with _lock:
        _keys = keys


def bus_keys() -> BusKeys | None:
    """This process's keys: installed, else from $AXONSERVE_BUS_KEYS (a child's), else None."""
    global _keys
    with _lock:
        if _keys is None and os.environ.get(KEYS_ENV):
            _keys = BusKeys.from_json(os.environ[KEYS_ENV])
        return _keys


def launch_keys() -> BusKeys:
    """The launcher's keys: those this process already has (an operator may hand the same keys to
    a remote client through $AXONSERVE_BUS_KEYS), else fresh ones, installed for this process."""
    keys = bus_keys()
    if keys is None:
        keys = BusKeys.generate()
        install(keys)
    return keys


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def check(addresses: Any) -> None:
    """Fail at start-up, not at the first socket, when a bus endpoint is tcp and there are no keys.
    `addresses`: a `config.Addresses` (its dist_init is torch's rendezvous, not a zmq socket)."""
    tcp = []
    for name in addresses.__struct_fields__:
        value = getattr(addresses, name) or ""
        urls = value if isinstance(value, list) else [value]  # data parallel: every engine's endpoint
        if name != "dist_init" and any(is_tcp(url) for url in urls):
            tcp.append(name)
    if tcp and bus_keys() is None:
        raise BusKeysMissing(
            f"the bus is tcp ({', '.join(tcp)}) but ${KEYS_ENV} holds no CURVE keys: "
            "refusing to run unauthenticated (the supervisor sets it for the processes it starts)"
        )


def secure(sock: zmq.Socket, address: str, *, server: bool) -> None:
    """Make `sock` a CURVE server (`server`: it binds) or client before it binds or connects to a
    tcp:// `address`; ipc:// and inproc:// sockets are left as they are."""
    if not is_tcp(address):
        return
    keys = bus_keys()
    if keys is None:
        raise BusKeysMissing(
            f"bus endpoint {address} is tcp but ${KEYS_ENV} holds no CURVE keys: refusing to run unauthenticated"
        )
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if server:
        _authenticator(sock.context)  # before the bind: a handshake without a ZAP handler admits any client
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class _LaunchClients:
    """ZAP credentials check: this launch's client key only; refusals are logged, rate-limited."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.client_public:
            return True
        self.refused += 1
        if self.refused <= 10 or self.refused % 100 == 0:
            log.warning("bus_peer_refused", reason="unknown CURVE client key", refused=self.refused)
        return False


def _authenticator(ctx: zmq.Context) -> None:
    """Start the ZAP handler of `ctx`'s underlying context once (shadow contexts share it)."""
    keys = bus_keys()
    assert keys is not None
    with _lock:
        if ctx.underlying in _auths:
            return
        auth = zmq.auth.thread.ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, _LaunchClients(keys.client_public))
        _auths[ctx.underlying] = auth


def release(ctx: zmq.Context) -> None:
    """Stop `ctx`'s ZAP handler, if it has one: call before terminating the context, whose term
    would otherwise wait for the handler's sockets forever."""
    with _lock:
        auth = _auths.pop(ctx.underlying, None)
    if auth is not None:
        auth.stop()
