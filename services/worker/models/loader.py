"""Load a Hugging Face checkpoint folder into our own model code.

A checkpoint is named by its folder, or by a Hugging Face repo id (`org/name`) whose snapshot is in the local
Hugging Face cache (`models--org--name/snapshots/REV`, as `huggingface-cli download` leaves it); it is served under
its folder's name, or its repo id when it is such a snapshot, unless the operator names it.

Input: `config.json`, `model.safetensors` or shards listed in `model.safetensors.index.json`,
`tokenizer.json`, and optionally `tokenizer_config.json` / `generation_config.json` for special
tokens and end-of-sequence ids. Every problem is a `ModelLoadError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from cotserve.common.errors import ModelLoadError
from cotserve.kernels.dispatch import layer_ops_for
from cotserve.worker.models.config import ModelConfig
from cotserve.worker.models.registry import architecture
from cotserve.worker.models.llama import LlamaForCausalLM, RotaryEmbedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM | None  # its family's model (`registry`); None in a worker's gRPC process: the weights live
    # in its engine process
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    name: str
    revision: str
    dtype: torch.dtype
    device: torch.device
    aliases: tuple[str, ...] = ()  # further names requests may use
    chat_template: Any = None  # ChatTemplate of the folder (None: the model has none; chat requests are refused)


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU, bfloat16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{index}: lists shard {f.name}, which is missing")
        return files
    if single.exists():
        return [single]
    raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors one at a time, file after file (only the one being handed out is read)."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    yield key, fh.get_tensor(key)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise ModelLoadError(f"{f}: cannot read safetensors file ({exc})") from None


def fp8_block_size(raw_config: dict) -> tuple[int, int] | None:
    """A block-quantized FP8 checkpoint's block (`quantization_config.quant_method` "fp8" with `weight_block_size`,
    as Qwen3-FP8 and DeepSeek-V3 ship them), None for any other checkpoint."""
    quant = raw_config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"config.json: quantization_config.weight_block_size: {block!r}, expected [rows, columns] "
                             "(per-tensor FP8 is not supported)")
    return block[0], block[1]


def fp8_dequantized(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An E4M3 `weight` made plain: each block times its float32 scale (`weight_scale_inv`), in float32. No FP8
    matrix kernel runs such weights yet: they are dequantized at load, and the startup log says so."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != expected:
        raise ModelLoadError(f"{name}_scale_inv: shape {tuple(scale.shape)}, expected {expected} for {name} "
                             f"{tuple(weight.shape)} in blocks of {list(block)}")
    full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * full


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The sixteen values of an FP4 (E2M1) code, by code."""


def mxfp4_dequantized(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights (`quantization_config.quant_method` "mxfp4", gpt-oss's experts) made plain: `X_blocks`
    [..., rows, groups, 16] bytes of two FP4 codes each (the low nibble first) and `X_scales` [..., rows, groups]
    power-of-two exponents biased by 127, one per group of 32 values, become `X` [..., columns, rows] (float32: each
    value is an FP4 value times its group's power of two; stored transposed, as the model multiplies by it). No MXFP4
    kernel runs them yet: the startup log says so."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelLoadError(f"{name}_blocks: shape {tuple(blocks.shape)} {blocks.dtype}, expected uint8 "
                             f"{(*scales.shape, 16)} for scales {tuple(scales.shape)}")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., rows, groups, 32]
    values = torch.ldexp(torch.tensor(FP4_E2M1)[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(-1, -2).contiguous()


class Dequantizer:
    """Pairs a checkpoint's quantized weights with their scales as they stream past (FP8 blocks and
    `weight_scale_inv`, MXFP4 `_blocks` and `_scales`), holding only a pair's first half until its second arrives."""

    def __init__(self, raw_config: dict) -> None:
        self.fp8 = fp8_block_size(raw_config)
        self.mxfp4 = (raw_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
        self.waiting: dict[str, torch.Tensor] = {}  # a pair's half, by its name
        self.counts = {"fp8": 0, "mxfp4": 0}

    def take(self, key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(name, plain tensor) for a tensor that is (or completes) a weight, None while a pair is half read."""
        if self.fp8 is not None and (key.endswith(".weight_scale_inv") or tensor.dtype == torch.float8_e4m3fn):
            name = key.removesuffix("_scale_inv")
            pair = self._pair(key, tensor, name, f"{name}_scale_inv")
            if pair is None:
                return None
            self.counts["fp8"] += 1
            return name, fp8_dequantized(name, *pair, self.fp8)
        if self.mxfp4 and key.endswith(("_blocks", "_scales")):
            name = key.removesuffix("_blocks").removesuffix("_scales")
            pair = self._pair(key, tensor, f"{name}_blocks", f"{name}_scales")
            if pair is None:
                return None
            self.counts["mxfp4"] += 1
            return name, mxfp4_dequantized(name, *pair)
        return key, tensor

    def _pair(self, key: str, tensor: torch.Tensor, first: str, second: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pair (`first`'s tensor, `second`'s) once `key` (one of the two) completes it; None while it waits."""
        other = self.waiting.pop(second if key == first else first, None)
        if other is None:
            self.waiting[key] = tensor
            return None
        return (tensor, other) if key == first else (other, tensor)

    def finish(self) -> None:
        """Every pair completed; ModelLoadError naming a half without its other."""
        for key in self.waiting:
            if key.endswith("_scale_inv"):
                raise ModelLoadError(f"{key}: a scale for {key.removesuffix('_scale_inv')}, which the checkpoint "
                                     "does not hold")
            if key.endswith(("_blocks", "_scales")):
                raise ModelLoadError(f"{key}: MXFP4 {key.rsplit('_', 1)[1]} without their other half")
            raise ModelLoadError(f"{key}: an FP8 weight without its weight_scale_inv")


def hub_cache_dir() -> Path:
    """Where Hugging Face keeps downloaded models: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ["HF_HOME"]) if os.environ.get("HF_HOME") else Path.home() / ".cache" / "huggingface"
    return home / "hub"


def _repo_id_of_snapshot(folder: Path) -> str | None:
    """`org/name` for a folder `.../models--org--name/snapshots/REV`, else None."""
    parts = folder.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return None


def resolve_checkpoint(model: str | Path) -> tuple[Path, str]:
    """(checkpoint folder, the name it is served under by default) for a folder or a cached Hugging Face repo id.
    A repo id takes the revision `refs/main` names, else the newest snapshot."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder, _repo_id_of_snapshot(folder) or folder.resolve().name
    repo_id = str(model).strip("/")
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if repo_id and ".." not in repo_id and snapshots.is_dir():
        ref = repo / "refs" / "main"
        if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
            return snapshots / ref.read_text().strip(), repo_id
        found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1], repo_id
    raise ModelLoadError(f"{model}: model folder not found, nor a Hugging Face repo id with a snapshot in {hub_cache_dir()}")


def checkpoint_revision(folder: Path, files: list[Path]) -> str:
    """Short content hash over config.json and each weight file's header and size."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in files:
        with f.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(min(header_len, 1 << 24)))
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()[:12]


def load_tokenizer(folder: Path, cfg: ModelConfig) -> tuple[Tokenizer, frozenset[int]]:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(f"{path}: file not found (a model folder needs tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot load tokenizer ({exc})") from None
    eos: set[int] = set(cfg.eos_token_ids)
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        try:
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{gen_path}: not valid JSON ({exc})") from None
        if gen_eos is not None:
            eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    tok_cfg = folder / "tokenizer_config.json"
    if not eos and tok_cfg.exists():
        token = json.loads(tok_cfg.read_text()).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and tok.token_to_id(token) is not None:
            eos.add(tok.token_to_id(token))
    return tok, frozenset(int(e) for e in eos)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint weight belongs to (None: not a layer's)."""
    m = _LAYER.match(name)
    return int(m[1]) if m else None


def model_tensors(folder: Path, files: list[Path], arch, cfg: ModelConfig,
                  convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names, each made as it is read (quantized ones dequantized, fused
    ones split, unused ones and layers past the config's left out) and passed through `convert` (the model's dtype and
    device) before the next is read: memory holds the model once, plus one tensor (or a quantized pair) in flight.
    What the model serves short of its config is logged."""
    log = logging.getLogger("cotserve.worker")
    if cfg.rope.rope_type == "longrope" and cfg.max_context < cfg.max_position_embeddings:
        log.warning("%s: LongRoPE without long factors: contexts are served up to its original length, %d tokens "
                    "(of %d)", folder, cfg.max_context, cfg.max_position_embeddings)
    quant = Dequantizer(json.loads((folder / "config.json").read_text()))
    tensors: dict[str, torch.Tensor] = {}
    extra: set[int] = set()
    for key, tensor in checkpoint_tensors(files):
        layer = _layer_of(key)
        if layer is not None and layer >= cfg.num_layers:  # e.g. DeepSeek-V3's multi-token-prediction layer
            extra.add(layer)
            continue
        plain = quant.take(key, tensor)
        del tensor
        if plain is None:
            continue
        ours = arch.weight_name(plain[0])
        if ours is not None:
            parts = arch.split(ours, plain[1], cfg) if arch.split else [(ours, plain[1])]
            tensors.update((name, convert(part)) for name, part in parts)
    quant.finish()
    if extra:
        log.info("%s: layer(s) %s past num_hidden_layers are not served", folder, ", ".join(map(str, sorted(extra))))
    if quant.counts["fp8"]:
        log.warning("%s: block-quantized FP8 weights dequantized at load (no FP8 matrix kernel yet): they take the "
                    "model dtype's memory", folder)
    if quant.counts["mxfp4"]:
        log.warning("%s: MXFP4 expert weights dequantized at load (no MXFP4 kernel yet): they take the model dtype's "
                    "memory", folder)
    return tensors


def load_model(
    folder: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    name: str | None = None,
    aliases: tuple[str, ...] = (),
) -> LoadedModel:
    """`folder`: a checkpoint folder or a cached repo id (`resolve_checkpoint`); `name` and `aliases`: what requests
    call it (default: the checkpoint's own name)."""
    folder, default_name = resolve_checkpoint(folder)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    cfg = ModelConfig.from_file(folder / "config.json")
    arch = architecture(cfg.architecture)
    files = weight_files(folder)
    tensors = model_tensors(folder, files, arch, cfg, lambda t: t.to(device=device, dtype=dtype))

    with torch.device("meta"):
        model = arch.build(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(k for k in set(tensors) - set(expected) if not k.endswith(_IGNORED_SUFFIXES))
    if missing:
        raise ModelLoadError(f"{files[0].parent}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if unexpected:
        raise ModelLoadError(f"{files[0].parent}: unexpected weights for {cfg.architecture}: {', '.join(unexpected[:5])}")
    for key, shape in expected.items():
        if tensors[key].shape != shape:
            raise ModelLoadError(f"{files[0].parent}: weight {key} has shape {tuple(tensors[key].shape)}, "
                                 f"config.json implies {tuple(shape)}")
    state = {k: tensors[k] for k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # float32 inv_freq, on device; served positions read from a table (they stay below the longest context served)
    model.model.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_context).to(device)
    for block in model.moe_blocks():  # plain-tensor state made on the meta device: make it real
        block.load = torch.zeros(block.num_experts, dtype=torch.int64)
    model.eval().requires_grad_(False)
    model.fuse_projections()
    model.use_layer_ops(layer_ops_for(device, dtype))
    tokenizer, eos = load_tokenizer(folder, cfg)
    return LoadedModel(
        model=model, config=cfg, tokenizer=tokenizer, eos_token_ids=eos,
        name=name or default_name, revision=checkpoint_revision(folder, files),
        dtype=dtype, device=device, aliases=tuple(aliases), chat_template=load_chat_template(folder),
    )


def load_front(folder: str | Path, name: str | None = None, aliases: tuple[str, ...] = ()) -> LoadedModel:
    """What a worker's gRPC process needs of a checkpoint: its config and tokenizer, no weights (those are
    loaded by the engine process; it reports the revision, dtype and device, filled in then)."""
    folder, default_name = resolve_checkpoint(folder)
    cfg = ModelConfig.from_file(folder / "config.json")
    tokenizer, eos = load_tokenizer(folder, cfg)
    return LoadedModel(model=None, config=cfg, tokenizer=tokenizer, eos_token_ids=eos, name=name or default_name,
                       revision="", dtype=torch.float32, device=torch.device("cpu"), aliases=tuple(aliases),
                       chat_template=load_chat_template(folder))


def load_chat_template(folder: Path):
    """The folder's chat template (worker/chat_template.py), None without one; a broken one is a ModelLoadError
    naming its file (better refused at start than on every chat request)."""
    from cotserve.worker.chat_template import ChatTemplate

    try:
        return ChatTemplate.from_folder(folder)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
