"""The gateway's view of its workers: what each serves, whether it is healthy, how loaded it is.

A background task polls every worker's `Stats` (and `Info` until it answers) on a fixed
interval; routing reads the latest snapshot and never calls a worker itself. A worker leaves
rotation when it refuses the connection (UNAVAILABLE), when a request sees it fail, or after
`down_after_failed_polls` polls in a row fail otherwise (a slow poll alone says little: a busy
worker can answer late and still serve); it is back on its next good poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.errors import NotFound, Unavailable
from cotserve.common.sampling import SlaClass
from cotserve.gateway.admission import Admission, AdmissionConfig, WorkerLoad
from cotserve.common.tracing import RECONNECT_OPTIONS, client_interceptors
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("cotserve.gateway.pool")


@dataclass(slots=True, eq=False)
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    info: worker_pb2.InfoResponse | None = None
    stats: worker_pb2.StatsResponse | None = None
    healthy: bool = False
    in_flight: int = 0  # requests this gateway has open on the worker
    failed_polls: int = 0  # polls in a row that failed
    admission: Admission = field(default_factory=Admission)

    @property
    def model(self) -> str | None:
        return self.info.model_name if self.info is not None else None

    def load_key(self, cls: SlaClass = SlaClass.INTERACTIVE) -> tuple[bool, int, int, int]:
        """Lower is better: admits the class now, then fewest waiting, fewest of ours in flight, most free blocks."""
        s = self.stats
        waiting = s.num_waiting_seqs if s else 0
        free = s.kv_blocks_free if s else 0
        return (not self.admission.can_start(cls), waiting, self.in_flight, -free)


@dataclass(slots=True)
class WorkerPool:
    addresses: list[str]
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 1.0
    tracer_provider: TracerProvider | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    down_after_failed_polls: int = 3
    on_change: Callable[[bool], None] | None = None
    """Called with whether any worker is healthy, whenever that changes."""
    workers: list[WorkerHandle] = field(default_factory=list)
    _task: asyncio.Task | None = None
    _any_healthy: bool | None = None

    async def start(self) -> None:
        for address in self.addresses:
            channel = grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS,
                                                interceptors=client_interceptors(self.tracer_provider))
            self.workers.append(WorkerHandle(address, channel, worker_pb2_grpc.WorkerServiceStub(channel),
                                             admission=Admission(self.admission)))
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name="cotserve-gateway-pool")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for w in self.workers:
            await w.channel.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))
        self._notify()

    def _notify(self) -> None:
        now = any(w.healthy for w in self.workers)
        if now != self._any_healthy:
            self._any_healthy = now
            if self.on_change is not None:
                self.on_change(now)

    async def _poll(self, w: WorkerHandle) -> None:
        try:
            if w.info is None or not w.healthy:
                w.info = await w.stub.Info(worker_pb2.InfoRequest(), timeout=self.poll_timeout_s)
            w.stats = await w.stub.Stats(worker_pb2.StatsRequest(), timeout=self.poll_timeout_s)
        except grpc.RpcError as err:
            w.failed_polls += 1
            refused = err.code() == grpc.StatusCode.UNAVAILABLE
            if w.healthy and (refused or w.failed_polls >= self.down_after_failed_polls):
                log.warning("worker %s out of rotation: %s (%d failed polls in a row)", w.address, err.code().name,
                            w.failed_polls)
                w.healthy = False
            elif w.healthy:
                log.info("worker %s: poll failed (%s), %d in a row; still in rotation", w.address, err.code().name,
                         w.failed_polls)
            return
        w.failed_polls = 0
        if not w.healthy:
            log.info("worker %s in rotation: %s rev %s", w.address, w.info.model_name, w.info.model_revision)
        w.healthy = True
        s = w.stats
        w.admission.on_stats(WorkerLoad(s.kv_blocks_free, s.kv_blocks_free + s.kv_blocks_used, s.num_waiting_urgent_seqs))

    def mark_down(self, w: WorkerHandle) -> None:
        """Called when a request saw the worker fail; the next good poll brings it back."""
        w.healthy = False
        self._notify()

    def models(self) -> dict[str, list[WorkerHandle]]:
        """Every known model and its workers (healthy or not)."""
        out: dict[str, list[WorkerHandle]] = {}
        for w in self.workers:
            if w.model is not None:
                out.setdefault(w.model, []).append(w)
        return out

    def resolve_model(self, name: str) -> str:
        """The model a request means (by its name or one of its aliases), or the only model when it names none."""
        models = self.models()
        if name:
            if name in models:
                return name
            for model, workers in models.items():
                if any(name in w.info.model_aliases for w in workers):
                    return model
            raise NotFound(f"model: {name!r} is not served here (served: {', '.join(sorted(models)) or 'none yet'})")
        if len(models) == 1:
            return next(iter(models))
        if not models:
            raise Unavailable("model: no worker has answered yet")
        raise NotFound(f"model: required when several models are served ({', '.join(sorted(models))})")

    def pick(self, model: str, exclude: set[WorkerHandle] = frozenset(),  # type: ignore[assignment]
             cls: SlaClass = SlaClass.INTERACTIVE) -> WorkerHandle:
        """The least loaded healthy worker of `model`, preferring those not in `exclude` (the ones a request
        already tried: one of them is taken again only when it is back in rotation and nothing else is)."""
        healthy = [w for w in self.workers if w.healthy and w.model == model]
        candidates = [w for w in healthy if w not in exclude] or healthy
        if not candidates:
            raise Unavailable(f"no healthy worker serves model {model!r}")
        return min(candidates, key=lambda w: w.load_key(cls))

    async def pick_waiting(self, model: str, exclude: set[WorkerHandle], cls: SlaClass, wait_s: float) -> WorkerHandle:
        """`pick`, waiting up to `wait_s` for a worker to come (back) into rotation, e.g. through a restart."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.pick(model, exclude, cls)
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
