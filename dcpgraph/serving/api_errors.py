"""The server's refusals in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``,
and the HTTP status of an engine-side error."""

from __future__ import annotations

from ..errors import RequestError

STATUS_BY_ERROR_NAME = {"QueueFullError": 429, "EngineDeadError": 503, "WorkerDiedError": 503}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def status_for(err: BaseException) -> int:
    """HTTP status of an engine-side error, by class: ``http_status`` if the class defines one,
    else the first of its classes named in :data:`STATUS_BY_ERROR_NAME`, else 400 for request errors."""
    explicit = getattr(err, "http_status", None)
    if isinstance(explicit, int):
        return explicit
    for cls in type(err).__mro__:
        if cls.__name__ in STATUS_BY_ERROR_NAME:
            return STATUS_BY_ERROR_NAME[cls.__name__]
    return 400 if isinstance(err, (RequestError, ValueError)) else 500


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
