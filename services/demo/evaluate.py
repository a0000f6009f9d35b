"""Exact-answer accuracy of a served demo model, asked through the worker's gRPC API."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import grpc

from cotserve.common.v1 import common_pb2
from cotserve.demo.arithmetic import Problem, parse_answer, problems
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc


@dataclass(slots=True, frozen=True)
class EvalResult:
    correct: int
    total: int
    seconds: float
    wrong: tuple[tuple[str, str], ...]  # (prompt, completion) of each miss

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


async def ask(stub: worker_pb2_grpc.WorkerServiceStub, prompt: str, max_new_tokens: int = 96) -> str:
    req = worker_pb2.GenerateRequest(prompt_text=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens))
    return "".join([chunk.text async for chunk in stub.Generate(req)])


async def evaluate(address: str, *, n: int = 500, seed: int = 12345, concurrency: int = 32,
                   progress: bool = False, sample: list[Problem] | None = None) -> EvalResult:
    todo = sample if sample is not None else problems(seed, n)
    sem = asyncio.Semaphore(concurrency)
    done = 0
    wrong: list[tuple[str, str]] = []
    start = time.monotonic()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)

        async def one(p: Problem) -> bool:
            nonlocal done
            async with sem:
                text = await ask(stub, p.prompt)
            done += 1
            if progress and done % 50 == 0:
                print(f"  {done}/{len(todo)} asked", file=sys.stderr, flush=True)
            ok = parse_answer(text) == p.answer
            if not ok:
                wrong.append((p.prompt, text))
            return ok

        results = await asyncio.gather(*(one(p) for p in todo))
    return EvalResult(sum(results), len(todo), time.monotonic() - start, tuple(wrong))
