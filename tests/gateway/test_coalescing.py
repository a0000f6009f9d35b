"""A reader that falls behind gets what was pending merged into fewer chunks, on both hops, nothing lost."""

from __future__ import annotations

import time

import grpc

from cotserve.common.v1 import common_pb2
from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

# a small HTTP/2 window and no growth: a reader that stops reading stops the sender after about 1 KB
SLOW_READER = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
NEW_TOKENS = 200


def slow_read(responses) -> list:
    """The first chunk, then nothing for a while (the model keeps generating), then the rest."""
    chunks = [next(responses)]
    time.sleep(2.0)
    chunks.extend(responses)
    return chunks


def sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


def test_a_slow_reader_of_the_gateway_gets_every_token_in_order_in_fewer_chunks(demo_gateway):
    with grpc.insecure_channel(demo_gateway, options=SLOW_READER) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        whole = stub.Generate(gateway_pb2.GenerateRequest(prompt="37+48-12=", sampling=sampling()), timeout=60)
        chunks = slow_read(stub.GenerateStream(gateway_pb2.GenerateStreamRequest(prompt="37+48-12=", sampling=sampling()),
                                               timeout=60))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == list(whole.token_ids) and len(tokens) == NEW_TOKENS
    assert [lp for c in chunks for lp in c.logprobs] == list(whole.logprobs)
    assert "".join(c.text for c in chunks) == whole.text
    assert len(chunks) < NEW_TOKENS / 2, f"{len(chunks)} chunks for {NEW_TOKENS} tokens: nothing was merged"
    assert max(len(c.token_ids) for c in chunks) > 10
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS and chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_slow_reader_of_the_worker_gets_every_token_in_order_in_fewer_chunks(demo_worker):
    req = worker_pb2.GenerateRequest(prompt_text="5+5=", sampling=sampling())
    with grpc.insecure_channel(demo_worker) as fast_ch:
        fast = list(worker_pb2_grpc.WorkerServiceStub(fast_ch).Generate(req, timeout=60))
    with grpc.insecure_channel(demo_worker, options=SLOW_READER) as ch:
        chunks = slow_read(worker_pb2_grpc.WorkerServiceStub(ch).Generate(req, timeout=60))
    assert [t for c in chunks for t in c.token_ids] == [t for c in fast for t in c.token_ids]
    assert "".join(c.text for c in chunks) == "".join(c.text for c in fast)
    assert len(chunks) < NEW_TOKENS / 2 and chunks[-1].usage.completion_tokens == NEW_TOKENS
    # parts never mix in one chunk: the reasoning chunks' texts end where the answer's begin
    parts = [c.part for c in chunks]
    assert parts == sorted(parts)  # reasoning (1) before answer (2), no interleaving
