"""Network surfaces (issue 27 item 8), against real processes.

One real server (`axonserve serve`: two worker ranks over gloo, a drafter, a snapshot sink, an
API key) is attacked on every socket it binds: junk frames from raw ZMQ peers on each bus
socket, raw bytes that are not ZMTP at all, frames over the size limit. Every junk message is
logged and dropped, nothing dies, and the server then still serves. Its processes listen on
the loopback only (the TCPStore and gloo included) and none has the API key on its command line.
Plus unit checks: the keyed prefix hash, the frame-size limit, CORS off by default.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import time

import httpx
import msgspec
import pytest
import zmq
from frontends.server import serve
from integration.test_faults import session_pids

from axonserve.actors.channel import HELLO, MAX_FRAMES, message_bytes
from axonserve.actors.runtime import (
    DATA_MESSAGE_BYTES,
    PER_IMAGE_BYTES,
    SMALL_MESSAGE_BYTES,
    bus_socket,
    data_message_bytes,
)
from axonserve.config import EngineConfig
from axonserve.engine.block_manager import BlockManager
from axonserve.protocol import Codec, TensorRef
from axonserve.protocol.messages import (
    AddRequest,
    GetMetrics,
    Heartbeat,
    KVBlocks,
    SamplingParams,
    StepPlan,
    StepResult,
    StepStats,
)

KEY = "sk-bus-hardening-4f1d9c"

# --------------------------------------------------------------------------- unit


class _Req:  # what BlockManager.update_hashes reads of a request
    def __init__(self, toks, extra=()):
        self.token_ids, self.block_hashes, self.extra_keys = list(toks), [], extra


def test_prefix_hash_is_keyed_and_chained():
    a, b = BlockManager(8, 4), BlockManager(8, 4)
    r1, r2, r3 = _Req(range(12)), _Req(range(12)), _Req(range(12), ("img",))
    for r in (r1, r2, r3):
        a.update_hashes(r)
    assert len(r1.block_hashes) == 3 and all(isinstance(h, bytes) and len(h) == 16 for h in r1.block_hashes)
    assert r1.block_hashes == r2.block_hashes  # equal prefixes: equal chains
    assert not set(r1.block_hashes) & set(r3.block_hashes)  # other images: other blocks
    r4 = _Req([0, 1, 2, 3, 9, 9, 9, 9])
    a.update_hashes(r4)
    assert r4.block_hashes[0] == r1.block_hashes[0] and r4.block_hashes[1] != r1.block_hashes[1]
    other = _Req(range(12))
    b.update_hashes(other)  # another engine (another random key): nothing in common
    assert not set(other.block_hashes) & set(r1.block_hashes)
    k = b"k" * 32
    x, y = _Req(range(8)), _Req(range(8))
    BlockManager(4, 4, hash_key=k).update_hashes(x)
    BlockManager(4, 4, hash_key=k).update_hashes(y)
    assert x.block_hashes == y.block_hashes  # one key: one hash function


def test_python_hash_collisions_do_not_collide():
    """hash() of int tuples is public and unkeyed: -1 and -2 hash alike, so do the tuples holding
    them (what vLLM's CVE-2025-25183 exploited). The keyed hash tells them apart."""
    assert hash((None, (-1, 5), ())) == hash((None, (-2, 5), ()))
    bm = BlockManager(4, 2)
    x, y = _Req([-1, 5]), _Req([-2, 5])
    bm.update_hashes(x)
    bm.update_hashes(y)
    assert x.block_hashes != y.block_hashes


def test_frame_size_limit_drops_oversized_frames():
    cfg = EngineConfig(model="m")
    assert data_message_bytes(cfg) == max(DATA_MESSAGE_BYTES, PER_IMAGE_BYTES * cfg.max_images_per_request)
    assert data_message_bytes(msgspec.structs.replace(cfg, max_images_per_request=64)) == 64 * PER_IMAGE_BYTES
    assert data_message_bytes(msgspec.structs.replace(cfg, max_bus_message_bytes=5000)) == 5000
    ctx = zmq.Context()
    try:
        pull = bus_socket(ctx, zmq.PULL, 1000)
        assert pull.getsockopt(zmq.MAXMSGSIZE) == 1000
        addr = f"ipc://{tempfile.mkdtemp()}/s"
        pull.bind(addr)
        push = bus_socket(ctx, zmq.PUSH)
        mon = push.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        push.connect(addr)
        push.send_multipart([b"x" * 1001])  # over: the receiver drops the connection, and the message
        assert _wait_event(mon, zmq.EVENT_DISCONNECTED, 10)
        assert not pull.poll(200)
        push.send_multipart([b"a" * 1000, b"b" * 1000])  # each frame at the limit: fine (after reconnect)
        assert pull.poll(5000)
        assert [len(f) for f in pull.recv_multipart()] == [1000, 1000]
        assert not pull.poll(200)
    finally:
        ctx.destroy(linger=0)


def test_cors_is_off_by_default(monkeypatch):
    from axonserve import cli

    assert EngineConfig(model="m").allowed_origins == []
    seen = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.setdefault("origins", args.allowed_origins) and 0)
    with pytest.raises(SystemExit):
        cli.main(["serve", "some-model"])
    assert seen["origins"] == []


# --------------------------------------------------------------------------- helpers


def _listening(pids) -> dict[int, list[tuple[str, int]]]:
    """pid -> the (address, port) of every TCP socket it listens on (from /proc, no tools)."""
    listen: dict[int, tuple[str, int]] = {}  # socket inode -> local address
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:  # four little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            listen[int(f[9])] = (addr, int(hexport, 16))
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in listen:
                    out.setdefault(pid, []).append(listen[inode])
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def _junk_frames() -> list[list[bytes]]:
    """Frames no receiver accepts: not msgpack, the wrong message type, a frame count or tensor
    reference that does not match, a valid result of a step nobody asked for."""
    return [
        [b""],
        [b"\x00"],
        [b"\xc1"],
        [b"hello", b"world"],
        [os.urandom(300)],
        [msgspec.msgpack.encode([1, "x", [1], "bad-params"])],
        [bytes(f) for f in Codec.encode(StepPlan(step_id=99))],
        [bytes(f) for f in Codec.encode(AddRequest("junk", [1, 2], SamplingParams()))],
        [bytes(f) for f in Codec.encode(GetMetrics())],
        [bytes(f) for f in Codec.encode(StepResult(step_id=10**9, request_ids=["nobody"], sampled_token_ids=[1]))],
        [
            bytes(f)
            for f in Codec.encode(
                StepResult(step_id=1, pooled_request_ids=["x"], pooled=TensorRef(5, "float32", [1, 4]))
            )
        ],
        [
            bytes(f)
            for f in Codec.encode(StepResult(step_id=2, kv_exports=[KVBlocks(4, [TensorRef(1, "float32", [9])])]))
        ],
        [
            bytes(f) for f in Codec.encode(StepStats(0, 0, 0.0, prompt_tokens=-5, num_tokens=[-1]))
        ],  # a negative counter step
        [bytes(f) for f in Codec.encode(Heartbeat("scheduler", 0.0))],
    ]


def _wait_event(monitor: zmq.Socket, event: int, timeout: float) -> bool:
    from zmq.utils.monitor import recv_monitor_message

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if monitor.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            if recv_monitor_message(monitor)["event"] == event:
                return True
    return False


# --------------------------------------------------------------------------- the real server


@pytest.mark.timeout(420)
def test_real_server_bus_hardening(tiny_llama_dir, monkeypatch, tmp_path):
    run_parent = tempfile.mkdtemp(prefix="axb-")  # short: ipc:// paths are limited to ~100 bytes
    monkeypatch.setenv("AXONSERVE_RUN_DIR", run_parent)
    monkeypatch.delenv("AXONSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    draft = json.dumps(
        {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 2, "disable_by_batch_size": 0}
    )
    args = (
        "--num-kv-blocks",
        "128",
        "--served-model-name",
        "tiny",
        "--num-workers",
        "2",
        "--api-key",
        KEY,
        "--speculative-config",
        draft,
        "--snapshot",
        "requests=snap-*,tensors=logits",
        "--snapshot-dir",
        str(tmp_path / "snap"),
    )
    with serve(tiny_llama_dir, *args, start_timeout=300) as srv:
        auth = {"Authorization": f"Bearer {KEY}"}
        pids = session_pids(srv.proc.pid)
        kinds = {
            pid: json.loads(cmd.split("axonserve.actors.entry ", 1)[1])["kind"]
            for pid, cmd in pids.items()
            if "axonserve.actors.entry" in cmd
        }
        assert sorted(kinds.values()) == ["drafter", "frontend", "metrics", "scheduler", "snapshot", "worker", "worker"]

        # -- the API key: on no child's command line; in no child's environment but the frontend's
        for pid, cmd in pids.items():
            if pid != srv.proc.pid:  # the launcher's own argv holds it when typed: use the env var
                assert KEY not in cmd, f"pid {pid} has the key on its command line: {cmd[:200]}"
        for pid, kind in kinds.items():
            assert (KEY in _environ(pid).values()) == (kind == "frontend"), kind

        # -- every listening TCP socket of the group is on the loopback (HTTP, TCPStore, gloo)
        listening = _listening(pids)
        worker_pids = [p for p, k in kinds.items() if k == "worker"]
        assert all(listening.get(p) for p in worker_pids), listening  # gloo pairs (and rank 0's store)
        for pid, addrs in listening.items():
            for addr, port in addrs:
                assert addr in ("127.0.0.1", "::1"), f"{kinds.get(pid, pid)} listens on {addr}:{port}"

        run_dir = os.path.join(run_parent, os.listdir(run_parent)[0])
        path = lambda name: f"ipc://{run_dir}/{name}"  # noqa: E731
        bound = {  # the ZeroMQ socket each actor binds -> the peer kind that can reach it
            "stats": zmq.PUSH,
            "metrics": zmq.DEALER,
            "control": zmq.DEALER,
            "drafter": zmq.DEALER,
            "snapshot": zmq.PUSH,
        }
        for name in bound:
            assert os.path.exists(f"{run_dir}/{name}"), name
        ctx = zmq.Context()
        try:
            # -- junk frames on every bound socket
            peers = {}
            for name, kind in bound.items():
                s = ctx.socket(kind)
                s.setsockopt(zmq.LINGER, 0)
                if name == "control":
                    s.setsockopt(zmq.IDENTITY, b"scheduler")  # even impersonating an actor
                s.connect(path(name))
                peers[name] = s
            for frames in _junk_frames():
                for s in peers.values():
                    s.send_multipart(frames)
            # -- the channels (actors/channel.py): plans and results, and the engine socket. Junk
            # from a peer that said hello (logged, dropped: "worker rank 0 reply", "client
            # message"); a message before a hello, a frame over the limit, a frame count out of
            # bounds: that peer is disconnected, at the header
            for name, hello_id in (("plan", b"0"), ("engine", b"c-junk")):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
                    peer.settimeout(10)
                    peer.connect(f"{run_dir}/{name}")
                    peer.sendall(message_bytes([HELLO, hello_id]))
                    for frames in _junk_frames():
                        peer.sendall(message_bytes(frames))
                for hello, bad in (
                    (False, message_bytes([b"no hello"])),
                    (False, b"GET / HTTP/1.0\r\n\r\n" + os.urandom(4096)),
                    (True, struct.pack("<IQ", 1, 2**40)),  # a frame over the limit
                    (True, struct.pack("<I", MAX_FRAMES + 1)),
                    (True, struct.pack("<I", 0)),
                ):
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                        raw.settimeout(10)
                        raw.connect(f"{run_dir}/{name}")
                        raw.sendall((message_bytes([HELLO, b"1"]) if hello else b"") + bad)
                        assert raw.recv(1) == b"", f"{name}: peer not dropped after {bad[:16]!r}"
            # -- bytes that are not ZMTP at all, on every ipc socket
            for name in bound:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                    raw.settimeout(5)
                    raw.connect(f"{run_dir}/{name}")
                    raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(4096))
            # -- one frame over the limit of the small-message sockets: the sender is disconnected
            for name in ("control", "stats", "metrics"):
                s = ctx.socket(bound[name])
                s.setsockopt(zmq.LINGER, 0)
                mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                s.connect(path(name))
                s.send_multipart([b"\0" * (SMALL_MESSAGE_BYTES + 1)])
                assert _wait_event(mon, zmq.EVENT_DISCONNECTED, 20), f"{name}: oversized frame not refused"
                s.disable_monitor()
                mon.close(linger=0)
                s.close(linger=0)
            time.sleep(1.5)

            # -- nothing died, the engine still serves
            assert srv.proc.poll() is None
            assert set(session_pids(srv.proc.pid)) == set(pids), "a process of the server exited"
            with httpx.Client(base_url=srv.base_url, timeout=120) as http:
                assert http.get("/health").status_code == 200
                r = http.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0},
                    headers=auth,
                )
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 6
                assert (
                    http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code
                    == 401
                )
                m = http.get("/metrics", headers=auth)
                assert m.status_code == 200 and "axonserve" in m.text  # the metrics actor answers
                pre = http.options(
                    "/v1/completions",
                    headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
                )
                assert "access-control-allow-origin" not in pre.headers  # CORS off by default
            assert set(session_pids(srv.proc.pid)) == set(pids)
        finally:
            ctx.destroy(linger=0)
        wanted = (
            "worker rank 0 reply",
            "client message",
            "stats event",
            "metrics query",
            "draft request",
            "snapshot record",
            "bad_control_message",
        )  # each socket's junk: logged
        deadline = time.monotonic() + 30  # (a loaded machine: the sink drains its socket in batches)
        while not all(what in (log := srv.log_tail(2_000_000)) for what in wanted) and time.monotonic() < deadline:
            time.sleep(0.5)
        for what in wanted:
            assert what in log, what
        assert "actor_failed" not in log and "engine_stopped" not in log
