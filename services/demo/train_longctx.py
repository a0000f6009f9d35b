"""Train the long-context test checkpoint: a small Llama that reads Python source, context 2048.

    python -m cotserve.demo.train_longctx --out tests/fixtures/stdlib_llama

Why it exists: a model with random weights attends almost uniformly, so it says nothing about what
FP8 pages or top-k page selection cost. This one is trained on the Python standard library's own
source (on every machine that runs Python), so its attention has the long-range structure of real
text: names defined hundreds of lines earlier, repeated idioms, indentation.

Seeded and deterministic for a given thread count; on 2 CPU cores the default 700 steps
(5.7M tokens) take about 25 minutes. About one file in 40 (by a
CRC of its path) is kept out of training and written to `eval.txt` beside the checkpoint, the text
`cotserve kv eval` measures on. Writes a normal Hugging Face folder (LlamaForCausalLM, fp16
weights, a byte-level BPE tokenizer trained on the same files).
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from cotserve.demo.train import forward_dense
from cotserve.worker.models.config import ModelConfig
from cotserve.worker.models.llama import LlamaForCausalLM

CONTEXT = 2048
VOCAB_SIZE = 4096
SEPARATOR = "<|file|>"  # between files; also the BOS/EOS token
MODEL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 640,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def corpus_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library's Python source, sorted by path.
    About 1 file in 40 is held out, chosen by a CRC of its relative path (stable across machines)."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIP_PARTS.intersection(p.relative_to(root).parts))
    held = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 40 == 0]
    held_set = set(held)
    return [p for p in files if p not in held_set], held


def hf_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        **MODEL_SHAPE,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float16",
    }


def build_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[SEPARATOR], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint and eval.txt to")
    ap.add_argument("--steps", type=int, default=700, help="optimizer steps (default 700, ~25 min on 2 cores)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences of --context tokens per step (default 4)")
    ap.add_argument("--context", type=int, default=CONTEXT, help=f"training sequence length (default {CONTEXT})")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    ap.add_argument("--seed", type=int, default=0, help="seed for weights and data order (default 0)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train_files, held_files = corpus_files()
    texts = [read(p) for p in train_files]
    print(f"corpus: {len(train_files)} training files ({sum(map(len, texts)) / 1e6:.1f} MB), {len(held_files)} held out",
          flush=True)
    tok = build_tokenizer(texts)
    sep = tok.token_to_id(SEPARATOR)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(sep)
        ids.extend(enc.ids)
    data = torch.tensor(ids, dtype=torch.long)
    print(f"tokens: {len(data):,} ({sum(map(len, texts)) / len(data):.2f} bytes/token)", flush=True)

    model = LlamaForCausalLM(ModelConfig.from_dict(hf_config()))
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"training: {n_params / 1e6:.2f}M parameters, {args.batch_size} x {args.context} tokens per step, "
          f"{args.steps} steps", flush=True)

    def lr_at(frac: float) -> float:  # warm-up over the first 3% of the steps, then cosine to 5%
        if frac < 0.03:
            return args.lr * max(frac / 0.03, 0.02)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - 0.03) / 0.97))))

    start = time.monotonic()
    smooth, last_print = None, 0.0
    for step in range(1, args.steps + 1):
        elapsed = time.monotonic() - start
        lr = lr_at((step - 1) / args.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        offsets = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([data[o : o + args.context + 1] for o in offsets.tolist()])
        logits = forward_dense(model, batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if elapsed - last_print >= 30:
            last_print = elapsed
            left = elapsed / step * (args.steps - step)
            print(f"step {step}/{args.steps} loss {smooth:.3f} lr {lr:.1e} {elapsed:.0f}s elapsed, ~{left:.0f}s left", flush=True)
    print(f"trained {args.steps} steps ({args.steps * args.batch_size * args.context:,} tokens), loss {smooth:.3f}", flush=True)
    save(model, tok, args.out, [read(p) for p in held_files])
    print(f"wrote {args.out} in {time.monotonic() - start:.0f}s", flush=True)


def save(model: LlamaForCausalLM, tok, out: Path, held_texts: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": SEPARATOR, "eos_token": SEPARATOR, "model_max_length": CONTEXT}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}, indent=2) + "\n")
    (out / "eval.txt").write_text(f"\n{SEPARATOR}\n".join(held_texts))


if __name__ == "__main__":
    main()
