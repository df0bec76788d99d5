"""How failures leave the HTTP edge: OpenAI/vLLM error JSON with the right status.

Schema problems are 400 (not FastAPI's 422), an unknown model 404, a dead engine 503, an
engine-side failure 500; inside an already-started SSE stream an error chunk then `[DONE]`.
"""

from __future__ import annotations

import jinja2
import structlog
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from axonserve.frontends.client import EngineDeadError, RequestError
from axonserve.frontends.openai.protocol import error_response
from axonserve.protocol.messages import ParamError

log = structlog.get_logger(__name__)


class ModelNotFound(LookupError):
    pass


REJECT_CODES = (400, 408, 503)  # engine refusals that become the HTTP status before a stream starts


def error_for(exc: BaseException) -> JSONResponse:
    if isinstance(exc, ParamError):
        return error_response(400, str(exc), "BadRequestError", exc.param)
    if isinstance(exc, ModelNotFound):
        return error_response(404, str(exc), "NotFoundError", "model")
    if isinstance(exc, EngineDeadError):
        return error_response(503, f"engine unavailable: {exc}", "ServiceUnavailableError")
    if isinstance(exc, RequestError):
        return error_response(exc.status, str(exc))
    if isinstance(exc, (ValueError, TypeError, OverflowError, jinja2.TemplateError)):
        return error_response(400, str(exc), "BadRequestError")
    if isinstance(exc, NotImplementedError):
        return error_response(501, str(exc), "NotImplementedError")
    log.error("request_failed", error=repr(exc))
    return error_response(500, f"internal error: {type(exc).__name__}", "InternalServerError")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Readable message from pydantic errors (str(exc) would leak server paths)."""
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            why = (err.get("ctx") or {}).get("error", "")
            parts.append(f"invalid JSON body: {why}".rstrip(": "))
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = ".".join(loc)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param
