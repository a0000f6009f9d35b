"""Pre- and post-processing of requests through the WASI sandbox service.

A pre-processor runs on the prompt: exit 0 passes its stdout on as the (possibly rewritten)
prompt; exit 1 rejects the request with PERMISSION_DENIED and the module's stdout as the reason.
A post-processor runs on the completed text and its stdout replaces it (exit 1 likewise rejects).
When the sandbox itself fails (unreachable, the module trapped, ran out of fuel or time), a
fail-closed module (the default) fails the request with UNAVAILABLE and a fail-open one lets the
text through unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.errors import FailedPrecondition, NotFound, Unavailable
from cotserve.common.tls import aio_channel
from cotserve.common.tracing import RECONNECT_OPTIONS, client_interceptors
from cotserve.gateway.tenants import PermissionDenied, Tenant
from cotserve.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

log = logging.getLogger("cotserve.gateway.processors")
RUN_TIMEOUT_S = 15.0  # above the sandbox's largest wall-time limit (10 s)


@dataclass(slots=True)
class Processors:
    address: str | None
    fail_open: frozenset[str] = frozenset()
    tracer_provider: TracerProvider | None = None
    credentials: Any = None  # grpc.ChannelCredentials for a sandbox that speaks TLS (None: plaintext)
    _channel: grpc.aio.Channel | None = field(default=None, init=False)
    _stub: sandbox_pb2_grpc.SandboxServiceStub | None = field(default=None, init=False)

    def _client(self) -> sandbox_pb2_grpc.SandboxServiceStub:
        if self._stub is None:
            self._channel = aio_channel(self.address, self.credentials, options=RECONNECT_OPTIONS,
                                        interceptors=client_interceptors(self.tracer_provider))
            self._stub = sandbox_pb2_grpc.SandboxServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    @staticmethod
    def check_allowed(field_name: str, module: str, tenant: Tenant) -> None:
        """PERMISSION_DENIED unless the tenant may name `module` (checked before quota is spent on the request)."""
        if tenant.modules is not None and module not in tenant.modules:
            allowed = ", ".join(sorted(tenant.modules)) or "none"
            raise PermissionDenied(f"{field_name}: tenant {tenant.name!r} may not use module {module!r} (allowed: {allowed})")

    async def apply(self, field_name: str, module: str, text: str, tenant: Tenant, timeout_s: float | None) -> str:
        """Run `module` on `text`; return its output, or raise the request's error."""
        self.check_allowed(field_name, module, tenant)
        if self.address is None:  # the request names what this deployment cannot run: retrying will not help
            if module in self.fail_open:
                log.warning("%s %s failed open: no sandbox service is configured", field_name, module)
                return text
            raise FailedPrecondition(f"{field_name}: module {module!r} cannot run: this gateway has no sandbox service "
                                     "(--sandbox)")
        try:
            resp = await self._client().Run(sandbox_pb2.RunRequest(name=module, input=text.encode()),
                                            timeout=min(RUN_TIMEOUT_S, timeout_s) if timeout_s else RUN_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"{field_name}: module {module!r} is not registered in the sandbox") from None
            if err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED) and timeout_s is not None \
                    and timeout_s < RUN_TIMEOUT_S:
                raise  # the client's own deadline: let it surface as such
            # the details can name the sandbox's address: they go to the log, the client gets the code
            log.warning("%s %s: sandbox call failed: %s: %s", field_name, module, err.code().name, err.details())
            return self._failed(field_name, module, text, f"the sandbox service answered {err.code().name}")
        if resp.outcome == sandbox_pb2.RUN_OUTCOME_OK:
            return resp.output.decode(errors="replace")
        if resp.outcome == sandbox_pb2.RUN_OUTCOME_EXIT_NONZERO and resp.exit_code == 1:
            reason = resp.output.decode(errors="replace").strip() or "rejected"
            raise PermissionDenied(f"{field_name}: {module} rejected the request: {reason}")
        outcome = sandbox_pb2.RunOutcome.Name(resp.outcome).removeprefix("RUN_OUTCOME_")
        return self._failed(field_name, module, text, f"module ended with {outcome} (exit {resp.exit_code})")

    def _failed(self, field_name: str, module: str, text: str, why: str) -> str:
        if module in self.fail_open:
            log.warning("%s %s failed open: %s", field_name, module, why)
            return text
        raise Unavailable(f"{field_name}: {module} failed and is fail-closed: {why}")

