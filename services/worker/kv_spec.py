"""The KV cache's format, resolved once from the settings and passed down typed.

`KvCacheSpec` answers, in one place, everything that follows from the `--kv-cache-dtype` setting: each layer's payload dtype (FP8 layers listed in `--kv-skip-layers` keep the model's),
whether it has per-token scales, whether top-k page selection keeps per-page key bounds and which
layers read every page anyway, how the layers fall into KV groups (`KvGroup`: a sliding-window layer's pages are freed
as they leave its window, so it keeps a block table of its own), and what a token, a block and the whole pool cost
in bytes. Sizing
(`sizing.py`) and the engine resolve it from the same settings with `KvCacheSpec.resolve`; the model
runner allocates `LayerCache`s from it; attention reads a layer's tensors by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import torch

from cotserve.kernels.kv_fp8 import FP8
from cotserve.worker.models.config import ModelConfig

FP8_SCALE_DTYPE = torch.float16  # one scale per token and KV head, for keys and for values
PAGE_BOUNDS_DTYPE = torch.float32  # per-page key min/max that top-k page selection scores
KV_CACHE_DTYPES = {"fp8_e4m3": FP8, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: auto (the model's dtype), fp8_e4m3, fp16, bf16 or fp32."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r}, allowed auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class LayerKvSpec:
    """One layer's cache: its payload dtype (FP8 payloads come with per-token scales) and whether decode
    reads every page of it even when top-k page selection is on."""

    dtype: torch.dtype
    dense: bool = True

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8


@dataclass(frozen=True, slots=True)
class KvGroup:
    """Layers whose pages a sequence holds under one block table: full-attention layers (`window` None) or sliding ones
    of one window. Groups are of one size, and a pool block is one page of every layer of one group: the pool's
    tensors are a group's worth of layer *slots*, the group's i-th layer in slot i (vLLM's hybrid allocator)."""

    window: int | None
    layers: tuple[int, ...]


def kv_groups(windows: list[int | None], layers: tuple[LayerKvSpec, ...]) -> tuple[KvGroup, ...]:
    """The layers by window (full attention first), cut into groups of one size (the gcd of the kinds' counts); one
    group of every layer where there is one kind, or where layers that would share a slot store different formats
    (`--kv-skip-layers`): the window is then only enforced in attention and no page is freed."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in sorted(enumerate(windows), key=lambda iw: (iw[1] is not None, iw[1] or 0, iw[0])):
        kinds.setdefault(w, []).append(i)
    if len(kinds) == 1:
        return (KvGroup(windows[0], tuple(range(len(windows)))),)
    size = gcd(*map(len, kinds.values()))
    groups = tuple(KvGroup(w, tuple(ls[j:j + size])) for w, ls in kinds.items() for j in range(0, len(ls), size))
    if any(layers[g.layers[i]].dtype != layers[groups[0].layers[i]].dtype for g in groups for i in range(size)):
        return (KvGroup(None, tuple(range(len(windows)))),)
    return groups


@dataclass(frozen=True, slots=True)
class KvCacheSpec:
    dtype: torch.dtype  # the cache's dtype (what --kv-cache-dtype resolved to)
    layers: tuple[LayerKvSpec, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    topk_pages: int = 0  # decode reads this many pages per KV head in the layers that are not dense (0: all)
    v_head_dim: int = 0  # the values' size where it is not the keys' (latent attention: its RoPE key's); 0: head_dim
    groups: tuple[KvGroup, ...] = ()  # the layers' KV groups (`kv_groups`); none: one group of every layer

    @classmethod
    def resolve(cls, cfg: ModelConfig, model_dtype: torch.dtype, kv_cache_dtype: str, block_size: int,
                skip_layers=(), topk_pages: int = 0, topk_dense_layers=()) -> KvCacheSpec:
        dtype = resolve_kv_dtype(kv_cache_dtype, model_dtype) if isinstance(kv_cache_dtype, str) else kv_cache_dtype
        layers = tuple(LayerKvSpec(model_dtype if dtype == FP8 and i in skip_layers else dtype,
                                   dense=not topk_pages or i in topk_dense_layers) for i in range(cfg.num_layers))
        groups = kv_groups([cfg.window(i) for i in range(cfg.num_layers)], layers)
        if cfg.mla is not None:  # one latent and one RoPE key per token (`models/mla.py`), as a cache head each
            if topk_pages:
                raise ValueError("kv_topk_pages: not for multi-head latent attention (its cache holds latents, which "
                                 "the page bounds cannot score against a query); leave it 0")
            return cls(dtype, layers, block_size, 1, cfg.mla.kv_lora_rank, 0, cfg.mla.qk_rope_head_dim, groups)
        return cls(dtype, layers, block_size, cfg.num_kv_heads, cfg.head_dim, topk_pages, 0, groups)

    @property
    def kv_groups(self) -> tuple[KvGroup, ...]:
        return self.groups or (KvGroup(None, tuple(range(len(self.layers)))),)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each KV group's window (None: full attention): what the block manager frees pages by."""
        return tuple(g.window for g in self.kv_groups)

    def slots(self) -> list[tuple[int, int]]:
        """Each layer's (KV group, slot): the block table it reads and the pool tensors it is stored in."""
        out = [(0, 0)] * len(self.layers)
        for g, group in enumerate(self.kv_groups):
            for slot, layer in enumerate(group.layers):
                out[layer] = (g, slot)
        return out

    @property
    def skip_layers(self) -> frozenset[int]:
        """Layers that keep the model's dtype in an FP8 cache."""
        return frozenset(i for i, layer in enumerate(self.layers) if layer.dtype != self.dtype)

    @property
    def has_page_bounds(self) -> bool:
        """Each page keeps its keys' min and max (top-k page selection scores them)."""
        return self.topk_pages > 0

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def layer_bytes_per_token(self) -> list[int]:
        """Keys and values of one token in each layer, FP8 scales included."""
        out = []
        for layer in self.layers:
            scales = 2 * _size(FP8_SCALE_DTYPE) if layer.quantized else 0
            out.append(self.num_kv_heads * ((self.head_dim + self.value_dim) * _size(layer.dtype) + scales))
        return out

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return sum(self.layer_bytes_per_token())

    @property
    def page_bounds_bytes(self) -> int:
        """One layer's key min and max of one page, every KV head (0 without page selection)."""
        return 2 * self.num_kv_heads * self.head_dim * _size(PAGE_BOUNDS_DTYPE) if self.has_page_bounds else 0

    @property
    def bytes_per_block(self) -> int:
        """One pool block, a page of each layer of one KV group: its tokens' keys, values and scales, and the page
        bounds (every layer's with one group)."""
        per_layer = self.layer_bytes_per_token()
        slots = self.kv_groups[0].layers
        return self.block_size * sum(per_layer[i] for i in slots) + len(slots) * self.page_bounds_bytes

    def allocate(self, num_blocks: int, device: torch.device) -> list[LayerCache]:
        """Zeroed caches of `num_blocks` blocks, one per layer: the layers of a slot (`slots`) share theirs."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        v_shape = shape[:3] + (self.value_dim,)

        def zeros(s: tuple, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(s, dtype=dtype, device=device)

        slots = []
        for i in self.kv_groups[0].layers:
            layer = self.layers[i]
            cache = LayerCache(zeros(shape, layer.dtype), zeros(v_shape, layer.dtype))
            if layer.quantized:
                cache.k_scale, cache.v_scale = zeros(shape[:3], FP8_SCALE_DTYPE), zeros(shape[:3], FP8_SCALE_DTYPE)
            if self.has_page_bounds:
                bounds = shape[:1] + shape[2:]  # [num_blocks, kv_heads, dim]
                cache.k_min, cache.k_max = zeros(bounds, PAGE_BOUNDS_DTYPE), zeros(bounds, PAGE_BOUNDS_DTYPE)
            slots.append(cache)
        return [slots[slot] for _, slot in self.slots()]


@dataclass(slots=True, eq=False)
class LayerCache:
    """One layer's cache tensors, each indexed by block first: keys and values `[blocks, block_size, kv_heads,
    dim]`; for FP8 their scales `[blocks, block_size, kv_heads]`; with page selection the pages' key min/max
    `[blocks, kv_heads, dim]`."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_min: torch.Tensor | None = None
    k_max: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the layer (what a block copy must copy)."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale, self.k_min, self.k_max) if t is not None]
