"""The gateway's view of its workers: what each serves, whether it is healthy, how loaded it is.

A background task polls every worker's `Stats` (and `Info` until it answers) on a fixed
interval; routing reads the latest snapshot and never calls a worker itself. A worker leaves
rotation when it refuses the connection (UNAVAILABLE), when a request sees it fail, or after
`down_after_failed_polls` polls in a row fail otherwise (a slow poll alone says little: a busy
worker can answer late and still serve); it is back on its next good poll.

Workers are the addresses given, and with `dns` every address a name resolves to (a Kubernetes headless Service
resolves to one address per ready worker pod): the names are resolved again every `dns_interval_s`, new addresses
join the pool (in rotation once their first poll answers), and addresses gone from the answer are drained: no new
requests go to them, the streams they carry finish, then their channel closes. A name that fails to resolve keeps
the workers it had (a DNS hiccup must not empty the pool).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.errors import NotFound, Unavailable
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import SlaTarget, sla_targets
from cotserve.gateway.admission import Admission, AdmissionConfig, WorkerLoad
from cotserve.gateway.config import split_name
from cotserve.gateway.multiplex import CallStream, MuxStream, WorkerStreams
from cotserve.common.tls import aio_channel
from cotserve.common.tracing import RECONNECT_OPTIONS, client_interceptors
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("cotserve.gateway.pool")

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""NAME, PORT -> the HOST:PORT addresses of the workers the name stands for."""


async def resolve_dns(name: str, port: int) -> list[str]:
    """Every address `name` resolves to (A and AAAA records, as getaddrinfo answers), each with `port`."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({f"[{a[4][0]}]:{port}" if a[0] == socket.AF_INET6 else f"{a[4][0]}:{port}" for a in infos})


WORKER_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
"""A worker's messages may be larger than gRPC's 4 MiB default: one Multiplex message carries every stream's chunks
of a step (more when the gateway fell behind), and the gateway trusts its workers."""


@dataclass(slots=True, eq=False)
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    info: worker_pb2.InfoResponse | None = None
    stats: worker_pb2.StatsResponse | None = None
    healthy: bool = False
    attempts: dict = field(default_factory=dict)  # the requests this gateway has open on the worker (their attempts'
    # observers, oldest first; values unused): who holds its seats, and how many decode tokens each has left
    prefill_tokens_ahead: int = 0  # their prompt tokens (estimated) of those without a first token yet: prefill work
    # a new request waits behind
    waiting_since: dict = field(default_factory=dict)  # the attempts without a first token yet (their observers) ->
    # when each was sent (monotonic s), oldest first: how long the oldest has waited is a stall no poll has reported yet
    last_heard: float = 0.0  # monotonic s of the last chunk read from the worker, or of a send to it with nothing in flight
    failed_polls: int = 0  # polls in a row that failed
    admission: Admission = field(default_factory=Admission)
    streams: WorkerStreams | None = None  # its Multiplex call (None: a Generate call per request)

    @property
    def seats(self) -> int:
        """The most sequences the worker runs at once (its Info's max_num_seqs); 0 until its Info is known."""
        return self.info.max_num_seqs if self.info is not None else 0

    @property
    def in_flight(self) -> int:
        """Requests this gateway has open on the worker."""
        return len(self.attempts)

    @property
    def waiting_for_first_token(self) -> int:
        """Requests this gateway has open on the worker that have no first token yet."""
        return len(self.waiting_since)

    async def open_stream(self, request: worker_pb2.GenerateRequest, timeout_s: float | None) -> MuxStream | CallStream:
        """Start `request` on this worker (a stream of its Multiplex call, or a call of its own); read the answer
        with the stream's `pending()`, and `close()` it however that ends."""
        if self.streams is None:
            return CallStream(self.stub.Generate(request, timeout=timeout_s))
        return await self.streams.open(request, timeout_s)

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
    targets: dict[SlaClass, SlaTarget] = field(default_factory=sla_targets)
    """Each class's SLA targets (INTERACTIVE's inter-token target steers each worker's admission)."""
    down_after_failed_polls: int = 3
    on_change: Callable[[bool], None] | None = None
    """Called with whether any worker is healthy, whenever that changes."""
    dns: list[str] = field(default_factory=list)
    """NAME:PORT names whose every address is a worker (re-resolved every `dns_interval_s`)."""
    dns_interval_s: float = 5.0
    resolve: Resolver = resolve_dns
    credentials: Any = None
    """grpc.ChannelCredentials for workers that speak TLS (None: plaintext)."""
    multiplex: bool = True
    """Requests go to a worker as streams of one Multiplex call (`gateway/multiplex.py`); False: a Generate call each."""
    workers: list[WorkerHandle] = field(default_factory=list)
    draining: list[WorkerHandle] = field(default_factory=list)
    """Workers gone from DNS whose streams are still running."""
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _any_healthy: bool | None = None
    _resolved: dict[str, set[str]] = field(default_factory=dict)

    def _handle(self, address: str, tls_name: str | None = None) -> WorkerHandle:
        """A channel and stub for the worker at `address`; over TLS, one found through DNS (`tls_name`: the name it
        was found by) must present a certificate for that name, as its pod's address is in no certificate."""
        options = [*RECONNECT_OPTIONS, *WORKER_CHANNEL_OPTIONS]
        if tls_name and self.credentials is not None:
            options.append(("grpc.ssl_target_name_override", tls_name))
        channel = aio_channel(address, self.credentials, options=options,
                              interceptors=client_interceptors(self.tracer_provider))
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        streams = WorkerStreams(stub, self.tracer_provider, address) if self.multiplex else None
        return WorkerHandle(address, channel, stub, admission=Admission(self.admission, self.targets), streams=streams)

    async def start(self) -> None:
        self.workers.extend(self._handle(a) for a in self.addresses)
        if self.dns:
            await self.resolve_once()
            self._tasks.append(asyncio.create_task(self._every(self.dns_interval_s, self.resolve_once),
                                                   name="cotserve-gateway-dns"))
        await self.poll_once()
        self._tasks.append(asyncio.create_task(self._every(self.poll_interval_s, self.poll_once), name="cotserve-gateway-pool"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in [*self.workers, *self.draining]:
            await w.channel.close()

    @staticmethod
    async def _every(interval_s: float, step: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await step()

    async def resolve_once(self) -> None:
        """Resolve every name; add the addresses that are new, drain the ones no name (and no --worker) gives now."""
        for target in self.dns:
            name, port = split_name(target)
            try:
                self._resolved[target] = set(await self.resolve(name, port))
            except OSError as exc:  # keep what it had: a failed lookup says nothing about the workers
                log.warning("worker_dns %s: cannot resolve (%s); keeping its %d workers", target, exc,
                            len(self._resolved.get(target, ())))
        wanted = set(self.addresses).union(*self._resolved.values())
        have = {w.address for w in self.workers}
        names = {a: split_name(target)[0] for target, addresses in self._resolved.items() for a in addresses}
        for address in sorted(wanted - have):
            log.info("worker %s joined (DNS)", address)
            self.workers.append(self._handle(address, names.get(address)))
        for w in [w for w in self.workers if w.address not in wanted]:
            log.info("worker %s left DNS: draining (%d streams)", w.address, w.in_flight)
            self.workers.remove(w)
            self.draining.append(w)
            self._tasks.append(asyncio.get_running_loop().create_task(self._drain(w), name=f"cotserve-drain-{w.address}"))
        self._notify()

    async def _drain(self, w: WorkerHandle) -> None:
        """No new requests reach `w` (it left `workers`); close its channel once its streams have ended."""
        while w.in_flight > 0:
            await asyncio.sleep(0.1)
        self.draining.remove(w)
        await w.channel.close()
        log.info("worker %s drained and closed", w.address)

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
        w.admission.on_stats(WorkerLoad(s.kv_blocks_free, s.kv_blocks_free + s.kv_blocks_used, s.num_waiting_urgent_seqs,
                                        w.seats))

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
