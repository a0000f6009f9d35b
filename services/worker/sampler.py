"""Logits to token ids for the whole batch: logit bias, repetition / frequency / presence penalties, greedy,
temperature, min-p, top-k, top-p, seed, logprobs.

A seeded request draws from its own `torch.Generator`, advanced once per token, so its output
does not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cotserve.common.sampling import SamplingParams


def penalized(logits: torch.Tensor, params: list[SamplingParams],
              history: list[tuple[list[int], list[int]]] | None) -> torch.Tensor:
    """`logits` (a copy, where any row asks) with each row's logit bias added and its penalties applied, as OpenAI
    and vLLM define them: every token of the prompt or the output so far has a positive logit divided by the
    repetition penalty and a negative one multiplied by it; every generated token loses the presence penalty once
    and the frequency penalty per time it was generated. The rows that penalize are done together."""
    rows = [r for r, p in enumerate(params) if p.logit_bias or p.penalizes]
    if not rows:
        return logits
    logits, dev, vocab = logits.clone(), logits.device, logits.shape[-1]
    pen = [r for r in rows if params[r].penalizes]
    if pen:
        if history is None:
            raise ValueError("sampler: penalties need each row's tokens (history)")
        counts = torch.zeros(len(pen), vocab, device=dev)
        seen = torch.zeros(len(pen), vocab, dtype=torch.bool, device=dev)
        for i, r in enumerate(pen):
            prompt, output = history[r]
            if output:
                counts[i].index_add_(0, torch.tensor(output, device=dev), torch.ones(len(output), device=dev))
            if params[r].repetition_penalty != 1.0 and prompt:
                seen[i, torch.tensor(prompt, device=dev)] = True
        seen |= counts > 0
        column = lambda name: torch.tensor([getattr(params[r], name) for r in pen], device=dev)[:, None]  # noqa: E731
        sub = logits[pen]
        rep = column("repetition_penalty")
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
        logits[pen] = sub
    for r in rows:
        if params[r].logit_bias:
            ids, bias = zip(*params[r].logit_bias)
            logits[r, list(ids)] += torch.tensor(bias, device=dev)
    return logits


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top: list[tuple[tuple[int, ...], tuple[float, ...]] | None] | None = None
    """Per row that asked for `top_logprobs`: the most likely token ids and their logprobs, most likely first."""


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
        allowed: tuple[torch.Tensor, list[int]] | None = None,  # structured output: token bitmask and the rows it holds
        history: list[tuple[list[int], list[int]]] | None = None,  # per row: (prompt ids, output ids), for penalties
    ) -> SampleResult:
        """The whole batch in a few tensor operations: bans, greedy argmax, temperature, top-k and top-p
        (each row with its own values), softmax and logprobs. Only the draw itself is per row for a
        seeded request (its own generator, so its tokens do not depend on the batch); every unseeded
        row draws in one call from the shared generator."""
        logits = self._restricted(penalized(logits.float(), params, history), banned, allowed)
        tokens = logits.argmax(dim=-1)
        scaled = logits  # what each row's logprob is taken over: the filtered, tempered logits when sampling
        sampled = [r for r, p in enumerate(params) if not p.is_greedy]
        if sampled:
            dev = logits.device
            rows = torch.tensor(sampled, device=dev)
            temps = torch.tensor([params[r].temperature for r in sampled], device=dev)
            filtered = self._filtered(logits.index_select(0, rows) / temps[:, None], [params[r] for r in sampled])
            probs = torch.softmax(filtered, dim=-1).cpu()
            drawn = torch.empty(len(sampled), dtype=torch.int64)
            shared = [i for i, r in enumerate(sampled) if params[r].seed is None]
            if shared:
                drawn[shared] = torch.multinomial(probs[shared], 1, generator=self._shared).squeeze(1)
            for i, r in enumerate(sampled):
                if params[r].seed is not None:
                    drawn[i] = torch.multinomial(probs[i], 1, generator=self._generator(seq_ids[r], params[r]))[0]
            tokens = tokens.clone()
            tokens[rows] = drawn.to(dev)
            scaled = logits.clone()
            scaled[rows] = filtered
        wants = want_logprobs if want_logprobs is not None else [p.logprobs for p in params]
        out_lp: list[float | None] = [None] * len(params)
        top: list[tuple[tuple[int, ...], tuple[float, ...]] | None] | None = None
        asked = [r for r, w in enumerate(wants) if w]
        if asked:
            idx = torch.tensor(asked, device=logits.device)
            all_lp = torch.log_softmax(scaled.index_select(0, idx), dim=-1)
            lp = all_lp.gather(1, tokens.index_select(0, idx)[:, None])
            for r, value in zip(asked, lp.squeeze(1).tolist()):
                out_lp[r] = value
            k = max(params[r].top_logprobs for r in asked)
            if k:
                top = [None] * len(params)
                values, ids = all_lp.topk(k, dim=-1)
                for r, row_ids, row_lp in zip(asked, ids.tolist(), values.tolist()):
                    kr = params[r].top_logprobs
                    if kr:
                        top[r] = (tuple(row_ids[:kr]), tuple(row_lp[:kr]))
        return SampleResult(tokens.tolist(), out_lp, top)

    @staticmethod
    def _restricted(logits: torch.Tensor, banned: list[int | None] | None,
                    allowed: tuple[torch.Tensor, list[int]] | None) -> torch.Tensor:
        """`logits` (a copy, where anything changes) with each row's banned token and the tokens its structured-output
        mask leaves out at -inf."""
        original = logits
        if banned is not None and any(t is not None for t in banned):
            rows = [r for r, t in enumerate(banned) if t is not None]
            logits = logits.clone()
            logits[rows, [banned[r] for r in rows]] = float("-inf")
        if allowed is not None:
            from cotserve.worker.grammar import apply_masks

            logits = logits.clone() if logits is original else logits
            apply_masks(logits, *allowed)
        return logits

    @staticmethod
    def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:  # [rows, vocab]
        """Top-k then top-p, each row with its own k and p (k = 0 and p = 1 leave a row as it is)."""
        vocab = logits.shape[-1]
        mins = [p.min_p for p in params]
        if max(mins) > 0.0:  # tokens below min_p x the likeliest one's probability (of the tempered logits)
            probs = torch.softmax(logits, dim=-1)
            floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(mins, device=logits.device)[:, None]
            logits = logits.masked_fill(probs < floor, float("-inf"))
        ks = [p.top_k if p.top_k and p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        if min(ks) == vocab and min(top_ps) >= 1.0:
            return logits
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        if min(ks) < vocab:
            # keep every logit at least the k-th largest (ties with it stay, as with a threshold)
            kth = sorted_logits.gather(1, torch.tensor(ks, device=logits.device)[:, None] - 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if min(top_ps) < 1.0:
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            p_sorted = torch.softmax(sorted_logits, dim=-1)
            drop = p_sorted.cumsum(dim=-1) - p_sorted >= torch.tensor(top_ps, device=logits.device)[:, None]
            drop &= torch.tensor([p < 1.0 for p in top_ps], device=logits.device)[:, None]
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits
