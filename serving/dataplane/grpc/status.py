"""A data-plane failure (an HTTP status, `ServingError`) as a gRPC status, the way Triton maps its errors.

Trailing metadata carries what the REST answer carries in headers: `retry-after` (seconds) on a refusal
worth retrying, the quota's RateLimit fields, and `ferry-status`, the HTTP status the REST side would
answer (gRPC has one code for several of them: 400 and 422 are both INVALID_ARGUMENT).
"""

from __future__ import annotations

import math

import grpc

from serving.dataplane.errors import ServingError

CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,  # a load that failed
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,  # what grpcio itself answers a message over its bound
    422: grpc.StatusCode.INVALID_ARGUMENT,  # the model refused this input
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,  # the tenant's quota
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def code_of(status: int) -> grpc.StatusCode:
    return CODES.get(status, grpc.StatusCode.INTERNAL)


def trailing(exc: ServingError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of `exc`'s answer."""
    out = [("ferry-status", str(exc.status))]
    for name, value in exc.headers:
        key = name.decode("latin-1").lower()
        if key != "www-authenticate":  # HTTP's challenge; gRPC's UNAUTHENTICATED says it
            out.append((key, value.decode("latin-1")))
    if exc.retry_after is not None and not any(k == "retry-after" for k, _ in out):
        out.append(("retry-after", str(math.ceil(exc.retry_after))))
    return tuple(out)
