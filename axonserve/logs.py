"""structlog set-up shared by every process: console or JSON lines, actor bound on each line."""

from __future__ import annotations

import logging
import sys

import structlog

from axonserve.protocol.messages import caller_request_id


def _caller_ids(_: object, __: str, event: dict) -> dict:
    """Engine lines name a request by the caller's id, as the frontend's access line does; the
    engine's own id (`<id>@<tag>`, fresh per generation) rides along as `engine_id`."""
    rid = event.get("request_id")
    if isinstance(rid, str) and "@" in rid:
        event["request_id"], event["engine_id"] = caller_request_id(rid), rid
    return event


def setup_logging(fmt: str = "console", level: str = "info", **bind: object) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s")
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _caller_ids,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (PrintLogger writes the newline separately): processes sharing a log
        # file cannot splice their lines together
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    if bind:
        structlog.contextvars.bind_contextvars(**bind)
