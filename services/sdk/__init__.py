"""The cotserve client SDK: `from cotserve.sdk import Client, AsyncClient`."""

from cotserve.sdk.client import AsyncClient, Client
from cotserve.sdk.errors import (
    CotserveError, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, Unauthenticated,
    Unavailable, Unimplemented,
)
from cotserve.sdk.types import Choice, GenerateResult, ModelInfo, Reasoning, StreamChunk, Timing, Usage

__all__ = [
    "AsyncClient", "Choice", "Client", "CotserveError", "DeadlineExceeded", "FailedPrecondition", "GenerateResult", "InvalidArgument", "ModelInfo",
    "NotFound", "PermissionDenied", "Reasoning", "ResourceExhausted", "StreamChunk", "Timing", "Unauthenticated", "Unavailable",
    "Unimplemented", "Usage",
]
