"""The one place that reads a bearer credential from gRPC metadata (the gateway's API keys, the sandbox's
admin token)."""

from __future__ import annotations

from typing import Iterable, Mapping


def bearer(metadata: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> tuple[str | None, int]:
    """(the key of the `authorization: Bearer KEY` header, how many `authorization` headers were sent).
    The key is None unless exactly one was sent, with the Bearer scheme and a non-empty key: a request
    that sends the header twice must not leave the choice of copy to whoever reads it."""
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    values = [v for k, v in pairs if k.lower() == "authorization"]
    if len(values) != 1:
        return None, len(values)
    header = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else values[0]
    scheme, _, key = header.partition(" ")
    key = key.strip()
    return (key if scheme.lower() == "bearer" and key else None), 1
