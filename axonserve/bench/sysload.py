"""How busy the machine was with other work while we measured (shared machine: noisy numbers).

Other processes' CPU = all busy CPU time (/proc/stat) minus that of the processes we own (this
process, its children, and the process groups of the servers we started). Exited processes are
included, which per-pid accounting would miss.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_TICK = os.sysconf("SC_CLK_TCK")


def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def _proc_cpu_s(pid: int) -> tuple[int, int, float] | None:
    """(ppid, pgid, utime+stime+children's) of one process, or None if it vanished."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2 :].split()
    ppid, pgid = int(rest[1]), int(rest[2])
    ut, st, cut, cst = (int(x) for x in rest[11:15])
    return ppid, pgid, (ut + st + cut + cst) / _TICK


def own_cpu_s(pgids: set[int]) -> float:
    """CPU seconds of this process tree plus every process in `pgids`."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (p := _proc_cpu_s(int(name))) is not None:
            procs[int(name)] = p
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in procs.items():
            if ppid == parent and pid not in mine:
                mine.add(pid)
                frontier.append(pid)
    mine |= {pid for pid, (_, pgid, _) in procs.items() if pgid in pgids}
    return sum(procs[p][2] for p in mine if p in procs)


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


@dataclass
class LoadMonitor:
    """`start()` before a measured run and `stop()` after it; `report()` is JSON-ready."""

    pgids: set[int] = field(default_factory=set)
    _t: float = 0.0
    _busy: float = 0.0
    _own: float = 0.0
    result: dict = field(default_factory=dict)

    def start(self) -> None:
        self.result = {"loadavg_start": loadavg()}
        self._t, self._busy, self._own = time.monotonic(), _busy_s(), own_cpu_s(self.pgids)

    def stop(self) -> dict:
        wall = time.monotonic() - self._t
        busy, own = _busy_s() - self._busy, own_cpu_s(self.pgids) - self._own
        other = max(0.0, busy - own)
        self.result.update(
            loadavg_end=loadavg(),
            wall_s=wall,
            cpus=os.cpu_count(),
            own_cpu_s=own,
            other_cpu_s=other,
            other_cores=other / wall if wall > 0 else 0.0,
        )
        return self.result
