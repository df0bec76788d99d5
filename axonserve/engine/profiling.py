"""The scheduler's profiler stage: /start_profile and /stop_profile reach every worker rank.

Commands share the plan and result sockets with steps, so they run between steps (the core's
step loop drains its steps first, then calls `run_next`). One command at a time: a start while
profiling, a stop while not, or any command while one is pending is refused at once (409), never
queued. Rank 0's acknowledgement comes back before the ranks' traces are written (they are
exported on threads: neuron/profiler.py), so a slow export never holds up the engine.
"""

from __future__ import annotations

import time

from axonserve.engine.stage import Core
from axonserve.protocol.messages import ProfileAck, ProfileCommand, ProfileStatus

PROFILE_TIMEOUT_S = 120.0  # a rank's start/stop (not the export) answers within this


class ProfilerStage:
    def __init__(self, core: Core):
        self.core = core
        self.pending: tuple[bytes, str] | None = None  # (client, start|stop) for the step loop
        self.profiling = False
        self.seq = 0

    async def command(self, ident: bytes, action: str) -> None:
        """Take a client's start/stop for the step loop, or refuse it now."""
        core, refuse = self.core, None
        if not core.config.profile_dir:
            refuse = 400, "profiling is disabled: start the server with --profile-dir DIR"
        elif core.dead.is_set():
            refuse = 503, "the engine is dead"
        elif self.pending is not None:
            refuse = 409, "a profiler command is already in progress"
        elif action == "start" and self.profiling:
            refuse = 409, "the profiler is already running"
        elif action == "stop" and not self.profiling:
            refuse = 409, "the profiler is not running"
        if refuse is not None:
            await core.reply(ident, ProfileStatus(action, code=refuse[0], error=refuse[1]))
            return
        self.pending = ident, action

    async def run_next(self) -> None:
        """Send the pending command to every rank; answer its client with rank 0's ack."""
        assert self.pending is not None
        (ident, action), self.pending = self.pending, None
        self.seq += 1
        cmd = ProfileCommand(action, self.seq, stamp=time.time_ns())
        await self.core.broadcast(cmd)
        ack = await self.core.await_reply(
            f"profiler {action} #{cmd.seq}",
            PROFILE_TIMEOUT_S,
            lambda r: (
                None
                if isinstance(r, ProfileAck) and r.seq == cmd.seq
                else f"not the ack of profiler command #{cmd.seq}"
            ),
        )
        if ack is None:
            return
        self.core.log.info("profiler", action=action, error=ack.error, files=ack.files)
        if ack.code == 0:
            self.profiling = action == "start"
        await self.core.reply(ident, ProfileStatus(action, error=ack.error, code=ack.code, files=ack.files))
