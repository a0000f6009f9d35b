"""Where a worker's engine runs and how big its KV pool is: decided in the engine's process (kept free of gRPC
imports so that the engine process starts quickly)."""

from __future__ import annotations

import dataclasses

import os
from pathlib import Path
from typing import Any

import torch

from cotserve.worker.block_manager import peak_blocks
from cotserve.worker.engine_config import EngineConfig
from cotserve.worker.kv_spec import KvCacheSpec
from cotserve.worker.models.loader import LoadedModel


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_torch_threads(cfg: Any, device: torch.device) -> None:  # cfg: WorkerConfig
    """torch's threads in this process (the gRPC front's and the engine process's alike): `torch_threads` when
    given, else on the CPU all cores but one (`WorkerConfig.cpu_threads`); on CUDA torch's own default."""
    if cfg.torch_threads is not None or device.type == "cpu":
        torch.set_num_threads(cfg.cpu_threads)


def _available_ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def engine_config(cfg: Any, loaded: LoadedModel) -> EngineConfig:
    """Size the KV pool: from --kv-cache-bytes, else a share of free memory, never more than
    max_num_seqs full-length sequences need."""
    max_len = min(cfg.max_model_len or loaded.config.max_context, loaded.config.max_context)
    for field in ("kv_skip_layers", "kv_topk_dense_layers"):
        bad = [layer for layer in getattr(cfg, field) if not 0 <= layer < loaded.config.num_layers]
        if bad:
            raise ValueError(f"{field}: {bad} out of range, the model's layers are 0..{loaded.config.num_layers - 1}")
    spec = KvCacheSpec.resolve(loaded.config, loaded.dtype, cfg.kv_cache_dtype, cfg.block_size, cfg.kv_skip_layers,
                               cfg.kv_topk_pages, cfg.kv_topk_dense_layers)
    per_block = spec.bytes_per_block
    budget = cfg.kv_cache_bytes
    if budget is None:
        if loaded.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(loaded.device)[0] * 0.9)
        else:
            budget = int(_available_ram_bytes() * 0.05)
    num_blocks = budget // per_block
    if cfg.kv_cache_bytes is None:
        num_blocks = min(num_blocks, cfg.max_num_seqs * peak_blocks(spec.windows, cfg.block_size, max_len,
                                                                    cfg.max_num_batched_tokens))
    if num_blocks < 1:
        raise ValueError(f"kv_cache_bytes: {budget} bytes holds no block of {cfg.block_size} tokens "
                         f"({per_block} bytes each)")
    resolved = {"num_blocks": num_blocks, "max_model_len": max_len, "kv_group_windows": spec.windows}
    same = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(EngineConfig) if f.name not in resolved}
    return EngineConfig(**resolved, **same)
