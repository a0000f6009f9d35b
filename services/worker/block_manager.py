"""Reference-counted KV pages. No torch, no grpc.

Blocks are plain integers into the KV tensors that `ModelRunner` owns. `fork` shares a sequence's
blocks with a child (reference counts); the first write into a shared block gives the writer its
own copy (copy-on-write). `compact` moves live blocks into the lowest block ids. Both only plan:
the (source, destination) block copies wait in `pending_copies` until the runner executes them
with the `copy_blocks` kernel before the next forward pass, so a copy always happens before the
step that writes into the new block.
"""

from __future__ import annotations

from collections import deque

from cotserve.worker.sequence import Sequence


class BlockManager:
    """Allocates fixed-size KV blocks to sequences.

    Invariant: a block is in the free list exactly when its reference count is 0, and
    `num_free_blocks + sum(blocks held) == num_blocks` (no leak, no double free).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner has yet to do

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that its first `num_tokens` tokens have slots, copies of shared
        blocks it is about to write into included."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table)) + len(self._shared_to_write(seq, num_tokens))

    def _shared_to_write(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Indexes into `seq.block_table` of shared blocks that tokens num_computed..num_tokens-1 write into."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table), self.blocks_needed(num_tokens))
        return [i for i in range(first, last) if self._ref_counts[seq.block_table[i]] > 1]

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens, first giving `seq` its own copy of
        any shared block it is about to write into. Caller checks `can_allocate` first."""
        need = self.num_new_blocks(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        for i in self._shared_to_write(seq, num_tokens):  # copy-on-write
            old, new = seq.block_table[i], self._free.popleft()
            self._ref_counts[old] -= 1
            self._ref_counts[new] = 1
            seq.block_table[i] = new
            self.pending_copies.append((old, new))
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (and its computed tokens); writes copy on demand."""
        if child.block_table:
            raise RuntimeError(f"fork: child {child.request_id} already holds blocks")
        for block in parent.block_table:
            self._ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def compact(self, live: list[Sequence]) -> list[tuple[int, int]]:
        """Move every block in use into ids 0..num_used-1, rewriting the tables of `live` (every
        sequence that holds blocks; shared blocks move once). Returns the planned (src, dst) moves,
        which also wait in `pending_copies`."""
        held = sum(len(s.block_table) for s in live)
        if held != sum(self._ref_counts):
            raise RuntimeError(f"compact: the live sequences hold {held} block references, the pool counts {sum(self._ref_counts)}")
        used = self.num_used_blocks
        holes = iter(sorted(b for b in self._free if b < used))
        moves = {src: next(holes) for src in range(used, self.num_blocks) if self._ref_counts[src] > 0}
        for src, dst in moves.items():
            self._ref_counts[dst], self._ref_counts[src] = self._ref_counts[src], 0
        for s in live:
            s.block_table[:] = [moves.get(b, b) for b in s.block_table]
        self._free = deque(range(used, self.num_blocks))
        plan = list(moves.items())
        self.pending_copies.extend(plan)
        return plan

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies planned since the last call, in order; the runner executes them."""
        out, self.pending_copies = self.pending_copies, []
        return out

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; safe to call on a sequence that holds none."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.appendleft(block)
            elif self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
        seq.block_table.clear()
        seq.num_computed_tokens = 0
