"""Copy-on-write forks and page compaction: the block manager plans block copies, the runner executes
them with the `copy_blocks` kernel (the torch reference, and the Triton kernel under the
interpreter), and the sequences' next logits are exactly what they would be without the fork or the
move."""

from __future__ import annotations

import os

import pytest
import torch

from cotserve.common.sampling import SamplingParams
from cotserve.kernels import dispatch
from cotserve.worker.block_manager import BlockManager
from cotserve.worker.kv_spec import KvCacheSpec
from cotserve.worker.model_runner import ModelRunner
from cotserve.worker.models.loader import load_model
from cotserve.worker.scheduler import ScheduledBatch, ScheduledSeq
from cotserve.worker.sequence import Sequence
from cotserve.worker.config import DEMO_MODEL

BS = 16
FP8 = torch.float8_e4m3fn


def kernel_sets():
    sets = [pytest.param(dispatch.REFERENCE, id="reference")]
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        sets.append(pytest.param("triton", id="triton"))
    return sets


@pytest.fixture(scope="module")
def loaded():
    return load_model(DEMO_MODEL, device=torch.device("cpu"))


def runner_for(loaded, kernels, num_blocks=12, kv_dtype=FP8, topk=2):
    runner = ModelRunner(loaded, num_blocks, KvCacheSpec.resolve(loaded.config, loaded.dtype, kv_dtype, BS, topk_pages=topk))
    object.__setattr__(runner, "kernels", dispatch.triton_kernels() if kernels == "triton" else kernels)
    return runner


def step(runner, bm, seqs_tokens):
    """One forward pass: each (seq, n) computes n tokens; returns each sequence's next-token logits."""
    batch = ScheduledBatch()
    for seq, n in seqs_tokens:
        bm.allocate(seq, seq.num_computed_tokens + n)
        batch.items.append(ScheduledSeq(seq, n))
    batch.block_copies = bm.take_copies()
    logits = runner.execute(batch)
    for seq, n in seqs_tokens:
        seq.num_computed_tokens += n
    return logits


def new_seq(name, prompt):
    return Sequence(name, prompt_ids=list(prompt), params=SamplingParams())


PROMPT = list(range(10, 30))  # 20 tokens: the second page is partly filled and shared after the fork


def test_block_manager_fork_shares_then_copies_on_write():
    bm = BlockManager(8, BS)
    a = new_seq("a", PROMPT)
    bm.allocate(a, 20)
    a.num_computed_tokens = 20
    b = new_seq("b", PROMPT)
    bm.fork(a, b)
    assert b.block_table == a.block_table and bm.num_used_blocks == 2
    assert bm.num_new_blocks(b, 21) == 1  # writing token 21 lands in the shared second page
    b.output_ids.append(5)
    bm.allocate(b, 21)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.take_copies() == [(a.block_table[1], b.block_table[1])] and bm.take_copies() == []
    bm.free(a)
    assert bm.num_used_blocks == 2  # the first page still belongs to b
    bm.free(b)
    assert bm.num_free_blocks == 8
    with pytest.raises(RuntimeError, match="already holds"):
        c = new_seq("c", PROMPT)
        c.block_table = [3]
        bm.fork(b, c)


@pytest.mark.parametrize("kernels", kernel_sets())
def test_forked_sequences_decode_as_if_never_forked(loaded, kernels):
    runner = runner_for(loaded, kernels)
    bm = BlockManager(12, BS)
    a = new_seq("a", PROMPT)
    step(runner, bm, [(a, 20)])
    b = new_seq("b", PROMPT)
    bm.fork(a, b)
    a.output_ids.append(7)
    b.output_ids.append(9)
    got = step(runner, bm, [(a, 1), (b, 1)])
    assert a.block_table[1] != b.block_table[1]  # b wrote into its own copy of the shared page
    for _ in range(3):  # keep going: both sequences read their own pages
        a.output_ids.append(3)
        b.output_ids.append(4)
        got = torch.cat([got, step(runner, bm, [(a, 1), (b, 1)])])
    for seq, row in ((a, 0), (b, 1)):  # the same tokens on a fresh pool, no fork
        ref_runner, ref_bm = runner_for(loaded, kernels), BlockManager(12, BS)
        solo = new_seq("solo", seq.all_token_ids[:21])
        want = [step(ref_runner, ref_bm, [(solo, 21)])]
        for tok in seq.all_token_ids[21:]:
            solo.output_ids.append(tok)
            want.append(step(ref_runner, ref_bm, [(solo, 1)]))
        assert torch.allclose(got[row::2], torch.cat(want), atol=1e-4)


@pytest.mark.parametrize("kernels", kernel_sets())
def test_compaction_moves_pages_and_decode_is_unchanged(loaded, kernels):
    runner, bm = runner_for(loaded, kernels, num_blocks=10), BlockManager(10, BS)
    twin, twin_bm = runner_for(loaded, kernels, num_blocks=10), BlockManager(10, BS)
    seqs = {}
    for r, b in ((runner, bm), (twin, twin_bm)):
        x, y, z = new_seq("x", PROMPT), new_seq("y", list(range(40, 75))), new_seq("z", PROMPT[::-1])
        step(r, b, [(x, 20), (y, 35), (z, 20)])  # 2 + 3 + 2 blocks
        b.free(x)  # leaves a hole at the bottom of the pool
        seqs[b] = (y, z)
    y, z = seqs[bm]
    before = list(y.block_table) + list(z.block_table)
    moves = bm.compact([y, z])
    assert moves and sorted(y.block_table + z.block_table) == list(range(5))
    assert bm.num_free_blocks == 5 and sorted(dst for _, dst in moves) == sorted(set(range(5)) - set(before))
    for seq, tseq in zip((y, z), seqs[twin_bm]):
        seq.output_ids.append(11)
        tseq.output_ids.append(11)
    got = step(runner, bm, [(y, 1), (z, 1)])
    want = step(twin, twin_bm, [(s, 1) for s in seqs[twin_bm]])
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(RuntimeError, match="block references"):
        bm.compact([y])  # z's blocks would be orphaned
