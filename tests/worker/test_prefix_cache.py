"""The block manager's prefix cache (no torch): hits, salts, LRU eviction, pending blocks, and a
randomized stress test against a reference model of what each physical block holds."""

from __future__ import annotations

import random

import pytest

from cotserve.common.sampling import SamplingParams
from cotserve.worker.block_manager import RELEASED, BlockManager, cache_root, window_start
from cotserve.worker.scheduler import Scheduler
from cotserve.worker.sequence import Sequence, SequenceStatus

BS = 4


def make_seq(tokens, salt="", max_new_tokens=8, name="s"):
    seq = Sequence(name, list(tokens), SamplingParams(max_new_tokens=max_new_tokens))
    seq.cache_root = cache_root("model", salt)
    return seq


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` with whatever the cache holds, compute its whole prompt; returns tokens computed."""
    hit = bm.find_cached(seq)
    bm.allocate(seq, len(seq), hit)
    computed = len(seq) - seq.num_computed_tokens
    seq.num_computed_tokens = len(seq)
    bm.register_computed(seq)
    return computed


def test_second_sequence_reuses_the_full_blocks_and_computes_the_rest():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = make_seq(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert prefill(bm, a) == 10
    b = make_seq([*range(8), 50, 51, 52])
    assert prefill(bm, b) == 3  # the two full blocks came from the cache
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_hit_tokens == 8 and bm.num_queried_tokens == 21
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2  # b's 3rd block is partial: never cached


def test_the_last_token_is_always_computed_so_a_cached_block_is_never_written():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = make_seq(range(8))
    prefill(bm, a)
    bm.free(a)
    same = make_seq(range(8))
    hit = bm.find_cached(same)
    assert len(hit.blocks) == 1  # 8 tokens = 2 full blocks, but the second holds the last token
    assert prefill(bm, same) == 4


def test_salts_and_other_models_never_share_blocks():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    prefill(bm, make_seq(range(12), salt="tenant:a"))
    assert bm.find_cached(make_seq(range(12), salt="tenant:b")).blocks == ()
    other_model = Sequence("x", list(range(12)), SamplingParams())
    other_model.cache_root = cache_root("other-model", "tenant:a")
    assert bm.find_cached(other_model).blocks == ()
    assert len(bm.find_cached(make_seq(range(12), salt="tenant:a")).blocks) == 2


def test_disabled_cache_finds_nothing_and_counts_nothing():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    prefill(bm, make_seq(range(12)))
    assert bm.find_cached(make_seq(range(12))).blocks == ()
    assert bm.num_cached_blocks == 0 and bm.num_queried_tokens == 0


def test_free_blocks_are_reused_uncached_first_then_least_recently_used():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    old = make_seq(range(100, 108))
    new = make_seq(range(200, 208))
    prefill(bm, old)
    bm.free(old)
    prefill(bm, new)
    bm.free(new)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    # 4 fresh blocks needed, 2 of them uncached: then old's blocks go (its last block first), new's stay
    filler = make_seq(range(300, 316), name="filler")
    filler.cache_root = cache_root("model", "elsewhere")
    bm.allocate(filler, 16)
    assert bm.num_evictions == 2
    assert len(bm.find_cached(make_seq(range(200, 208))).blocks) == 1  # new's chain is whole
    assert bm.find_cached(make_seq(range(100, 108))).blocks == ()  # old's first block is gone
    bm.free(filler)


def test_a_block_being_computed_makes_the_next_sequence_wait_instead_of_computing_it_twice():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(range(13), name="a"), make_seq(range(13), name="b")
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [i.seq for i in first.items] == [a]  # b's blocks are a's, being computed now
    sched.advance(first)
    a.output_ids.append(7)  # the token the engine sampled
    second = sched.schedule()
    by_seq = {i.seq.request_id: i.num_tokens for i in second.items}
    assert by_seq == {"a": 1, "b": 1}  # a decodes; b computes only its last token: 12 came from the cache
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]


def test_preempted_sequence_is_readmitted_from_its_cached_blocks():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seq = make_seq(range(10))
    sched.add(seq)
    sched.advance(sched.schedule())
    seq.output_ids += [1, 2, 3]  # 13 tokens, 12 computed: three full blocks
    sched.advance(sched.schedule())
    sched._preempt(seq)
    assert seq.status == SequenceStatus.PREEMPTED and seq.num_computed_tokens == 0
    batch = sched.schedule()
    assert batch.items[0].num_tokens == 1  # the 12 tokens of three full blocks come back from the cache


def test_compaction_keeps_cached_blocks_findable():
    bm = BlockManager(12, BS, enable_prefix_caching=True)
    spacer = make_seq(range(500, 512), name="spacer")
    spacer.cache_root = cache_root("model", "spacer")
    bm.allocate(spacer, 12)
    keep = make_seq(range(9))
    prefill(bm, keep)
    bm.free(spacer)
    bm.compact([keep])
    assert sorted(keep.block_table) == [0, 1, 2]
    assert bm.find_cached(make_seq(range(9))).blocks == tuple(keep.block_table[:2])
    bm.free(keep)
    assert bm.num_free_blocks == 12


class PoolModel:
    """What each physical block holds, advanced by the same copies and writes the runner would do."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.content: dict[int, list[int | None]] = {b: [None] * bm.block_size for b in range(bm.num_blocks)}
        self.tokens_of_hash: dict[bytes, tuple[int, ...]] = {}

    def run_copies(self) -> None:
        for src, dst in self.bm.take_copies():
            self.content[dst] = list(self.content[src])

    def compute(self, seq: Sequence, upto: int) -> None:
        """Write tokens num_computed..upto-1 of `seq` into their slots, as a forward pass would."""
        self.run_copies()
        bs = self.bm.block_size
        for pos in range(seq.num_computed_tokens, upto):
            for table in self.bm.tables(seq):  # each KV group's page of the token
                block = table[pos // bs]
                assert self.bm._ref_counts[block] == 1, f"block {block} written while shared"
                assert block not in self.bm._hash_of, f"cached block {block} written"
                self.content[block][pos % bs] = seq.all_token_ids[pos]
        seq.num_computed_tokens = upto
        self.bm.register_computed(seq)
        for i, h in enumerate(seq.block_hashes):
            self.tokens_of_hash[h] = tuple(seq.all_token_ids[i * bs:(i + 1) * bs])

    def check(self, live: list[Sequence]) -> None:
        bm = self.bm
        refs = [0] * bm.num_blocks
        for seq in live:
            for table, window in zip(bm.tables(seq), bm.windows, strict=True):
                # a sliding group holds exactly the pages its next query's window reaches
                first = window_start(window, seq.num_computed_tokens, bm.block_size)
                assert all(b == RELEASED for b in table[:first]) and RELEASED not in table[first:]
                for b in table[first:]:
                    refs[b] += 1
                for pos in range(first * bm.block_size, seq.num_computed_tokens):  # each computed token where it says
                    assert self.content[table[pos // bm.block_size]][pos % bm.block_size] == seq.all_token_ids[pos]
        assert refs == bm._ref_counts, "reference counts differ from the tables"
        assert sorted(bm._free) == [b for b in range(bm.num_blocks) if refs[b] == 0], "free list is not the unheld blocks"
        for key, b in bm._cached.items():
            assert bm._hash_of[b] == key
            assert tuple(self.content[b]) == self.tokens_of_hash[key[1]], f"cached block {b} holds other tokens"


@pytest.mark.parametrize("windows", [(None,), (None, 6), (5, None, 9)], ids=["one-group", "full+window",
                                                                          "windows+full"])
def test_randomized_allocate_fork_write_free_evict_against_a_reference_model(windows):
    """With KV groups (`windows`: full-attention and sliding-window groups, a block table each) the same, and each
    sliding group's table holds exactly its window's pages after every step."""
    rng = random.Random(1234)
    bm = BlockManager(40 * len(windows), BS, enable_prefix_caching=True, windows=windows)
    pool = PoolModel(bm)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    live: list[Sequence] = []
    evictions_seen = fast_paths = 0
    for op in range(3000):
        choice = rng.random()
        if choice < 0.3 or not live:  # admit a new sequence, often sharing a prefix
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            seq = make_seq(tokens, salt=rng.choice(["a", "b"]), name=f"n{op}")
            hit = bm.find_cached(seq)
            for blocks in (hit.blocks, *hit.others):  # a hit returns blocks holding exactly these tokens
                for i, b in enumerate(blocks):
                    assert b == RELEASED or tuple(pool.content[b]) == tuple(tokens[i * BS:(i + 1) * BS])
            if bm.can_allocate(seq, len(seq), hit):
                bm.allocate(seq, len(seq), hit)
                pool.compute(seq, len(seq))
                live.append(seq)
        elif choice < 0.65:  # decode one token
            seq = rng.choice(live)
            seq.output_ids.append(rng.randrange(50))
            in_place = bm.fits_in_place(seq, len(seq))
            fast_paths += in_place
            before = ([list(t) for t in bm.tables(seq)], bm.num_free_blocks, len(bm.pending_copies), dict(bm._pending))
            if bm.can_allocate(seq, len(seq)):
                bm.allocate(seq, len(seq))
                # the scheduler skips allocate when the token fits in place: it must have changed nothing
                assert not in_place or before == (bm.tables(seq), bm.num_free_blocks, len(bm.pending_copies),
                                                  bm._pending)
                pool.compute(seq, len(seq))
            else:
                seq.output_ids.pop()
        elif choice < 0.8:  # fork a sample
            parent = rng.choice(live)
            child = Sequence(f"c{op}", parent.all_token_ids, parent.params)
            bm.fork(parent, child)
            live.append(child)
        elif choice < 0.98:  # finish, cancel or preempt: all the same to the pool
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        else:
            bm.compact(live)
            pool.run_copies()  # (moves: content follows the block)
        evictions_seen = bm.num_evictions
        pool.check(live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
    # the run exercised eviction and hits (fewer with a sliding group: a hit needs the window's pages of the prefix's
    # end, which live sequences give back as they grow past them, where a full group's stay held)
    assert evictions_seen > 50 and bm.num_hit_tokens > (1000 if windows == (None,) else 150)
    assert fast_paths > 100  # and decode tokens that fit in place


def test_a_decode_token_fits_in_place_only_in_its_own_unshared_block_that_it_does_not_fill():
    """The scheduler's O(1) check before it skips `allocate`: a token inside the sequence's last block fits; one that
    needs a new block, writes into a block shared with a fork, or fills a block (with the prefix cache on: other
    sequences must learn it is being computed) does not."""
    for caching in (True, False):
        bm = BlockManager(16, BS, enable_prefix_caching=caching)
        seq = make_seq(range(5))  # blocks [0..3] full, [4] partial
        prefill(bm, seq)
        assert bm.fits_in_place(seq, 6) and bm.fits_in_place(seq, 7)  # positions 5 and 6, in block 1
        assert bm.fits_in_place(seq, 8) == (not caching)  # position 7 fills block 1
        assert not bm.fits_in_place(seq, 9)  # positions 5..8: into block 2, not held yet
        child = Sequence("child", seq.all_token_ids, seq.params)
        bm.fork(seq, child)
        assert not bm.fits_in_place(seq, 6) and not bm.fits_in_place(child, 6)  # block 1 is shared now
