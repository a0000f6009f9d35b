"""Train the bundled demo model: a tiny Llama that does arithmetic as a chain of thought.

    python -m cotserve.demo.train --out services/worker/demo/cotserve-demo
    python -m cotserve.demo.train --task testbed --out services/worker/demo/testbed

`--task testbed` trains the reasoning testbed instead (see `arithmetic.py`): 3 to 7 operands, a
backward check before the end of thinking, chains that slip at a fixed rate, and chains cut short
by a forced end marker. It starts from the bundled demo model's weights (`--init`), which already
does the forward arithmetic, so the testbed only learns what is new (about 12 minutes; the demo
model itself takes about 15 from scratch).

Seeded and reproducible on the CPU (same seed, same thread count: same weights). Writes a normal
Hugging Face folder: config.json (LlamaForCausalLM), model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json. Prints progress (loss, accuracy on held-out
problems) while it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cotserve.demo.arithmetic import (FORCED_RATE, TESTBED_MAX_OPERANDS, TESTBED_MIN_OPERANDS, Problem, parse_answer, problems, random_problem,
                                      testbed_completion, testbed_problem, testbed_problems)
from cotserve.demo.tokenizer import BOS, EOS, PAD, VOCAB_SIZE, build_tokenizer, number_tokens
from cotserve.worker.config import DEMO_MODEL
from cotserve.worker.models.attention import DenseCausalAttention
from cotserve.worker.models.config import ModelConfig
from cotserve.worker.models.llama import LlamaForCausalLM

MODEL_SHAPE = {
    "hidden_size": 192,
    "intermediate_size": 448,
    "num_hidden_layers": 4,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "head_dim": 64,
}
EVAL_SEED = 1_000_003  # held-out problems come from a different stream than training's


def hf_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        **MODEL_SHAPE,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def encode_example(tok, p: Problem, completion_text: str | None = None) -> tuple[list[int], list[int]]:
    """Token ids of prompt + completion + EOS, and the loss mask (1 on completion tokens)."""
    prompt = tok.encode(p.prompt).ids  # starts with BOS
    text = p.completion if completion_text is None else completion_text
    completion = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id(EOS)]
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def testbed_example(tok, rng: random.Random, operands: int) -> tuple[list[int], list[int]]:
    p = testbed_problem(rng, operands)
    if rng.random() >= FORCED_RATE:
        return encode_example(tok, p, testbed_completion(p, rng))
    if rng.random() < 0.5:  # half the cuts right after a step, where early-exit probes look
        return encode_example(tok, p, testbed_completion(p, rng, cut_after_step=rng.randint(1, 2 * len(p.ops))))
    return encode_example(tok, p, testbed_completion(p, rng, rng.random()))


def make_batch(tok, rng: random.Random, batch_size: int, task: str = "demo") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pad = tok.token_to_id(PAD)
    if task == "testbed":  # one operand count per batch: rows of similar length, little padding
        operands = rng.randint(TESTBED_MIN_OPERANDS, TESTBED_MAX_OPERANDS)
        rows = [testbed_example(tok, rng, operands) for _ in range(batch_size)]
    else:
        rows = [encode_example(tok, random_problem(rng)) for _ in range(batch_size)]
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((batch_size, length), pad, dtype=torch.long)
    mask = torch.zeros((batch_size, length), dtype=torch.float32)
    for i, (r, m) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    # Predict token t+1 from tokens <= t.
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]


def init_number_embeddings(model: LlamaForCausalLM, tok, gen: torch.Generator) -> None:
    """Give each number token a value-aware start: a linear term plus sines and cosines of its
    value at several periods (the "clock" representation in which SwiGLU's products add
    numbers). A training-time head start only; the checkpoint is an ordinary Llama."""
    emb = model.model.embed_tokens.weight
    hidden = emb.shape[1]
    periods = (2, 3, 5, 7, 10, 20, 50, 100, 200, 400, 1200)
    basis = torch.linalg.qr(torch.randn(hidden, 1 + 2 * len(periods), generator=gen))[0]  # orthonormal columns
    with torch.no_grad():
        for text, value in number_tokens().items():
            tid = tok.token_to_id(text)
            feats = [value / 600.0]
            for period in periods:
                angle = 2 * math.pi * value / period
                feats += [math.cos(angle), math.sin(angle)]
            emb[tid] += 0.1 * (basis @ torch.tensor(feats))


def forward_dense(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    batch, length = ids.shape
    positions = torch.arange(length).repeat(batch)
    hidden = model(ids.reshape(-1), positions, DenseCausalAttention(batch, length))
    return model.compute_logits(hidden).view(batch, length, -1)


@torch.no_grad()
def greedy_accuracy(model: LlamaForCausalLM, tok, probs: list[Problem], max_new: int = 128) -> float:
    """Exact-answer accuracy with batched greedy decoding (no cache: the model is tiny)."""
    model.eval()
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    prompts = [tok.encode(p.prompt).ids for p in probs]
    # Left-align prompts of different lengths by decoding each length group together.
    correct = 0
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_len.setdefault(len(ids), []).append(i)
    for idxs in by_len.values():
        ids = torch.tensor([prompts[i] for i in idxs])
        done = torch.zeros(len(idxs), dtype=torch.bool)
        for _ in range(max_new):
            nxt = forward_dense(model, ids)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            done |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if bool(done.all()):
                break
        for row, i in enumerate(idxs):
            out = [t for t in ids[row, len(prompts[i]) :].tolist() if t not in (eos, pad)]
            correct += parse_answer(tok.decode(out)) == probs[i].answer
    model.train()
    return correct / len(probs)


def save_checkpoint(model: LlamaForCausalLM, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "model_max_length": 256}, indent=2) + "\n"
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2) + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint to")
    ap.add_argument("--task", choices=("demo", "testbed"), default="demo",
                    help="demo: the bundled demo model; testbed: the reasoning testbed (default demo)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3000; 1400 for the testbed)")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this checkpoint's weights (default: none; the bundled demo model for the testbed)")
    ap.add_argument("--batch-size", type=int, default=None, help="problems per step (default 64; 48 for the testbed)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3; 1.5e-3 for the testbed)")
    ap.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--eval-every", type=int, default=500, help="steps between accuracy checks (default 500)")
    ap.add_argument("--eval-problems", type=int, default=200, help="held-out problems per accuracy check (default 200)")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 1400 if args.task == "testbed" else 3000
    if args.init is None and args.task == "testbed":
        args.init = DEMO_MODEL
    if args.lr is None:
        args.lr = 1.5e-3 if args.task == "testbed" else 3e-3
    if args.batch_size is None:
        args.batch_size = 48 if args.task == "testbed" else 64

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    tok = build_tokenizer()
    model = LlamaForCausalLM(ModelConfig.from_dict(hf_config()))
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    if args.init is not None:
        state = load_file(str(args.init / "model.safetensors"))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise SystemExit(f"--init {args.init}: not this model's shape (missing {missing}, unexpected {unexpected})")
        print(f"starting from {args.init}", flush=True)
    else:
        init_number_embeddings(model, tok, torch.Generator().manual_seed(args.seed))
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98),
    )
    warmup = max(1, args.steps // 30)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * frac)))

    held_out = (testbed_problems if args.task == "testbed" else problems)(EVAL_SEED, max(1, args.eval_problems))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"training {args.task} model: {n_params / 1e6:.2f}M parameters, {args.steps} steps x {args.batch_size}", flush=True)
    start = time.monotonic()
    smooth = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        inputs, targets, mask = make_batch(tok, rng, args.batch_size, args.task)
        logits = forward_dense(model, inputs)
        loss_tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        loss = (loss_tok * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if (step + 1) % 50 == 0:
            el = time.monotonic() - start
            print(f"step {step + 1}/{args.steps} loss {smooth:.4f} lr {lr_at(step):.2e} "
                  f"{el:.0f}s elapsed, ~{el / (step + 1) * (args.steps - step - 1):.0f}s left", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc = greedy_accuracy(model, tok, held_out)
            print(f"step {step + 1}: held-out greedy accuracy {acc:.1%}", flush=True)
    save_checkpoint(model, tok, args.out)
    print(f"wrote {args.out} in {time.monotonic() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
