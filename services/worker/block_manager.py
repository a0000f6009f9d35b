"""Reference-counted KV pages with a prefix cache. No torch, no grpc.

Blocks are plain integers into the KV tensors that `ModelRunner` owns. `fork` shares a sequence's
blocks with a child (reference counts); the first write into a shared block gives the writer its
own copy (copy-on-write). `compact` moves live blocks into the lowest block ids. Both only plan:
the (source, destination) block copies wait in `pending_copies` until the runner executes them
with the `copy_blocks` kernel before the next forward pass, so a copy always happens before the
step that writes into the new block.

Prefix cache (as vLLM's): a full block is named by a hash chained over (its parent block's hash,
its token ids), rooted in the sequence's `cache_root` (model revision, KV format, salt: whatever
else decides the block's contents). Once computed, a full block is registered under its hash; when
its last holder lets go it stays in the pool, cached, until its space is needed. Free blocks are
kept in LRU order: blocks that hold nothing cached are reused first, then the least recently
freed cached block is evicted. A new (or preempted) sequence takes the longest chain of cached
blocks that starts its tokens and computes only the rest; at least its last token is always
computed (the step that samples needs its logits), so a cached block is never written into.
Blocks that a scheduled step is computing right now are *pending*: a sequence whose next block is
pending waits for it instead of computing the same tokens again in parallel.

KV groups (`kv_spec.KvGroup`: gpt-oss's sliding-window layers and its full-attention layers): each group's pages come
from this one pool and a sequence holds a table per group (`block_table`, then `group_tables`). A sliding-window
group gives a page back once no future query's window reaches it (`register_computed`); its table entry then reads
RELEASED. Blocks are cached per group; a prefix hit needs every page of the full-attention groups and, of a sliding
group, the pages the next query's window reaches.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from cotserve.worker.sequence import Sequence

RELEASED = -1
"""A block-table entry whose page a sliding-window group gave back: no query of the sequence reads it any more."""


def window_start(window: int | None, num_tokens: int, block_size: int) -> int:
    """The first page a query after `num_tokens` tokens still reads in a layer of `window` (0 for full attention)."""
    return 0 if window is None else max(0, num_tokens - window + 1) // block_size


def peak_blocks(windows: tuple[int | None, ...], block_size: int, num_tokens: int, chunk: int) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once, computed at most `chunk` tokens a step, over
    KV groups of these windows: every page in a full-attention group, a window and a chunk of pages in a sliding one."""
    pages = -(-num_tokens // block_size)
    return sum(pages if w is None else min(pages, -(-(w + chunk) // block_size) + 1) for w in windows)


def capacity_tokens(num_blocks: int, block_size: int, windows: tuple[int | None, ...], chunk: int) -> int:
    """The longest sequence a pool of `num_blocks` holds alone (`peak_blocks`); a pool of sliding-window groups only
    holds any length once it holds their windows."""
    if windows == (None,):
        return num_blocks * block_size
    if None not in windows and peak_blocks(windows, block_size, 1 << 62, chunk) <= num_blocks:
        return 1 << 62
    lo, hi = 0, num_blocks * block_size
    while lo < hi:  # the largest length that fits: peak_blocks grows with the length
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak_blocks(windows, block_size, mid, chunk) <= num_blocks else (lo, mid - 1)
    return lo


def long_rope_root(root: bytes) -> bytes:
    """The hash-chain root of a sequence longer than LongRoPE's original length: its pages hold keys rotated by the
    long factors, never a shorter sequence's (`Scheduler.append_token` recomputes one that grows past it)."""
    return block_hash(root, [-1])


def cache_root(*parts: object) -> bytes:
    """The root of a sequence's block-hash chain, from everything besides the tokens that decides
    a block's contents (model revision, KV cache format, salt, ...)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """A full block's name: its parent's hash (or the chain's root) and its tokens."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass(slots=True, frozen=True)
class CacheHit:
    """What the prefix cache holds of a sequence: `blocks` start its tokens, in order (the first KV group's pages;
    `others`: the other groups' pages of the same tokens, RELEASED out of a sliding window). `pending`: its next block
    is being computed by another sequence this very step (wait for it)."""

    blocks: tuple[int, ...] = ()
    pending: bool = False
    others: tuple[tuple[int, ...], ...] = ()


NO_HIT = CacheHit()


class BlockManager:
    """Allocates fixed-size KV blocks to sequences and caches full blocks by content.

    Invariants: a block is in the free list exactly when its reference count is 0, and
    `num_free_blocks + sum(blocks held) == num_blocks` (no leak, no double free); a registered
    (cached) block is never written: only blocks at or past a sequence's `num_computed_tokens`
    are, and registration covers computed full blocks only.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows  # each KV group's sliding window (None: full attention), a block table each
        self._sliding = any(w is not None for w in windows)
        self._ref_counts = [0] * num_blocks
        # LRU order, evicted from the front: uncached blocks first, then cached ones by age
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[tuple[int, bytes], int] = {}  # (KV group, block hash) -> block
        self._hash_of: dict[int, tuple[int, bytes]] = {}  # block -> its (group, hash), for every cached block
        self._pending: dict[bytes, int] = {}  # hash -> seq_id of the sequence computing it this step
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner has yet to do
        self.num_queried_tokens = 0  # tokens looked up at admission (prefix-cache statistics)
        self.num_hit_tokens = 0  # of those, found cached
        self.num_evictions = 0  # cached blocks whose space was taken for new contents

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: empty ones and cached ones (evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._hash_of)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block table of each KV group, in group order."""
        missing = len(self.windows) - 1 - len(seq.group_tables)
        if missing > 0:
            seq.group_tables.extend([] for _ in range(missing))
        return [seq.block_table, *seq.group_tables]

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds a reference to, every group's."""
        return sum(1 for table in self.tables(seq) for b in table if b != RELEASED)

    # ---- prefix cache ----------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The first `num_blocks` full-block hashes of `seq`'s tokens (kept on the sequence)."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            tokens, bs = seq.all_token_ids, self.block_size
            parent = hashes[-1] if hashes else seq.cache_root
            for i in range(len(hashes), num_blocks):
                parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
                hashes.append(parent)
        return hashes

    def find_cached(self, seq: Sequence) -> CacheHit:
        """The longest chain of cached blocks that starts `seq`'s tokens, leaving at least its last
        token to compute: every page of each full-attention group, and of each sliding-window group the pages its
        next query reads. Only for a sequence that holds no block (new or preempted)."""
        if not self.enable_prefix_caching or seq.block_table:
            return NO_HIT
        hashes = self._hashes(seq, (len(seq) - 1) // self.block_size)
        full = [g for g, w in enumerate(self.windows) if w is None]
        n = next((i for i, h in enumerate(hashes) if any((g, h) not in self._cached for g in full)), len(hashes))
        owner = self._pending.get(hashes[n]) if n < len(hashes) else None
        pending = owner is not None and owner != seq.seq_id
        while n and not all((g, hashes[i]) in self._cached for g, w in enumerate(self.windows) if w is not None
                            for i in range(window_start(w, n * self.block_size, self.block_size), n)):
            n -= 1
        if not n:
            return CacheHit(pending=pending)
        tables = tuple(tuple(self._cached[g, h] if i >= window_start(w, n * self.block_size, self.block_size)
                             else RELEASED for i, h in enumerate(hashes[:n])) for g, w in enumerate(self.windows))
        return CacheHit(tables[0], pending, tables[1:])

    def register_computed(self, seq: Sequence) -> None:
        """Cache `seq`'s full blocks that are computed now, then give back the pages of its sliding-window groups that
        no query of it reads any more (call after each step it was in)."""
        if self.enable_prefix_caching:
            self._register(seq)
        if self._sliding:
            self._release_out_of_window(seq)

    def _register(self, seq: Sequence) -> None:
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if seq.num_hashed_blocks >= num_full:
            return
        hashes = self._hashes(seq, num_full)
        tables = self.tables(seq)
        for i in range(seq.num_hashed_blocks, num_full):
            h = hashes[i]
            if self._pending.get(h) == seq.seq_id:
                del self._pending[h]
            for g, table in enumerate(tables):
                key, block = (g, h), table[i]
                if block != RELEASED and key not in self._cached and block not in self._hash_of:
                    self._cached[key] = block
                    self._hash_of[block] = key
        seq.num_hashed_blocks = num_full

    def _release_out_of_window(self, seq: Sequence) -> None:
        for table, window in zip(self.tables(seq), self.windows):
            if window is None:
                continue
            i = min(window_start(window, seq.num_computed_tokens, self.block_size), len(table)) - 1
            while i >= 0 and table[i] != RELEASED:  # newest first, down to what an earlier step gave back
                self._unref(table[i])
                table[i] = RELEASED
                i -= 1

    def _mark_pending(self, seq: Sequence, num_tokens: int) -> None:
        """The full blocks `seq` computes up to `num_tokens` this step, so others wait for them."""
        first, last = seq.num_computed_tokens // self.block_size, num_tokens // self.block_size
        if last > first:
            for h in self._hashes(seq, last)[first:last]:
                if (0, h) not in self._cached:
                    self._pending.setdefault(h, seq.seq_id)

    def _unmark_pending(self, seq: Sequence) -> None:
        if self._pending:
            for h in seq.block_hashes:
                if self._pending.get(h) == seq.seq_id:
                    del self._pending[h]

    def _unref(self, block: int) -> None:
        """One reference to `block` fewer; with none left it is free (a cached one after the uncached ones)."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
            if block not in self._hash_of:
                self._free.move_to_end(block, last=False)
        elif self._ref_counts[block] < 0:
            raise RuntimeError(f"block {block} freed twice")

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._cached[h]
            self.num_evictions += 1

    def _take_free(self) -> int:
        """An unreferenced block for new contents: the least recently used; its cached contents go."""
        block, _ = self._free.popitem(last=False)
        self._evict(block)
        return block

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (their contents stay with the sequences that hold them);
        returns how many were forgotten."""
        n = len(self._hash_of)
        self._cached.clear()
        self._hash_of.clear()
        for block in list(self._free):
            self._free.move_to_end(block, last=False)
        return n

    # ---- allocation ------------------------------------------------------------------------
    def num_new_blocks(self, seq: Sequence, num_tokens: int, hit: CacheHit = NO_HIT) -> int:
        """Free blocks `seq` must take so that its first `num_tokens` tokens have slots: new blocks,
        copies of shared blocks it is about to write into, and cached blocks of `hit` that nobody
        holds (they leave the free list too), every group's."""
        need = self.blocks_needed(num_tokens)
        if hit.blocks:
            return sum(max(0, need - len(blocks)) + sum(1 for b in blocks if b != RELEASED and self._ref_counts[b] == 0)
                       for blocks in (hit.blocks, *hit.others))
        return sum(max(0, need - len(table)) + len(self._shared_to_write(table, seq, num_tokens))
                   for table in self.tables(seq))

    def _shared_to_write(self, table: list[int], seq: Sequence, num_tokens: int) -> list[int]:
        """Indexes into `table` (one of `seq`'s) of shared blocks that tokens num_computed..num_tokens-1 write into."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(table), self.blocks_needed(num_tokens))
        return [i for i in range(first, last) if self._ref_counts[table[i]] > 1]

    def fits_in_place(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s tokens up to `num_tokens` go into the one block (of each group) it holds and writes now, not
        shared and not filled by them (so `allocate` would change nothing): most sequences of a decode step."""
        bs, first = self.block_size, seq.num_computed_tokens // self.block_size
        if first >= len(seq.block_table) or (num_tokens - 1) // bs != first:
            return False
        if self.enable_prefix_caching and num_tokens // bs != first:  # it fills the block: others wait for it
            return False
        return all(first < len(t) and self._ref_counts[t[first]] == 1 for t in self.tables(seq))

    def can_allocate(self, seq: Sequence, num_tokens: int, hit: CacheHit = NO_HIT) -> bool:
        return self.num_new_blocks(seq, num_tokens, hit) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int, hit: CacheHit = NO_HIT) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens. A sequence that holds no block first
        takes the cached blocks of `hit` (its `num_computed_tokens` jumps past them); a running one
        first gets its own copy of any shared block it is about to write into. Caller checks
        `can_allocate` first."""
        need = self.num_new_blocks(seq, num_tokens, hit)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        if not seq.block_table and self.enable_prefix_caching:
            self.num_queried_tokens += len(seq)
            self.num_hit_tokens += len(hit.blocks) * self.block_size
        tables = self.tables(seq)
        if hit.blocks:
            if seq.block_table:
                raise RuntimeError(f"allocate: {seq.request_id} holds blocks already; a cache hit is for admission")
            for table, blocks in zip(tables, (hit.blocks, *hit.others), strict=True):
                for block in blocks:
                    if block != RELEASED:
                        if self._ref_counts[block] == 0:
                            del self._free[block]
                        self._ref_counts[block] += 1
                table[:] = blocks
            seq.num_computed_tokens = seq.num_hashed_blocks = len(hit.blocks)
            seq.num_computed_tokens *= self.block_size
        for table in tables:
            for i in self._shared_to_write(table, seq, num_tokens):  # copy-on-write
                old, new = table[i], self._take_free()
                self._ref_counts[old] -= 1
                self._ref_counts[new] = 1
                table[i] = new
                self.pending_copies.append((old, new))
            for _ in range(self.blocks_needed(num_tokens) - len(table)):
                block = self._take_free()
                self._ref_counts[block] = 1
                table.append(block)
        if self.enable_prefix_caching:
            self._mark_pending(seq, num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (and its computed tokens); writes copy on demand.
        The child must have the parent's tokens up to `parent.num_computed_tokens`."""
        if child.block_table:
            raise RuntimeError(f"fork: child {child.request_id} already holds blocks")
        for theirs, mine in zip(self.tables(parent), self.tables(child), strict=True):
            for block in theirs:
                if block != RELEASED:
                    self._ref_counts[block] += 1
            mine[:] = theirs
        child.num_computed_tokens = parent.num_computed_tokens
        # hashes name tokens: only blocks wholly inside the shared computed tokens carry over
        shared = parent.num_computed_tokens // self.block_size
        child.cache_root = parent.cache_root
        child.block_hashes = parent.block_hashes[:shared]
        child.num_hashed_blocks = min(parent.num_hashed_blocks, shared)

    def compact(self, live: list[Sequence]) -> list[tuple[int, int]]:
        """Move every block in use into ids 0..num_used-1, rewriting the tables of `live` (every
        sequence that holds blocks; shared blocks move once). Cached blocks that move keep their
        hash; cached free blocks whose ids are filled are evicted. Returns the planned (src, dst)
        moves, which also wait in `pending_copies`."""
        held = sum(self.num_held_blocks(s) for s in live)
        if held != sum(self._ref_counts):
            raise RuntimeError(f"compact: the live sequences hold {held} block references, the pool counts {sum(self._ref_counts)}")
        used = self.num_used_blocks
        holes = iter(sorted(b for b in self._free if b < used))
        moves = {src: next(holes) for src in range(used, self.num_blocks) if self._ref_counts[src] > 0}
        for src, dst in moves.items():
            self._ref_counts[dst], self._ref_counts[src] = self._ref_counts[src], 0
            self._evict(dst)
            h = self._hash_of.pop(src, None)
            if h is not None:
                self._cached[h], self._hash_of[dst] = dst, h
        for s in live:
            for table in self.tables(s):
                table[:] = [moves.get(b, b) for b in table]
        kept = [b for b in self._free if b >= used]  # their contents stay, in LRU order
        self._free = OrderedDict.fromkeys([*moves, *kept])  # the moved-out ids hold nothing now
        plan = list(moves.items())
        self.pending_copies.extend(plan)
        return plan

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies planned since the last call, in order; the runner executes them."""
        out, self.pending_copies = self.pending_copies, []
        return out

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; safe to call on a sequence that holds none. Cached blocks
        stay cached (its last blocks are evicted before its first); the others are reused first."""
        for table in self.tables(seq):
            for block in reversed(table):
                if block != RELEASED:
                    self._unref(block)
            table.clear()
        self._unmark_pending(seq)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
