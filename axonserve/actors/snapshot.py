"""Snapshot sink actor and the reader for what it writes.

Worker rank 0 PUSHes one `SnapshotRecord` per captured (request, forward pass), tensors as
extra frames; the sink PULLs them and writes each as a safetensors file, plus `index.json`
listing every file with its request, step and tensor shapes. Both ends keep small queues
(`QUEUE`), and the worker sends without waiting, so a lagging disk drops records (counted
in the index as `dropped`) instead of stalling the step loop.

Layout of DIR:
    index.json                                 {"version", "rules", "records": [...], "dropped"}
    <run>-<request>-s<step>-e<step_id>.safetensors
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from axonserve.actors.runtime import Actor, attach, bus_socket, data_message_bytes
from axonserve.protocol import Codec, DecodeError, tensor_from_frame
from axonserve.protocol.messages import SnapshotRecord

QUEUE = 64  # records buffered on each side of the socket before the worker drops
INDEX = "index.json"
DRAIN_QUIET_S = 0.3  # at shutdown: stop draining after this long without a record
DRAIN_MAX_S = 3.0  # within the runtime's 5 s teardown bound

_codec = Codec(SnapshotRecord)


class SnapshotSink(Actor):
    kind = "snapshot"

    async def setup(self) -> dict[str, Any]:
        self.dir = os.path.abspath(self.config.snapshot_dir or "axonserve-snapshots")
        os.makedirs(self.dir, exist_ok=True)
        self.pull = bus_socket(self.ctx, zmq.PULL, data_message_bytes(self.config))
        self.pull.setsockopt(zmq.RCVHWM, QUEUE)
        self.pull.setsockopt(zmq.LINGER, 0)
        attach(self.pull, self.addresses.snapshot, bind=True)
        self.run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        self.index = _load_index(self.dir)
        self.index["rules"] = json.loads(self.config.snapshot or "{}")
        self.written = 0
        self._lock = threading.Lock()  # a write thread may still run when teardown drains
        self._write_index()
        return {"dir": self.dir}

    async def run(self) -> None:
        while True:
            # wait for a record without taking it: cancelled at shutdown, an awaited recv could
            # swallow one that arrived in the same instant; teardown's drain takes what is queued
            await self.pull.poll()
            batch = self._drain_nowait()
            if batch:
                await asyncio.to_thread(self._write_batch, batch)

    def _drain_nowait(self) -> list[list[Any]]:
        out = []
        while True:
            try:
                out.append(self.pull.recv_multipart(flags=zmq.NOBLOCK, copy=False).result())
            except zmq.Again:
                return out

    def _write_batch(self, batch: list[list[Any]]) -> None:
        """Write every record of the batch, then the index once (atomically)."""
        with self._lock:
            for frames in batch:
                try:
                    self._write_record(frames)
                except (DecodeError, OSError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
                    self.dropped("snapshot record", e)
            self._write_index()

    def _write_record(self, frames: list[Any]) -> None:
        from safetensors.torch import save_file

        rec, _ = _codec.decode(frames)
        if not isinstance(rec, SnapshotRecord):
            raise DecodeError(f"unexpected {type(rec).__name__} on the snapshot socket")
        runs = self.index.setdefault("dropped_by_run", {})
        runs[self.run_id] = max(runs.get(self.run_id, 0), rec.dropped)
        self.index["dropped"] = sum(runs.values())
        if not rec.tensors:  # a worker's final count of dropped records
            return
        tensors = {name: tensor_from_frame(ref, frames).clone() for name, ref in rec.tensors.items()}
        name = f"{self.run_id}-{_safe(rec.request_id)}-s{rec.step:05d}-e{rec.step_id:07d}.safetensors"
        save_file(
            tensors,
            os.path.join(self.dir, name),
            metadata={"request_id": rec.request_id, "step": str(rec.step), "step_id": str(rec.step_id)},
        )
        self.index["records"].append(
            {
                "file": name,
                "run": self.run_id,
                "request_id": rec.request_id,
                "step": rec.step,
                "step_id": rec.step_id,
                "rank": rec.rank,
                "time": rec.time,
                "tensors": {n: {"shape": list(ref.shape), "dtype": ref.dtype} for n, ref in rec.tensors.items()},
            }
        )
        self.written += 1

    def _write_index(self) -> None:
        tmp = os.path.join(self.dir, f".{INDEX}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.index, f, indent=1)
        os.replace(tmp, os.path.join(self.dir, INDEX))

    async def teardown(self) -> None:
        """Take what the workers sent before they stopped, then write the final index."""
        if not hasattr(self, "pull"):
            return
        batch: list[list[Any]] = []
        deadline = time.monotonic() + DRAIN_MAX_S
        while time.monotonic() < deadline and await self.pull.poll(int(DRAIN_QUIET_S * 1000)):
            batch.append(await self.pull.recv_multipart(copy=False))
        self._write_batch(batch)
        self.log.info("snapshot.closed", dir=self.dir, records=self.written, dropped=self.index.get("dropped", 0))


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s)[:80] or "_"


def _load_index(d: str) -> dict[str, Any]:
    path = os.path.join(d, INDEX)
    if os.path.exists(path):
        with open(path) as f:
            idx = json.load(f)
        if isinstance(idx, dict) and isinstance(idx.get("records"), list):
            return idx
    return {"version": 1, "rules": {}, "records": [], "dropped": 0}


# --------------------------------------------------------------------------- reading


def read_index(d: str) -> dict[str, Any]:
    """The sink's index of DIR; FileNotFoundError with a clear message when there is none."""
    path = os.path.join(d, INDEX)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{d} holds no snapshot index ({INDEX})")
    with open(path) as f:
        return json.load(f)


def select(index: dict[str, Any], key: str | None = None) -> list[tuple[dict[str, Any], str]]:
    """(record, tensor name) pairs matching KEY = REQUEST[/STEP[/TENSOR]] (all when None),
    sorted by request, step and engine step."""
    req = step = tensor = None
    if key:
        req, _, rest = key.partition("/")
        step, _, tensor = rest.partition("/")
    out = []
    for rec in sorted(index["records"], key=lambda r: (r["request_id"], r["step"], r["run"], r["step_id"])):
        if req and rec["request_id"] != req:
            continue
        if step and str(rec["step"]) != step:
            continue
        for name in _ordered(rec["tensors"]):
            if not tensor or name == tensor:
                out.append((rec, name))
    return out


def _ordered(names: Any) -> list[str]:
    def key(n: str) -> tuple:
        head, _, tail = n.partition(".")
        order = {"input_ids": 0, "positions": 1, "hidden": 2, "logits": 3}.get(head, 4)
        return (order, int(tail) if tail.isdigit() else 0, n)

    return sorted(names, key=key)


def load_tensor(d: str, rec: dict[str, Any], name: str) -> Any:
    from safetensors import safe_open

    with safe_open(os.path.join(d, rec["file"]), framework="pt") as f:
        return f.get_tensor(name)


def iter_records(d: str, request_id: str, run: str | None = None) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(record, {name: tensor}) for one request (of one sink run, if given), in engine-step order."""
    from safetensors.torch import load_file

    recs = [r for r in read_index(d)["records"] if r["request_id"] == request_id and run in (None, r["run"])]
    for rec in sorted(recs, key=lambda r: (r["run"], r["step_id"])):
        yield rec, load_file(os.path.join(d, rec["file"]))


def load_request(d: str, request_id: str, run: str | None = None) -> dict[str, Any]:
    """One request's snapshot joined over its forward passes: per-token tensors (input_ids,
    positions, hidden.<layer>) as [num_positions, ...] ordered by position (a position seen
    twice, e.g. recomputed after preemption, keeps its latest value) and `logits` as
    [num_steps, vocab] ordered by step. KeyError when the request has no records."""
    import torch

    by_pos: dict[str, dict[int, Any]] = {}
    logits: dict[int, Any] = {}
    found = False
    for rec, tensors in iter_records(d, request_id, run):
        found = True
        pos = tensors.get("positions")
        for name, t in tensors.items():
            if name == "logits":
                logits[rec["step"]] = t[0]
            elif pos is not None:
                rows = by_pos.setdefault(name, {})
                for p, row in zip(pos.tolist(), t):
                    rows[int(p)] = row
    if not found:
        raise KeyError(f"no snapshot records for request {request_id!r}")
    out: dict[str, Any] = {name: torch.stack([rows[p] for p in sorted(rows)]) for name, rows in by_pos.items()}
    if logits:
        out["logits"] = torch.stack([logits[s] for s in sorted(logits)])
        out["logit_steps"] = torch.tensor(sorted(logits))
    return out


def format_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def ls(d: str, key: str | None = None) -> str:
    """Table of what DIR holds: request, step, engine step, tensor, shape, dtype."""
    index = read_index(d)
    rows = [
        [
            rec["request_id"],
            str(rec["step"]),
            str(rec["step_id"]),
            name,
            "x".join(map(str, rec["tensors"][name]["shape"])) or "scalar",
            rec["tensors"][name]["dtype"],
        ]
        for rec, name in select(index, key)
    ]
    out = format_table(rows, ["request", "step", "engine_step", "tensor", "shape", "dtype"])
    summary = f"{len(index['records'])} records, {len({r['request_id'] for r in index['records']})} requests"
    if index.get("dropped"):
        summary += f", {index['dropped']} dropped by the workers (sink lagging)"
    return f"{out}\n{summary}"


def show(d: str, key: str | None = None, values: int = 8) -> str:
    """Stats (and the first `values` values) of every tensor matching KEY."""
    import torch

    index = read_index(d)
    picked = select(index, key)
    if not picked:
        raise KeyError(f"nothing in {d} matches {key!r} (KEY is REQUEST[/STEP[/TENSOR]])")
    blocks = []
    for rec, name in picked:
        t = load_tensor(d, rec, name)
        f = t.double()
        head = ", ".join(f"{v:.6g}" for v in f.flatten()[:values].tolist())
        more = ", ..." if t.numel() > values else ""
        stats = (
            (
                f"min={f.min().item():.6g} max={f.max().item():.6g} mean={f.mean().item():.6g} "
                f"std={f.std().item() if t.numel() > 1 else 0.0:.6g}"
            )
            if t.numel()
            else "empty"
        )
        if name == "logits" and t.numel():
            top = torch.topk(f.flatten(), min(5, t.numel()))
            stats += " top=" + ",".join(f"{i}:{v:.4g}" for v, i in zip(top.values.tolist(), top.indices.tolist()))
        blocks.append(
            f"{rec['request_id']}/{rec['step']}/{name} (engine step {rec['step_id']}) "
            f"shape={list(t.shape)} dtype={str(t.dtype).removeprefix('torch.')}\n"
            f"  {stats}\n  [{head}{more}]"
        )
    return "\n".join(blocks)


def add_snapshot_parser(sub: Any) -> None:
    """`axonserve snapshot ls|show DIR` (what the sink of `serve --snapshot` wrote)."""
    p = sub.add_parser("snapshot", help="read tensor snapshots written by --snapshot")
    ss = p.add_subparsers(dest="snapshot_cmd", required=True)
    ls_p = ss.add_parser("ls", help="table of captured tensors: request, step, tensor, shape, dtype")
    ls_p.add_argument("dir")
    ls_p.add_argument("key", nargs="?", default=None, help="REQUEST[/STEP[/TENSOR]] filter")
    ls_p.set_defaults(func=lambda a: _print(lambda: ls(a.dir, a.key)))
    show_p = ss.add_parser("show", help="stats and leading values of captured tensors")
    show_p.add_argument("dir")
    show_p.add_argument("key", nargs="?", default=None, help="REQUEST[/STEP[/TENSOR]] (default: everything)")
    show_p.add_argument("--values", type=int, default=8, help="leading values printed per tensor")
    show_p.set_defaults(func=lambda a: _print(lambda: show(a.dir, a.key, a.values)))


def _print(make: Any) -> int:
    try:
        text = make()
    except (FileNotFoundError, KeyError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(text)
    return 0
