"""The block manager's own contract, without the prefix cache (tests/worker/test_prefix_cache.py has that): pages
allocated as tokens need them, reference counts through forks, copy-on-write planned before a shared page is
written, every page back after `free`, and refusals that say what is wrong. No torch, no grpc."""

from __future__ import annotations

import pytest

from cotserve.worker.block_manager import RELEASED, BlockManager, capacity_tokens, peak_blocks
from cotserve.worker.sequence import SamplingParams, Sequence


def seq(n: int, name: str = "s") -> Sequence:
    return Sequence(name, list(range(1, n + 1)), SamplingParams(max_new_tokens=16))


def test_pages_follow_the_tokens_and_all_come_back():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(5)
    assert bm.blocks_needed(5) == 2 and bm.num_new_blocks(s, 5) == 2
    bm.allocate(s, 5)
    assert len(s.block_table) == 2 and bm.num_used_blocks == 2 and bm.num_free_blocks == 6
    s.num_computed_tokens = 5
    bm.allocate(s, 8)  # the rest of its second page: nothing new
    assert len(s.block_table) == 2
    bm.allocate(s, 9)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    bm.free(s)
    assert s.block_table == [] and s.num_computed_tokens == 0 and bm.num_free_blocks == 8
    bm.free(s)  # again: nothing held, nothing changes
    assert bm.num_free_blocks == 8


def test_a_fork_shares_pages_and_the_first_write_into_a_shared_page_copies_it_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(6, "p")
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = seq(6, "c")
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.num_used_blocks == 2
    assert child.num_computed_tokens == 6
    bm.allocate(child, 7)  # token 7 goes into the shared second page: the child gets its own copy
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert bm.take_copies() == [(parent.block_table[1], child.block_table[1])] and bm.take_copies() == []
    assert bm.num_used_blocks == 3
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_refusals_say_what_is_wrong():
    bm = BlockManager(num_blocks=2, block_size=4)
    big = seq(12)
    assert not bm.can_allocate(big, 12)
    with pytest.raises(RuntimeError, match="out of KV blocks: need 3, 2 free"):
        bm.allocate(big, 12)
    assert bm.num_free_blocks == 2  # nothing taken by the failed call
    a, b = seq(4, "a"), seq(4, "b")
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    with pytest.raises(RuntimeError, match="fork: child b already holds blocks"):
        bm.fork(a, b)
    b.block_table.append(a.block_table[0])  # a table that claims a page twice
    bm.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(b)


def test_a_sliding_window_group_gives_back_the_pages_no_query_reads_and_a_fork_shares_what_is_left():
    """Two KV groups from one pool: full attention, and a window of 6 tokens (pages of 4). After each step the sliding
    table keeps the pages from the one holding the next query's oldest visible key; a fork shares exactly those, and
    `free` returns the rest."""
    bm = BlockManager(num_blocks=20, block_size=4, windows=(None, 6))
    s = seq(14)
    bm.allocate(s, 14)
    assert bm.num_used_blocks == 8  # 4 pages in each group while the prompt is computed: its queries read them all
    s.num_computed_tokens = 14
    bm.register_computed(s)  # the query at 14 sees keys 9-14: pages 2 and 3 of the sliding group
    full, sliding = bm.tables(s)
    assert sliding[:2] == [RELEASED, RELEASED] and RELEASED not in sliding[2:] and RELEASED not in full
    assert bm.num_used_blocks == 6 and bm.num_held_blocks(s) == 6
    child = seq(14, "c")
    bm.fork(s, child)
    assert bm.tables(child) == [full, sliding] and bm.num_used_blocks == 6
    bm.allocate(child, 15)  # its token 15 writes into the shared page 3 of each group: copies of both
    assert len(bm.take_copies()) == 2 and bm.num_used_blocks == 8
    child.num_computed_tokens = 15
    bm.register_computed(child)  # the query at 15 sees keys 10-15: still pages 2 and 3
    assert bm.tables(child)[1][2] == sliding[2]
    bm.free(s)
    bm.free(child)
    assert bm.num_free_blocks == 20


def test_the_pool_holds_a_longer_sequence_when_a_sliding_group_keeps_only_its_window():
    """`peak_blocks`: every page in a full-attention group, at most a window and a chunk of pages in a sliding one;
    `capacity_tokens` the longest sequence a pool holds alone (the engine refuses longer requests)."""
    assert peak_blocks((None,), 4, 100, 8) == 25
    assert peak_blocks((None, 8), 4, 100, 8) == 25 + 5  # (8 + 8) / 4 + 1: the window and a chunk of queries
    assert peak_blocks((None, 8), 4, 6, 8) == 2 + 2  # a short sequence: its own pages
    assert capacity_tokens(25, 4, (None,), 8) == 100
    assert capacity_tokens(30, 4, (None, 8), 8) == 100
    assert capacity_tokens(50, 4, (8, 8), 8) > 10**9  # only windows: any length once they fit
    assert capacity_tokens(9, 4, (8, 8), 8) == 16  # else as many pages as each group can have
