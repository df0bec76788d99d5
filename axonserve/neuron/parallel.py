"""Tensor/expert-parallel group state and the collectives the model needs (gloo on CPU).

Every collective goes through `_collective`, which turns a backend failure (a peer rank
died: connection reset; a peer rank hung: gloo's timeout, set by `dist_timeout_s`) into a
`CollectiveError`. The group is then broken for good, so the runner re-raises it and the
worker actor reports itself failed instead of answering the step.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar
from urllib.parse import urlsplit

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger()

T = TypeVar("T")


class TPInfo:
    """Rank and world size of the tensor-parallel group (1 process = rank 0 of 1), and whether
    MoE experts are split across its ranks (expert parallelism) instead of sharded within."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    # model tensors on an XLA device reduce in the graph (xm.all_reduce: Neuron, TPU) or, on PJRT CPU,
    # where XLA collectives across processes do nothing, through gloo on host copies
    xla_in_graph: bool = False
    # set only while a forward runs sequence-parallel (neuron/sequence_parallel.py): row-parallel
    # layers then reduce-scatter along tokens (tp_reduce) instead of all-reducing
    sequence_parallel: bool = False


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died or hung. This rank cannot go on."""


def init_tensor_parallel(
    rank: int,
    size: int,
    init_method: str | None,
    *,
    expert_parallel: bool = False,
    timeout_s: float | None = None,
    device: str = "cpu",
) -> None:
    """Join the group (unless the caller already did) before any model is built.

    timeout_s bounds every later collective: a rank waiting that long for a peer raises
    CollectiveError. The rendezvous itself keeps torch's default timeout (ranks may start
    seconds apart under load)."""
    if size > 1 and not dist.is_initialized():
        if not init_method:
            raise ValueError("tensor parallelism needs an init_method (tcp://host:port) for torch.distributed")
        init_process_group(rank, size, init_method)
    if size > 1 and timeout_s:
        set_collective_timeout(timeout_s)
    TPInfo.rank, TPInfo.size, TPInfo.expert_parallel = rank, size, expert_parallel
    TPInfo.xla_in_graph = device == "xla" and os.environ.get("PJRT_DEVICE", "CPU") != "CPU"


def init_process_group(rank: int, size: int, init_method: str) -> None:
    """Join the gloo group whose rendezvous is `init_method` (tcp://host:port), listening only
    on `host`'s address: torch's own TCPStore server listens on every interface whatever host
    it is given, and gloo on the address the machine's hostname resolves to. Here rank 0 binds
    the store's socket itself (to host, and hands it to the TCPStore), and when host is an
    address of this machine gloo is pinned to the interface that holds it (GLOO_SOCKET_IFNAME,
    unless already set): the loopback by default, so nothing off the machine can reach either;
    a tcp bus's host (`--bus-host`) otherwise, so they listen on that network only, not on every
    interface. A rank on another machine than host keeps gloo's default (or GLOO_SOCKET_IFNAME).
    Neither the store nor gloo is authenticated: a bus host off the loopback belongs on a
    trusted network."""
    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    host, port = url.hostname, url.port
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        iface = _loopback_interface() if _is_loopback(host) else interface_of(host)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    timeout = dist.default_pg_timeout  # the rendezvous: ranks may start far apart under load
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(max(128, size))
        except OSError:
            sock.close()
            raise
        store = dist.TCPStore(host, port, size, True, timeout=timeout, master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    log.info("tp.joined", rank=rank, size=size, host=host)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux), if the machine has one by that name."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def interface_of(host: str) -> str | None:
    """The name of this machine's network interface that holds the IP address `host`, or None
    (not an address of this machine, or not an IP address)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:  # address (32 hex digits), index, prefix, scope, flags, name
                rows = [line.split() for line in f]
        except OSError:
            return None
        return next((row[5] for row in rows if len(row) == 6 and row[0] == ip.exploded.replace(":", "")), None)
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(req[20:24]) == str(ip):
                return name
    return None


def set_collective_timeout(seconds: float) -> None:
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def _collective(op: str, fn: Callable[..., T], *args, **kwargs) -> T:
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        why = str(e).split("\n", 1)[0].rsplit("] ", 1)[-1][:200]  # gloo: "[path:line] message"
        raise CollectiveError(
            f"{op} on rank {TPInfo.rank} of {TPInfo.size} failed, a peer rank died or hung: {why}"
        ) from e


def _on_xla(x: torch.Tensor) -> bool:
    return x.device.type == "xla"


def _via_host(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """PJRT CPU: the collective on a host copy (this ends the pending graph there), back to the device."""
    return fn(x.cpu()).to(x.device)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if TPInfo.size > 1 and _on_xla(x):
        if TPInfo.xla_in_graph:
            import torch_xla.core.xla_model as xm

            return xm.all_reduce(xm.REDUCE_SUM, x)
        return _via_host(x, tp_all_reduce)
    if TPInfo.size > 1:
        if x.dtype == torch.float32:
            _collective("all_reduce", dist.all_reduce, x)
        else:  # reduce low-precision partial sums in float32
            y = x.float()
            _collective("all_reduce", dist.all_reduce, y)
            x.copy_(y)
    return x


def tp_reduce(x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's partial sums: all-reduced, or, while a forward runs
    sequence-parallel, reduce-scattered along tokens (each rank keeps its token shard)."""
    return tp_reduce_scatter(x) if TPInfo.sequence_parallel else tp_all_reduce(x)


def token_shard_rows(total: int) -> int:
    """Rows of each rank's token shard: `total` tokens padded up to a multiple of the group size."""
    return -(-total // TPInfo.size)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def tp_token_shard(x: torch.Tensor) -> torch.Tensor:
    """This rank's token shard of a [T, ...] tensor every rank holds whole: rows
    [rank * s, (rank + 1) * s) of x zero-padded to size * s rows, s = token_shard_rows(T)."""
    if TPInfo.size == 1:
        return x
    s = token_shard_rows(x.shape[0])
    return _pad_rows(x, s * TPInfo.size)[TPInfo.rank * s : (TPInfo.rank + 1) * s]


def tp_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """Sum x [T, ...] over the ranks and keep this rank's token shard (as tp_token_shard of the sum).

    gloo: an all-to-all of the token chunks, then a local sum in rank order; it equals the
    all-reduce bit for bit on 2 ranks and ran faster than gloo's own reduce_scatter_tensor here
    (4.6 vs 7.9 ms median for 8 MiB float32 on 2 ranks). Low-precision partial sums are reduced
    in float32, as tp_all_reduce does."""
    size = TPInfo.size
    if size == 1:
        return x
    s = token_shard_rows(x.shape[0])
    if _on_xla(x):
        if TPInfo.xla_in_graph:
            import torch_xla.core.xla_model as xm

            return xm.reduce_scatter(xm.REDUCE_SUM, _pad_rows(x, s * size), 1.0, 0, size)
        return _via_host(x, tp_reduce_scatter)
    y = _pad_rows(x if x.dtype == torch.float32 else x.float(), s * size).contiguous()
    out = torch.empty_like(y)
    _collective("all_to_all", dist.all_to_all_single, out, y)
    parts = out.view(size, s, *x.shape[1:])
    total = parts[0] + parts[1] if size == 2 else parts.sum(0)
    return total if x.dtype == torch.float32 else total.to(x.dtype)


# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_all_gather_tokens(x: torch.Tensor, total: int) -> torch.Tensor:
    """Every rank's token shard [s, ...] concatenated in rank order, the padding past `total`
    rows dropped: the whole batch again (before a column-parallel matmul or the LM head)."""
    if TPInfo.size == 1:
        return x
    if _on_xla(x):
        if TPInfo.xla_in_graph:
            import torch_xla.core.xla_model as xm

            return xm.all_gather(x, dim=0)[:total]
        return _via_host(x, lambda h: tp_all_gather_tokens(h, total))
    out = x.new_empty((x.shape[0] * TPInfo.size, *x.shape[1:]))
    _collective("all_gather", _all_gather_single, out, x.contiguous())
    return out[:total]


def tp_all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim."""
    if TPInfo.size == 1:
        return x
    if _on_xla(x):
        if TPInfo.xla_in_graph:
            import torch_xla.core.xla_model as xm

            return xm.all_gather(x, dim=x.dim() - 1)
        return _via_host(x, tp_all_gather_last)
    parts = [torch.empty_like(x) for _ in range(TPInfo.size)]
    _collective("all_gather", dist.all_gather, parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def tp_all_gather_rows(x: torch.Tensor, rows_per_rank: int, total: int) -> torch.Tensor:
    """Concatenate every rank's rows (rank r holds at most rows_per_rank) and keep the first `total`."""
    if TPInfo.size == 1:
        return x
    padded = x.new_zeros((rows_per_rank, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(TPInfo.size)]
    _collective("all_gather", dist.all_gather, parts, padded)
    return torch.cat(parts)[:total]


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """Rows [sum(send_splits[:d]), +send_splits[d]) of x go to rank d; the rows from every rank
    come back concatenated in rank order (recv_splits[s] from rank s)."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    _collective("all_to_all", dist.all_to_all_single, out, x.contiguous(), recv_splits, send_splits)
    return out


def all_to_all_equal(x: torch.Tensor) -> torch.Tensor:
    """Equal splits: chunk d of x goes to rank d; chunk s of the result came from rank s."""
    out = torch.empty_like(x)
    _collective("all_to_all", dist.all_to_all_single, out, x.contiguous())
    return out


def tp_min(value: int) -> int:
    """The smallest of every rank's value (ranks sized from their own free memory may differ)."""
    if TPInfo.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    _collective("all_reduce", dist.all_reduce, t, dist.ReduceOp.MIN)  # op positionally: _collective has its own `op`
    return int(t.item())


def tp_broadcast_ids(ids: list[int]) -> list[int]:
    """Rank 0's sampled ids, so every rank appends the same tokens to its request state."""
    if TPInfo.size == 1:
        return ids
    t = torch.tensor(ids, dtype=torch.long)
    _collective("broadcast", dist.broadcast, t, src=0)
    return t.tolist()


def tp_broadcast_ragged(rows: list[list[int]], width: int) -> list[list[int]]:
    """Rank 0's id lists of lengths only it knows (at most `width`, which every rank knows):
    speculative decoding's accepted tokens."""
    if TPInfo.size == 1:
        return rows
    t = torch.full((len(rows), width + 1), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        t[i, 0] = len(r)
        t[i, 1 : 1 + len(r)] = torch.tensor(r, dtype=torch.long)
    _collective("broadcast", dist.broadcast, t, src=0)
    return [r[1 : 1 + r[0]] for r in t.tolist()]
