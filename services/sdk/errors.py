"""SDK exceptions: each keeps the gRPC status code and the server's message."""

from __future__ import annotations

import grpc


class CotserveError(Exception):
    """Base of every SDK error. `code` is the gRPC status, `message` the server's words."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidArgument(CotserveError):
    """A request field is out of range; the message names it and the allowed range."""


class NotFound(CotserveError):
    """Unknown model (or module)."""


class ResourceExhausted(CotserveError):
    """Over a quota or a queue bound; retry after `retry_after_ms` (None when the server gave none)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(code, message)
        self.retry_after_ms = retry_after_ms


class Unavailable(CotserveError):
    """No worker could serve the request, or one failed after streaming began."""


class DeadlineExceeded(CotserveError):
    """The call's deadline passed."""


class Unauthenticated(CotserveError):
    """Missing or unknown API key."""


class PermissionDenied(CotserveError):
    """The key may not do this (SLA class, module)."""


class FailedPrecondition(CotserveError):
    """The deployment cannot serve this as configured (e.g. reasoning budgets on a model without reasoning markers)."""


class Unimplemented(CotserveError):
    """The deployment lacks the feature the request asked for."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
}


def from_rpc_error(err: grpc.RpcError) -> CotserveError:
    code, message = err.code(), err.details() or ""
    cls = _BY_CODE.get(code, CotserveError)
    if cls is ResourceExhausted:
        trailers = dict(err.trailing_metadata() or ())
        raw = trailers.get("retry-after-ms")
        return ResourceExhausted(code, message, int(raw) if raw is not None and str(raw).isdigit() else None)
    return cls(code, message)
