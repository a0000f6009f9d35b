"""Domain errors that map onto gRPC status codes at the service edge.

Business logic raises these; the server interceptor in `cotserve.common.server` turns them into
the status the design names (DESIGN.md, Conventions: Errors). Nothing below the servicer imports grpc.
"""

from __future__ import annotations


class CotserveError(Exception):
    """Base class; `code` is the name of a `grpc.StatusCode` member."""

    code = "INTERNAL"

    def __init__(self, message: str, *, trailers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.trailers = trailers or {}


class InvalidArgument(CotserveError):
    """Bad input: the message names the field and the allowed range."""

    code = "INVALID_ARGUMENT"


class Unauthenticated(CotserveError):
    """No credential, or one this service does not know."""

    code = "UNAUTHENTICATED"


class PermissionDenied(CotserveError):
    """The caller is known but may not do this (a class, a module, a read-only resource)."""

    code = "PERMISSION_DENIED"


class AlreadyExists(CotserveError):
    code = "ALREADY_EXISTS"


class NotFound(CotserveError):
    code = "NOT_FOUND"


class ResourceExhausted(CotserveError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(CotserveError):
    code = "UNAVAILABLE"


class ModelLoadError(CotserveError):
    """A model folder cannot be served; the message names the file and the problem."""

    code = "FAILED_PRECONDITION"


class FailedPrecondition(CotserveError):
    """The request is valid, but this deployment cannot serve it as configured (the message names the setting)."""

    code = "FAILED_PRECONDITION"


class DeadlineExceeded(CotserveError):
    code = "DEADLINE_EXCEEDED"


class Unimplemented(CotserveError):
    code = "UNIMPLEMENTED"


class RelayedError(CotserveError):
    """A status from a downstream service passed through unchanged (code and message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
