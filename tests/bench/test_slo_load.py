"""`cotserve bench slo`'s load: the cycle's shape at any length, misses split by cause, and a surge prompt the
served model can take."""

from __future__ import annotations

import asyncio

import pytest

from cotserve.bench.isolation import RequestRecord
from cotserve.bench.slo import LoadResult, rates
from cotserve.common.sampling import SlaClass


@pytest.mark.parametrize("cycle_s", [60.0, 15.0])
def test_a_cycle_is_steady_then_a_ramp_then_a_burst_or_surge_then_a_drain_at_any_length(cycle_s):
    cap = 100.0
    at = lambda fraction, cycle=0: rates((cycle + fraction) * cycle_s, cap, cycle_s)  # noqa: E731
    assert at(0.1) == (30.0, 10.0, False)                                   # steady
    assert at(0.5) == pytest.approx((55.0, 20.0, False))                    # half way up the ramp
    assert at(0.7) == (90.0, 30.0, False)                                   # burst: 0.9 + 2 x 0.3 = 1.5 x capacity
    assert at(0.7, cycle=2) == (40.0, 30.0, True)                           # every third cycle: long prompts instead
    assert at(0.9) == (10.0, 5.0, False)                                    # drain
    if cycle_s == 60.0:  # the 60 s cycle keeps its old boundaries: 20 s, 40 s, 48 s
        assert rates(19.9, cap)[0] == 30.0 and rates(47.9, cap)[0] == 90.0 and rates(48.1, cap)[0] == 10.0


def test_misses_are_split_by_cause():
    result = LoadResult(1.0)
    records = [RequestRecord(ttft_ms=50.0, itl_ms=[5.0] * 10),             # on target
               RequestRecord(ttft_ms=1500.0, itl_ms=[5.0] * 10),           # first token late
               RequestRecord(ttft_ms=50.0, itl_ms=[500.0] * 10),           # tokens slow
               RequestRecord(error="INVALID_ARGUMENT"), RequestRecord(error="INVALID_ARGUMENT"),
               RequestRecord(error="RESOURCE_EXHAUSTED")]
    result.records = [(SlaClass.INTERACTIVE, r) for r in records]
    assert result.miss_causes(SlaClass.INTERACTIVE) == {"ttft": 1, "inter-token": 1, "failed INVALID_ARGUMENT": 2,
                                                        "failed RESOURCE_EXHAUSTED": 1}
    assert result.miss_rate(SlaClass.INTERACTIVE) == 5 / 6


def test_the_surge_prompt_fits_the_served_models_context(demo_gateway):
    """512 tokens do not fit the demo model's 256-token context with the answer: the surge's prompt takes what
    fits, so surge requests load the worker instead of being refused."""
    from cotserve.bench.slo import INTERACTIVE_NEW_TOKENS, _prompts
    from cotserve.sdk import AsyncClient

    async def main():
        short, long = await _prompts(demo_gateway)
        async with AsyncClient(demo_gateway) as client:
            (info,) = await client.list_models()
            n = len(await client.tokenize(long[0]))
            out = await client.generate(long[0], max_new_tokens=INTERACTIVE_NEW_TOKENS, ignore_eos=True)
        return info, n, out

    info, n, out = asyncio.run(main())
    assert info.max_context_tokens - INTERACTIVE_NEW_TOKENS - 8 <= n <= info.max_context_tokens - INTERACTIVE_NEW_TOKENS
    assert len(out.token_ids) == INTERACTIVE_NEW_TOKENS
