"""Reference-counted KV pages. No torch, no grpc.

Blocks are plain integers into the KV tensors that `ModelRunner` owns. Reference counts let a
later change share prefix blocks between sequences (copy-on-write forks); today every block has
one owner.
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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that its first `num_tokens` tokens have slots."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens. Caller checks `can_allocate` first."""
        need = self.num_new_blocks(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            seq.block_table.append(block)

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
