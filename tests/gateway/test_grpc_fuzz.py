"""Every request message of the gateway's gRPC API fuzzed end to end: hypothesis builds messages field by field from
their descriptors (every scalar over its whole range, NaN and infinities, unknown enum values, nested messages,
repeated fields), a tenant with an API key and limits sends them to a real gateway (quotas in a real Redis) in front
of a real worker. No message gets INTERNAL or UNKNOWN; afterwards the worker holds no KV block and no sequence, and
the tenant no concurrency lease. Bounded and derandomized here; `make fuzz` runs it longer with a fresh seed."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cotserve.common.procs import free_port, redis_child, wait_serving
from cotserve.common.sampling import SlaClass
from cotserve.gateway.tenants import add_key
from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import start_gateway, start_worker, stop_process, wait_worker_idle
from tests.gateway.test_hostile import _code

EXAMPLES = int(os.environ.get("COTSERVE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="COTSERVE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=list(HealthCheck))
_INTS = {F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
         F.TYPE_UINT32: (0, (1 << 32) - 1), F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
         F.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1), F.TYPE_UINT64: (0, (1 << 64) - 1)}
_SMALL = st.integers(-3, 70)  # values near the ranges' edges matter more than the far reaches


def _scalar(field) -> st.SearchStrategy:
    if field.type in _INTS:
        lo, hi = _INTS[field.type]
        return _SMALL.filter(lambda v: lo <= v <= hi) | st.integers(lo, hi)
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == F.TYPE_FLOAT else 64) | st.sampled_from([0.0, 0.5, 1.0, 2.0])
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:  # the demo model's prompts, a served name, and anything else (valid UTF-8)
        return st.sampled_from(["37+48-12=", "1+1=", "cotserve-demo", "user", "strip-think", ""]) | st.text(max_size=40)
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=20)
    if field.type == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-2, 99)
    raise AssertionError(f"no strategy for {field.full_name}")


def message(descriptor, depth: int = 3) -> st.SearchStrategy:
    """Dicts of some of `descriptor`'s fields (at most one per oneof), each over its type's whole range."""
    optional = {}
    for field in descriptor.fields:
        if field.type == F.TYPE_MESSAGE:
            if depth == 0 or field.message_type.GetOptions().map_entry:
                continue
            value = message(field.message_type, depth - 1)
        else:
            value = _scalar(field)
        optional[field.name] = st.lists(value, max_size=3) if field.is_repeated else value

    def one_per_oneof(fields: dict) -> dict:
        for oneof in descriptor.oneofs:
            for extra in [f.name for f in oneof.fields if f.name in fields][1:]:
                del fields[extra]
        return fields

    return st.fixed_dictionaries({}, optional=optional).map(one_per_oneof)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpc-fuzz")
    tenants = folder / "tenants.toml"
    key = add_key(tenants, "fuzz", frozenset(SlaClass), max_concurrent=8, requests_per_min=1_000_000,
                  tokens_per_min=1_000_000_000)
    child, url = redis_child(free_port())
    child.start()
    wait_serving(child, 10, lambda: None)
    worker, worker_address = start_worker("--max-num-seqs", "16")
    gateway, address = start_gateway(worker_address, extra=("--tenants-file", str(tenants), "--redis-url", url))
    try:
        yield address, worker_address, key, url
    finally:
        stop_process(gateway)
        stop_process(worker)
        child.stop(grace_s=5)


def assert_no_lease(url: str) -> None:
    """The fuzz tenant holds no concurrency lease (each is released as its call ends: wait for the last one)."""
    import redis

    leases = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while leases.zcard("cotserve:quota:fuzz:concurrent") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leases.zcard("cotserve:quota:fuzz:concurrent") == 0


BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}


@pytest.mark.parametrize("rpc,request_cls", [("GenerateStream", gateway_pb2.GenerateStreamRequest),
                                             ("Generate", gateway_pb2.GenerateRequest),
                                             ("Tokenize", gateway_pb2.TokenizeRequest)])
def test_no_request_message_gets_an_internal_error_or_leaves_anything_behind(stack, rpc, request_cls):
    address, worker, key, url = stack
    codes: dict[str, int] = {}

    async def call(request) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as channel:
            method = getattr(gateway_pb2_grpc.GatewayServiceStub(channel), rpc)
            code, _ = await _code(lambda: method(request, metadata=(("authorization", f"Bearer {key}"),), timeout=30))
            return code

    @FUZZ
    @given(message(request_cls.DESCRIPTOR))
    def run(fields):
        code = asyncio.run(call(request_cls(**fields)))  # nested messages from nested dicts
        codes[code.name] = codes.get(code.name, 0) + 1
        assert code not in BAD, (code, fields)

    run()
    assert "OK" in codes and len(codes) > 1, codes  # both served and refused messages were tried
    wait_worker_idle(worker, timeout_s=30)  # no KV block, no sequence left behind
    assert_no_lease(url)


def test_no_session_message_ends_a_stream_or_the_call_with_an_internal_error(stack):
    """Session calls of one to four messages (opens with any GenerateStreamRequest, any ids and deadlines, and
    cancels), half-closed, read to their end: no stream ends INTERNAL or UNKNOWN, nor the call; afterwards nothing is
    left on the worker and no lease on the tenant."""
    address, worker, key, url = stack
    ends: dict[str, int] = {}

    async def session(messages) -> str:
        async with grpc.aio.insecure_channel(address) as channel:
            call = gateway_pb2_grpc.GatewayServiceStub(channel).Session(
                iter(messages), metadata=(("authorization", f"Bearer {key}"),), timeout=30)
            try:
                async for response in call:
                    for chunk in response.chunks:
                        if chunk.HasField("end"):
                            ends[chunk.end.code] = ends.get(chunk.end.code, 0) + 1
                            assert chunk.end.code not in {c.name for c in BAD}, (chunk.end, messages)
            except grpc.aio.AioRpcError as err:
                return err.code().name
        return "OK"

    @FUZZ
    @given(st.lists(message(gateway_pb2.SessionRequest.DESCRIPTOR), min_size=1, max_size=4))
    def run(fields):
        code = asyncio.run(session([gateway_pb2.SessionRequest(**f) for f in fields]))
        assert code not in {c.name for c in BAD}, (code, fields)

    run()
    assert "OK" in ends and len(ends) > 1, ends  # streams both served and refused
    wait_worker_idle(worker, timeout_s=30)
    assert_no_lease(url)
