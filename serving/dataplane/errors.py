"""Every failure on the data plane is one of these: a status, a message, maybe a Retry-After."""

from __future__ import annotations


class ServingError(Exception):
    status = 500
    headers: tuple[tuple[bytes, bytes], ...] = ()  # extra response headers (401's WWW-Authenticate)

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.retry_after = retry_after


class NotFound(ServingError):
    status = 404


class Unavailable(ServingError):
    """Not loaded, queue full, unloading: try again later (503)."""

    status = 503


class Shed(Unavailable):
    """Refused to protect the latency of admitted work: counted in `ferry_shed_total` by reason and tier."""

    def __init__(self, message: str, *, reason: str, tier: int, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after=retry_after)
        self.reason = reason
        self.tier = tier


class DeadlineExceeded(ServingError):
    status = 504


class ModelFailed(ServingError):
    """The model raised on this request's input, run on its own (422)."""

    status = 422
