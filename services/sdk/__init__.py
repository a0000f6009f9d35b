"""The cotserve client SDK: `from cotserve.sdk import Client, AsyncClient`."""

from cotserve.sdk.client import AsyncClient, Client
from cotserve.sdk.errors import (
    CotserveError, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, Unauthenticated,
    Unavailable, Unimplemented,
)
from cotserve.sdk.options import RequestOptions, Sampling
from cotserve.sdk.types import (
    Choice, EarlyExit, GenerateResult, ModelInfo, Reasoning, SelfConsistency, SelfConsistencyResult, StreamChunk, Timing, ToolCall,
    Usage, Vote,
)

__all__ = [
    "AsyncClient", "Choice", "Client", "CotserveError", "DeadlineExceeded", "EarlyExit", "FailedPrecondition", "GenerateResult",
    "InvalidArgument", "ModelInfo", "NotFound", "PermissionDenied", "Reasoning", "RequestOptions", "ResourceExhausted",
    "Sampling", "SelfConsistency",
    "SelfConsistencyResult", "StreamChunk", "Timing", "ToolCall", "Unauthenticated", "Unavailable", "Unimplemented", "Usage", "Vote",
]
