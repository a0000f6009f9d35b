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
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from cotserve.worker.sequence import Sequence


def cache_root(*parts: object) -> bytes:
    """The root of a sequence's block-hash chain, from everything besides the tokens that decides
    a block's contents (model revision, KV cache format, salt, ...)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """A full block's name: its parent's hash (or the chain's root) and its tokens."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass(slots=True, frozen=True)
class CacheHit:
    """What the prefix cache holds of a sequence: `blocks` start its tokens, in order. `pending`:
    its next block is being computed by another sequence this very step (wait for it)."""

    blocks: tuple[int, ...] = ()
    pending: bool = False


NO_HIT = CacheHit()


class BlockManager:
    """Allocates fixed-size KV blocks to sequences and caches full blocks by content.

    Invariants: a block is in the free list exactly when its reference count is 0, and
    `num_free_blocks + sum(blocks held) == num_blocks` (no leak, no double free); a registered
    (cached) block is never written: only blocks at or past a sequence's `num_computed_tokens`
    are, and registration covers computed full blocks only.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # LRU order, evicted from the front: uncached blocks first, then cached ones by age
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block
        self._hash_of: dict[int, bytes] = {}  # block -> its hash, for every cached block
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
        token to compute. Only for a sequence that holds no block (new or preempted)."""
        if not self.enable_prefix_caching or seq.block_table:
            return NO_HIT
        blocks: list[int] = []
        for h in self._hashes(seq, (len(seq) - 1) // self.block_size):
            block = self._cached.get(h)
            if block is None:
                owner = self._pending.get(h)
                return CacheHit(tuple(blocks), owner is not None and owner != seq.seq_id)
            blocks.append(block)
        return CacheHit(tuple(blocks))

    def register_computed(self, seq: Sequence) -> None:
        """Cache `seq`'s full blocks that are computed now (call after each step it was in)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if seq.num_hashed_blocks >= num_full:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            h, block = hashes[i], seq.block_table[i]
            if self._pending.get(h) == seq.seq_id:
                del self._pending[h]
            if h not in self._cached and block not in self._hash_of:
                self._cached[h] = block
                self._hash_of[block] = h
        seq.num_hashed_blocks = num_full

    def _mark_pending(self, seq: Sequence, num_tokens: int) -> None:
        """The full blocks `seq` computes up to `num_tokens` this step, so others wait for them."""
        first, last = seq.num_computed_tokens // self.block_size, num_tokens // self.block_size
        if last > first:
            for h in self._hashes(seq, last)[first:last]:
                if h not in self._cached:
                    self._pending.setdefault(h, seq.seq_id)

    def _unmark_pending(self, seq: Sequence) -> None:
        if self._pending:
            for h in seq.block_hashes:
                if self._pending.get(h) == seq.seq_id:
                    del self._pending[h]

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
        holds (they leave the free list too)."""
        if hit.blocks:
            reused = sum(1 for b in hit.blocks if self._ref_counts[b] == 0)
            return max(0, self.blocks_needed(num_tokens) - len(hit.blocks)) + reused
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table)) + len(self._shared_to_write(seq, num_tokens))

    def _shared_to_write(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Indexes into `seq.block_table` of shared blocks that tokens num_computed..num_tokens-1 write into."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table), self.blocks_needed(num_tokens))
        return [i for i in range(first, last) if self._ref_counts[seq.block_table[i]] > 1]

    def fits_in_place(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s tokens up to `num_tokens` go into the one block it holds and writes now, not shared and not
        filled by them (so `allocate` would change nothing): most sequences of a decode step, checked in O(1)."""
        bs, first = self.block_size, seq.num_computed_tokens // self.block_size
        if first >= len(seq.block_table) or (num_tokens - 1) // bs != first:
            return False
        if self.enable_prefix_caching and num_tokens // bs != first:  # it fills the block: others wait for it
            return False
        return self._ref_counts[seq.block_table[first]] == 1

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
        if hit.blocks:
            if seq.block_table:
                raise RuntimeError(f"allocate: {seq.request_id} holds blocks already; a cache hit is for admission")
            for block in hit.blocks:
                if self._ref_counts[block] == 0:
                    del self._free[block]
                self._ref_counts[block] += 1
            seq.block_table = list(hit.blocks)
            seq.num_computed_tokens = seq.num_hashed_blocks = len(hit.blocks)
            seq.num_computed_tokens *= self.block_size
        for i in self._shared_to_write(seq, num_tokens):  # copy-on-write
            old, new = seq.block_table[i], self._take_free()
            self._ref_counts[old] -= 1
            self._ref_counts[new] = 1
            seq.block_table[i] = new
            self.pending_copies.append((old, new))
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            block = self._take_free()
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        if self.enable_prefix_caching:
            self._mark_pending(seq, num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (and its computed tokens); writes copy on demand.
        The child must have the parent's tokens up to `parent.num_computed_tokens`."""
        if child.block_table:
            raise RuntimeError(f"fork: child {child.request_id} already holds blocks")
        for block in parent.block_table:
            self._ref_counts[block] += 1
        child.block_table = list(parent.block_table)
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
        held = sum(len(s.block_table) for s in live)
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
            s.block_table[:] = [moves.get(b, b) for b in s.block_table]
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
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:
                    self._free.move_to_end(block, last=False)
            elif self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
        self._unmark_pending(seq)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
