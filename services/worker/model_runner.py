"""Owns the model and the KV tensors; turns a `ScheduledBatch` into logits."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from cotserve.kernels.dispatch import decode_layers_choice, kernels_for
from cotserve.kernels.kv_fp8 import FP8
from cotserve.worker.kv_spec import FP8_SCALE_DTYPE, KvCacheSpec
from cotserve.worker.models.attention import PagedAttention, PagedBatch, PrefillGroup
from cotserve.worker.models.loader import LoadedModel
from cotserve.worker.scheduler import ScheduledBatch


ONE_CALL_MAX_QUERY = 64
"""The longest prompt chunk (tokens) a step may hold and still run its layers in one C call (`_in_one_call`): its
tokens' attention reads a token's pages each; the per-operation path attends a chunk's tokens together."""


def padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Page tables of different lengths as one [rows, width] int64 tensor, each row padded with block 0 (never read:
    a row reads only up to its context length)."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64,
                        device=device).view(len(tables), width)


@dataclass(slots=True)
class PreparedInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    paged: PagedBatch  # the first KV group's tables (every layer's with one group)
    group_paged: tuple[PagedBatch, ...]  # the other KV groups': the same rows over their own block tables
    sample_rows: torch.Tensor  # [num_sampled] index of each sampling sequence's last token


class ModelRunner:
    """Runs one forward pass for a batch of ragged sequences over the paged KV cache."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, spec: KvCacheSpec) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.spec = spec
        self.block_size = spec.block_size
        self.kernels = kernels_for(self.device)  # chosen once, here
        self.caches = spec.allocate(num_blocks, self.device)
        self.layer_groups = tuple(g for g, _ in spec.slots())  # each layer's KV group (its block table)
        self.num_groups = len(spec.kv_groups)
        self.windows = spec.windows
        # LongRoPE: a sequence longer than `long_after` asks for positions past `long_offset` (the long factors' rows)
        self.long_after, self.long_offset = self.config.rope_long_after, getattr(
            getattr(self.model.model, "rotary", None), "long_offset", None) or 0
        self.scale = self.config.head_dim ** -0.5
        self.decode_layers = self._decode_layers()  # a step's layers in one C call, where they all run in C
        self.warmed = threading.Event()  # the CPU kernels are compiled (set at once where nothing compiles)
        if self.device.type == "cpu" and self.kernels.name != "triton":
            self._warm_up_kernels(loaded.dtype)
        else:
            self.warmed.set()

    def prepare_inputs(self, batch: ScheduledBatch) -> PreparedInputs:
        ids: list[int] = []
        positions: list[int] = []
        kv_groups = range(self.num_groups)
        slots: list[list[int]] = [[] for _ in kv_groups]  # per KV group: each token's slot
        fresh: list[bool] = []
        decode_idx: list[int] = []
        decode_tables: list[list[list[int]]] = [[] for _ in kv_groups]  # per KV group: each decode row's table
        decode_ctx: list[int] = []
        # (length, context) -> (offset, each KV group's table) a row
        prefill: dict[tuple[int, int], list[tuple[int, list[list[int]]]]] = {}
        sample_rows: list[int] = []
        bs = self.block_size
        for item in batch.items:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_tokens
            offset = len(ids)
            tables = (seq.block_table, *seq.group_tables) if self.num_groups > 1 else (seq.block_table,)
            ctx, pages = start + n, (start + n + bs - 1) // bs
            rope = self.long_offset if self.long_after is not None and len(seq) > self.long_after else 0
            if n == 1:  # a decode row (most rows of most steps): no ranges, no slices of the whole sequence
                ids.append(seq.token_at(start))
                positions.append(start + rope)
                for g, table in enumerate(tables):
                    slots[g].append(table[start // bs] * bs + start % bs)
                    decode_tables[g].append(table[:pages])
                fresh.append(start % bs == 0)
                decode_idx.append(offset)
                decode_ctx.append(ctx)
            else:
                ids.extend(seq.all_token_ids[start : start + n])
                positions.extend(range(start + rope, start + n + rope))
                for g, table in enumerate(tables):
                    slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
                fresh.extend(p % bs == 0 for p in range(start, start + n))
                prefill.setdefault((n, ctx), []).append((offset, [table[:pages] for table in tables]))
            if item.samples:
                sample_rows.append(offset + n - 1)
        dev = self.device

        def as_long(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        # a prefill group's rows have one context length, so their tables one width
        shared = (as_long(decode_idx), as_long(decode_ctx), torch.tensor(fresh, dtype=torch.bool, device=dev),
                  [(n, ctx, as_long([s + i for s, _ in rows for i in range(n)]), as_long([ctx] * len(rows)),
                    as_long([n] * len(rows))) for (n, ctx), rows in prefill.items()])
        rows = list(prefill.values())
        batches = [self._group_batch(shared, g, slots[g], decode_tables[g], [[t[g] for _, t in r] for r in rows])
                   for g in kv_groups]
        return PreparedInputs(as_long(ids), as_long(positions), batches[0], tuple(batches[1:]), as_long(sample_rows))

    def _group_batch(self, shared: tuple, group: int, slots: list[int], decode_tables: list[list[int]],
                     prefill_tables: list[list[list[int]]]) -> PagedBatch:
        """The step's rows (`shared`: what every KV group sees alike) over KV group `group`'s slots and block tables."""
        dev = self.device
        decode_idx, decode_ctx, fresh, prefill = shared
        tables = [padded_tables(decode_tables, dev)] + [padded_tables(t, dev) for t in prefill_tables]
        if self.windows[group] is not None:  # pages given back (RELEASED) are never read: any id does
            for t in tables:
                t.clamp_(min=0)
        groups = [PrefillGroup(n, ctx, idx, t, lens, qlens) for (n, ctx, idx, lens, qlens), t in zip(prefill, tables[1:])]
        return PagedBatch(torch.tensor(slots, dtype=torch.int64, device=dev), decode_idx, tables[0], decode_ctx, fresh,
                          groups)

    def _in_one_call(self, batch: ScheduledBatch) -> bool:
        """Whether the step's layers run in one C call (`decode_layers`): every row a decode row or a prompt chunk of at
        most ONE_CALL_MAX_QUERY tokens (each of whose tokens attends over the pages up to its own position: causal
        attention a token at a time, which a long chunk would make quadratic in reads; those keep the per-operation
        path and its batched prompt attention)."""
        return self.decode_layers is not None and self.decode_layers.takes(batch.num_tokens) \
            and all(item.num_tokens <= ONE_CALL_MAX_QUERY for item in batch.items)

    def _token_rows(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's page table (padded) and context length, in the step's token order: a token at position p
        attends over its sequence's pages up to p."""
        bs = self.block_size
        tables: list[list[int]] = []
        ctx: list[int] = []
        for item in batch.items:
            table, start = item.seq.block_table, item.seq.num_computed_tokens
            for p in range(start, start + item.num_tokens):
                tables.append(table[: p // bs + 1])
                ctx.append(p + 1)
        return padded_tables(tables, self.device), torch.tensor(ctx, dtype=torch.int64, device=self.device)

    def _decode_layers(self):
        """`LlamaForCausalLM.native_decode_layers` over this runner's caches where the native CPU kernels serve every
        layer (every page read: no top-k selection) and COTSERVE_DECODE_LAYERS allows it; else None."""
        from cotserve.kernels import cpu_native

        native = self.kernels.write_kv is cpu_native.write_kv and self.kernels.decode_attention is cpu_native.decode_attention
        if not native or decode_layers_choice() != "auto" or not all(layer.dense for layer in self.spec.layers) \
                or self.num_groups > 1 or not hasattr(self.model, "native_decode_layers"):
            return None
        return self.model.native_decode_layers(self.caches, self.scale)

    def _warm_up_kernels(self, model_dtype: torch.dtype) -> None:
        """Compile the CPU references on a helper thread (`cpu_compile`): decode attention once per cache format in
        use (every shape reuses that code) unless the C kernel runs it, FP8 dequantization for one and for several
        rows (torch specialises a size of 1). Steps meanwhile run the eager references; `warmed` is set when done."""
        from cotserve.kernels import cpu_native
        from cotserve.kernels.kv_fp8 import decode_all_pages, dequantize_fast

        cfg, dev = self.config, self.device

        @torch.inference_mode()
        def compile_all() -> None:
            try:
                done: set[torch.dtype] = set()
                for cache in self.caches:
                    if cache.k.dtype in done:
                        continue
                    done.add(cache.k.dtype)
                    # two rows of three pages: the padded shape class every decode batch falls in (latent attention
                    # gathers its pages instead: no decode kernel)
                    query = torch.zeros(2, cfg.num_heads, cfg.head_dim, dtype=model_dtype, device=dev)
                    tables = torch.zeros(2, 3, dtype=torch.int64, device=dev)
                    ones = torch.ones(2, dtype=torch.int64, device=dev)
                    native = self.kernels.decode_attention is cpu_native.decode_attention
                    if cfg.mla is None and not (native and cpu_native.supports(query, cache.k, cache.v, cache.k_scale,
                                                                               cache.v_scale)):
                        decode_all_pages.warm_up(query, cache.k, cache.v, tables, ones, self.scale, cache.k_scale, cache.v_scale)
                    if cache.k_scale is not None:
                        for rows in (1, 2):
                            shape = (rows, cache.k.shape[2], 3)
                            for dim in {cache.k.shape[3], cache.v.shape[3]}:
                                dequantize_fast.warm_up(torch.zeros(*shape, dim, dtype=FP8, device=dev),
                                                        torch.ones(shape, dtype=FP8_SCALE_DTYPE, device=dev))
            finally:
                self.warmed.set()

        threading.Thread(target=compile_all, name="cotserve-compile", daemon=True).start()

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block: payloads, FP8 scales, page bounds."""
        return list({id(t): t for cache in self.caches for t in cache.tensors()}.values())  # a slot's layers share

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Execute the block manager's planned copies in order (copy-on-write, compaction): copies
        go to the kernel in waves in which no destination is also a source."""
        tensors = self.cache_tensors()
        i = 0
        while i < len(copies):
            srcs, dsts = set(), set()
            j = i
            while j < len(copies) and copies[j][0] not in dsts and copies[j][1] not in srcs | dsts:
                srcs.add(copies[j][0])
                dsts.add(copies[j][1])
                j += 1
            wave = torch.tensor(copies[i:j], dtype=torch.int64, device=self.device)
            self.kernels.copy_blocks(tensors, wave[:, 0].contiguous(), wave[:, 1].contiguous())
            i = j

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:  # [num_sampled, vocab] float32
        if batch.block_copies:
            self.copy_blocks(batch.block_copies)
        inputs = self.prepare_inputs(batch)
        if self._in_one_call(batch):
            paged = inputs.paged
            tables, ctx = self._token_rows(batch) if paged.prefill_groups else (paged.decode_block_tables,
                                                                                paged.decode_context_lens)
            hidden = self.model.forward_natively(self.decode_layers, inputs.input_ids, inputs.positions,
                                                 paged.slot_mapping, paged.fresh_page, tables, ctx)
        else:
            attn = PagedAttention(self.caches, self.spec, inputs.paged, self.kernels, self.scale, inputs.group_paged,
                                  self.layer_groups)
            hidden = self.model(inputs.input_ids, inputs.positions, attn)
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows)).float()
