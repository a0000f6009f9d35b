"""Logits to token ids, per request: greedy, temperature, top-k, top-p, seed, logprobs.

A seeded request draws from its own `torch.Generator`, advanced once per token, so its output
does not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cotserve.common.sampling import SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._shared = torch.Generator(device="cpu").manual_seed(seed)
        self._per_request: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's generator."""
        self._per_request.pop(seq_id, None)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._per_request.get(seq_id)
        if gen is None:
            gen = torch.Generator(device="cpu").manual_seed(params.seed)
            self._per_request[seq_id] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,  # [num_seqs, vocab]
        seq_ids: list[int],
        params: list[SamplingParams],
        banned: list[int | None] | None = None,  # per row: a token it may not sample (or None)
        want_logprobs: list[bool] | None = None,  # per row: the sampled token's logprob is needed (default: params.logprobs)
    ) -> SampleResult:
        logits = logits.float()
        if banned is not None and any(t is not None for t in banned):
            logits = logits.clone()
            for row, token in enumerate(banned):
                if token is not None:
                    logits[row, token] = float("-inf")
        greedy = logits.argmax(dim=-1).tolist()
        wants = want_logprobs if want_logprobs is not None else [p.logprobs for p in params]
        out_ids: list[int] = []
        out_lp: list[float | None] = []
        for row, (seq_id, p) in enumerate(zip(seq_ids, params)):
            if p.is_greedy:
                token = greedy[row]
                scaled = logits[row]
            else:
                scaled = self._filtered(logits[row] / p.temperature, p)
                probs = torch.softmax(scaled, dim=-1).cpu()
                token = int(torch.multinomial(probs, 1, generator=self._generator(seq_id, p)))
            out_ids.append(token)
            if wants[row]:
                out_lp.append(float(torch.log_softmax(scaled, dim=-1)[token]))
            else:
                out_lp.append(None)
        return SampleResult(out_ids, out_lp)

    @staticmethod
    def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [vocab]
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        return logits
