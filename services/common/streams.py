"""Token-stream chunks merged when their reader is behind: the worker's and the gateway's streams alike.

A stream sends one chunk per engine step while its reader keeps up. When the reader is slower (a slow
client, a busy gateway), what piles up in the meantime goes out as few chunks as the protocol allows
instead of one message per token: each sample's pending tokens of the same part (reasoning or answer)
become one chunk, with their texts concatenated and their token ids and logprobs in order. Nothing is
dropped or reordered within a sample, and the stream's last chunk (usage, timing, the vote) stays last.

Works on both `worker.v1.GenerateResponse` and `gateway.v1.GenerateStreamResponse` (the same field
names: text, token_ids, logprobs, index, part, finish_reason, usage, self_consistency).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterable, Generic, TypeVar

Chunk = TypeVar("Chunk", bound=Any)


def _open(chunk: Any) -> bool:
    """More tokens of the same sample may still join this chunk: it ends neither its sample nor the stream."""
    return not chunk.finish_reason and not chunk.HasField("usage") and not chunk.HasField("self_consistency")


def coalesce(chunks: list[Chunk]) -> list[Chunk]:
    """`chunks` (in stream order) as few chunks as possible: a chunk joins the latest chunk of its sample when
    that one is still open and of the same part. The stream's last chunk joins only a chunk that is last so far,
    so it stays last. Merges into the given messages (they are the caller's pending ones)."""
    out: list[Chunk] = []
    latest: dict[int, Chunk] = {}  # sample -> its latest chunk in `out`
    for chunk in chunks:
        head = latest.get(chunk.index)
        if (head is not None and _open(head) and head.part == chunk.part
                and (not chunk.HasField("usage") or out[-1] is head)):
            text = head.text + chunk.text
            head.MergeFrom(chunk)  # token ids and logprobs appended; finish, usage, timing, texts of the end taken
            head.text = text
            continue
        out.append(chunk)
        latest[chunk.index] = chunk
    return out


class ReadAhead(Generic[Chunk]):
    """Reads a response stream (a `grpc.aio` call) on a task of its own, so that what arrives while the
    consumer is busy writing to a slow reader waits here, ready to be merged, rather than in the
    transport as single messages. Nothing is dropped; the stream's error is raised to the consumer after
    every chunk received before it."""

    def __init__(self, stream: AsyncIterable[Chunk]) -> None:
        self._items: list[Chunk] = []
        self._done = False
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._pump(stream))

    async def _pump(self, stream: AsyncIterable[Chunk]) -> None:
        try:
            async for item in stream:
                self._items.append(item)
                self._wake.set()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer (grpc.aio.AioRpcError and the like)
            self._error = exc
        finally:
            self._done = True
            self._wake.set()

    async def pending(self) -> list[Chunk] | None:
        """Everything received since the last call, waiting for at least one; None once the stream has ended."""
        while not self._items and not self._done:
            self._wake.clear()
            await self._wake.wait()
        if self._items:
            items, self._items = self._items, []
            return items
        if self._error is not None:
            raise self._error
        return None

    def close(self) -> None:
        """Stop reading (the consumer is done or gone)."""
        self._task.cancel()
