"""The SLO predictor's memory: metric windows and request observations, bounded, and kept on disk
so the service learns across its own restarts.

The file is a sequence of length-prefixed `ReportWindowsRequest` messages (4-byte little-endian
length, then the protobuf bytes): appended as reports arrive, rewritten from memory when it grows
past twice the bound. A truncated tail (a crash mid-write) is ignored; anything else unreadable is
set aside as `<name>.corrupt` and the service starts empty.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import struct
from collections import deque
from pathlib import Path

from cotserve.common.v1 import common_pb2
from cotserve.common.errors import InvalidArgument
from cotserve.common.sampling import SLA_PB
from cotserve.slo.v1 import slo_pb2

log = logging.getLogger("cotserve.slo")

_CLASSES = tuple(SLA_PB.values())
_WINDOW_FLOATS = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms",
                  "kv_used_fraction", "output_tokens_per_s", "utilization", "mean_prompt_tokens")
_REQUEST_FLOATS = ("ttft_ms", "tpot_ms")
PAGE_BYTES = 3 << 20  # an export page's messages at most (about): under gRPC's default 4 MiB limit


def _validate_common(m, where: str, floats: tuple[str, ...]) -> None:
    """The checks a window and a request observation share: model and worker named, a known class,
    a start time, and `floats` finite and >= 0."""
    if not m.model or not m.worker:
        raise InvalidArgument(f"{where}.model and .worker: must not be empty")
    if m.sla_class not in _CLASSES:
        raise InvalidArgument(f"{where}.sla_class: must be REALTIME, INTERACTIVE or BATCH, got {m.sla_class}")
    if m.start_unix_ms <= 0:
        raise InvalidArgument(f"{where}.start_unix_ms: must be > 0, got {m.start_unix_ms}")
    for name in floats:
        v = getattr(m, name)
        if not math.isfinite(v) or v < 0:
            raise InvalidArgument(f"{where}.{name}: must be a finite number >= 0, got {v}")


def validate_window(w: common_pb2.MetricsWindow, where: str) -> None:
    """INVALID_ARGUMENT naming the field for NaN, infinite or negative values, an unknown class,
    a missing model or worker. (Counts are unsigned on the wire, so they cannot be negative.)"""
    _validate_common(w, where, _WINDOW_FLOATS)
    if w.kv_used_fraction > 1 or w.utilization > 1:
        raise InvalidArgument(f"{where}.kv_used_fraction and .utilization: must be within 0..1")


def validate_request(r: slo_pb2.RequestObservation, where: str) -> None:
    _validate_common(r, where, _REQUEST_FLOATS)


class History:
    """The last `max_windows` windows and `max_requests` request observations, in arrival order."""

    def __init__(self, path: Path | None, max_windows: int = 200_000, max_requests: int = 200_000) -> None:
        self.path = path
        self.windows: deque[common_pb2.MetricsWindow] = deque(maxlen=max_windows)
        self.requests: deque[slo_pb2.RequestObservation] = deque(maxlen=max_requests)
        self.version = 0  # bumps on every change; the trainer compares it
        self._file_records = 0
        if path is not None:
            self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        pos, records = 0, 0
        try:
            while pos + 4 <= len(data):
                (n,) = struct.unpack_from("<I", data, pos)
                if pos + 4 + n > len(data):
                    log.warning("history %s: ignoring a truncated last record", self.path)
                    break
                msg = slo_pb2.ReportWindowsRequest.FromString(data[pos + 4: pos + 4 + n])
                self.windows.extend(msg.windows)
                self.requests.extend(msg.requests)
                pos += 4 + n
                records += 1
        except Exception as exc:  # noqa: BLE001 - any decode failure: set it aside, start empty
            aside = self.path.with_name(self.path.name + ".corrupt")
            os.replace(self.path, aside)
            log.error("history %s is unreadable (%s); starting empty, the file is kept as %s", self.path, exc, aside)
            self.windows.clear()
            self.requests.clear()
            return
        self._file_records = records
        self.version += 1
        log.info("history %s: %d windows and %d requests restored", self.path, len(self.windows), len(self.requests))

    def add(self, windows, requests) -> None:
        if not windows and not requests:
            return
        self.windows.extend(windows)
        self.requests.extend(requests)
        self.version += 1
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = slo_pb2.ReportWindowsRequest(windows=windows, requests=requests).SerializeToString()
        with open(self.path, "ab") as fh:
            fh.write(struct.pack("<I", len(payload)) + payload)
        self._file_records += 1
        if self._file_records % 256 == 0 and self.path.stat().st_size > 2 * self._memory_bytes() + 1_000_000:
            self._rewrite()  # the deques dropped their oldest entries: the file holds them still

    def _memory_bytes(self) -> int:
        return sum(w.ByteSize() + 2 for w in self.windows) + sum(r.ByteSize() + 2 for r in self.requests)

    def _rewrite(self) -> None:
        payload = slo_pb2.ReportWindowsRequest(windows=list(self.windows), requests=list(self.requests)).SerializeToString()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(struct.pack("<I", len(payload)) + payload)
        os.replace(tmp, self.path)
        self._file_records = 1

    def since(self, since_unix_ms: int, max_windows: int = 20_000, max_bytes: int = PAGE_BYTES) -> tuple[list, list, int]:
        """(windows, requests, next_since) from `since_unix_ms` on, oldest first, cut at a whole millisecond so that
        no more than `max_windows` windows and about `max_bytes` of messages come back (a page over gRPC's 4 MiB
        message limit is refused: 600 s of a busy gateway's requests were 6 MB); next_since is 0 on the last page."""
        windows = sorted((w for w in self.windows if w.start_unix_ms >= since_unix_ms), key=lambda w: w.start_unix_ms)
        requests = sorted((r for r in self.requests if r.start_unix_ms >= since_unix_ms), key=lambda r: r.start_unix_ms)
        until, n_windows, size = 0, 0, 0
        for is_window, m in heapq.merge(((True, w) for w in windows), ((False, r) for r in requests),
                                        key=lambda item: item[1].start_unix_ms):
            n_windows += is_window
            size += m.ByteSize() + 4  # the field's tag and length
            if (n_windows > max_windows or size > max_bytes) and m.start_unix_ms > since_unix_ms:
                until = m.start_unix_ms  # this millisecond starts the next page (progress: it is after since)
                break
        if not until:
            return windows, requests, 0
        return [w for w in windows if w.start_unix_ms < until], [r for r in requests if r.start_unix_ms < until], until


def export_all(stub, since_unix_ms: int = 0, timeout_s: float = 60.0) -> tuple[list, list, int]:
    """Every window and request observation a predictor holds from `since_unix_ms` on, page by page;
    also returns the `since` to ask for next time."""
    windows, requests = [], []
    while True:
        resp = stub.ExportWindows(slo_pb2.ExportWindowsRequest(since_unix_ms=since_unix_ms), timeout=timeout_s)
        windows.extend(resp.windows)
        requests.extend(resp.requests)
        if not resp.next_since_unix_ms:
            last = max([w.start_unix_ms for w in resp.windows] + [r.start_unix_ms for r in resp.requests], default=since_unix_ms - 1)
            return windows, requests, last + 1
        since_unix_ms = resp.next_since_unix_ms


def write_records(path: Path, batches) -> int:
    """Append `ReportWindowsRequest` batches in the history file format; returns records written."""
    n = 0
    with open(path, "ab") as fh:
        for batch in batches:
            payload = batch.SerializeToString()
            fh.write(struct.pack("<I", len(payload)) + payload)
            n += 1
    return n


def read_records(path: Path) -> tuple[list, list]:
    """(windows, requests) of a file written by `write_records` or the service's history.
    ValueError names the file when it is not one."""
    data = Path(path).read_bytes()
    windows, requests, pos = [], [], 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise ValueError(f"{path}: truncated at byte {pos}")
        (n,) = struct.unpack_from("<I", data, pos)
        if pos + 4 + n > len(data):
            raise ValueError(f"{path}: truncated record at byte {pos}")
        try:
            msg = slo_pb2.ReportWindowsRequest.FromString(data[pos + 4: pos + 4 + n])
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise ValueError(f"{path}: record at byte {pos} is not a windows record ({exc})") from None
        windows.extend(msg.windows)
        requests.extend(msg.requests)
        pos += 4 + n
    return windows, requests
