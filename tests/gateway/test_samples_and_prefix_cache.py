"""Parallel samples and the prefix cache end to end: a worker, gateways in tenant and global
scope, spoken to through the SDK and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cotserve.gateway.tenants import add_key
from cotserve.sdk import Client, DeadlineExceeded, InvalidArgument
from tests.conftest import start_gateway, start_worker, stop_process, wait_worker_idle, worker_stats

# 41 tokens with the demo tokenizer (each integer and operator is one token): two full KV blocks
LONG = "+".join(str(i) for i in range(1, 21)) + "="


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One worker; a gateway per prefix-cache scope, with two tenants."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    keys = {name: add_key(path, name) for name in ("alpha", "beta")}
    worker, waddr = start_worker("--max-num-seqs", "16")
    tenant_gw, taddr = start_gateway(waddr, extra=("--tenants-file", str(path)))
    global_gw, gaddr = start_gateway(waddr, extra=("--tenants-file", str(path), "--prefix-cache-scope", "global"))
    yield {"worker": waddr, "tenant": taddr, "global": gaddr, "keys": keys}
    for proc in (global_gw, tenant_gw, worker):
        stop_process(proc)


def client(stack, scope="tenant", tenant="alpha"):
    return Client(stack[scope], api_key=stack["keys"][tenant], timeout_s=60)


def test_n_samples_with_a_seed_are_the_separate_requests_with_seed_plus_i(stack):
    with client(stack) as c:
        # (at temperature 2: the demo model is too sure of itself for samples to differ at 1)
        r = c.generate("12+30-7+5=", n=4, temperature=2.0, seed=11, max_new_tokens=20, ignore_eos=True)
        alone = [c.generate("12+30-7+5=", temperature=2.0, seed=11 + i, max_new_tokens=20, ignore_eos=True) for i in range(4)]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.token_ids for ch in r.choices] == [a.token_ids for a in alone]
    assert [ch.text for ch in r.choices] == [a.text for a in alone]
    assert len({tuple(ch.token_ids) for ch in r.choices}) > 1
    assert (r.text, r.token_ids, r.finish_reason) == (r.choices[0].text, r.choices[0].token_ids, "length")
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens and r.usage.completion_tokens == 4 * 20


def test_a_stream_of_samples_carries_indexes_finish_reasons_and_one_usage(stack):
    with client(stack) as c:
        chunks = list(c.stream("37+48-12=", n=3, temperature=0.8, seed=3, max_new_tokens=40))
        unary = c.generate("37+48-12=", n=3, temperature=0.8, seed=3, max_new_tokens=40)
    assert {ch.index for ch in chunks} == {0, 1, 2}
    for i in range(3):
        mine = [ch for ch in chunks if ch.index == i]
        assert "".join(ch.text for ch in mine) == unary.choices[i].text
        assert [ch.finish_reason for ch in mine][:-1] == [None] * (len(mine) - 1) and mine[-1].finish_reason == "stop"
    assert [ch.usage is not None for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage.completion_tokens == sum(len(ch.token_ids) for ch in chunks) and chunks[-1].timing.total_ms > 0
    for i in range(3):
        assert [t for ch in chunks if ch.index == i for t in ch.token_ids] == unary.choices[i].token_ids


def test_tenants_never_hit_each_others_cached_blocks(stack):
    with client(stack, tenant="alpha") as a, client(stack, tenant="beta") as b:
        first = a.generate(LONG, max_new_tokens=2).usage
        again = a.generate(LONG, max_new_tokens=2).usage
        other = b.generate(LONG, max_new_tokens=2).usage
        other_again = b.generate(LONG, max_new_tokens=2).usage
        salted = a.generate(LONG, max_new_tokens=2, cache_salt="private").usage
    assert first.prompt_tokens == 41
    assert (first.cached_prompt_tokens, again.cached_prompt_tokens) == (0, 32)
    assert (other.cached_prompt_tokens, other_again.cached_prompt_tokens) == (0, 32)  # beta computed its own
    assert salted.cached_prompt_tokens == 0  # a request's salt narrows sharing further


def test_global_scope_shares_across_tenants(stack):
    prompt = "9+" + LONG
    with client(stack, "global", "alpha") as a, client(stack, "global", "beta") as b:
        assert a.generate(prompt, max_new_tokens=2).usage.cached_prompt_tokens == 0
        assert b.generate(prompt, max_new_tokens=2).usage.cached_prompt_tokens == 32


@pytest.mark.parametrize("kwargs,message", [
    ({"n": 0}, "sampling.n: 0 is out of range (1..16)"),
    ({"n": 17}, "sampling.n: 17 is out of range (1..16)"),
    ({"cache_salt": "x" * 257}, "cache_salt: 257 characters, at most 256 allowed"),
])
def test_bad_options_name_the_field(stack, kwargs, message):
    with client(stack) as c, pytest.raises(InvalidArgument) as err:
        c.generate("1+1=", **kwargs)
    assert err.value.message == message


def test_cancel_and_deadline_free_every_sample_and_the_stats_count_the_cache(stack):
    before = worker_stats(stack["worker"])
    with client(stack) as c:
        stream = c.stream(LONG, n=4, temperature=1.0, max_new_tokens=200, ignore_eos=True)
        seen = {next(stream).index for _ in range(12)}
        stream.close()  # cancels all four samples
        assert seen == {0, 1, 2, 3}
        wait_worker_idle(stack["worker"])
        with pytest.raises(DeadlineExceeded):
            # 200 steps of four samples take at least ~0.2 s: the deadline falls mid-generation
            c.generate(LONG, n=4, temperature=1.0, max_new_tokens=200, ignore_eos=True, timeout_s=0.05)
    stats = wait_worker_idle(stack["worker"])
    assert stats.prefix_cache_hit_tokens_total > before.prefix_cache_hit_tokens_total
    assert stats.prefix_cache_queried_tokens_total > before.prefix_cache_queried_tokens_total
    assert stats.prefix_cache_blocks >= 2 and stats.kv_blocks_used_peak > 0
    assert stats.prompt_tokens_computed_total > before.prompt_tokens_computed_total


def test_cli_generate_n(stack):
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "37+48-12=", "--address", stack["tenant"],
                          "--n", "3", "--temperature", "0.8", "--seed", "3", "--api-key", stack["keys"]["alpha"]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line[:3] for line in lines[:3]] == ["[0]", "[1]", "[2]"] and all(line.endswith("(stop)") for line in lines[:3])
    assert lines[3].startswith("[stop, stop, stop | 6 prompt + ")
