"""The client's command: `cotserve generate`, one completion through a gateway with its timing line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from cotserve.common.sampling import DEFAULT_MAX_NEW_TOKENS


def _usage_error(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _reasoning(early_exit: bool, probe_every_steps: Optional[int], probe_every_tokens: Optional[int], agree: Optional[int],
               min_confidence: Optional[float], self_consistency: Optional[int], min_samples: Optional[int],
               vote_rule: str, confidence_weighted: bool, **budget: Any):
    """The request's reasoning options from the flags (None when none is set); a flag that needs another exits 2."""
    from cotserve.sdk import EarlyExit, Reasoning, SelfConsistency

    if (probe_every_steps is not None or probe_every_tokens is not None or agree is not None
            or min_confidence is not None) and not early_exit:
        _usage_error("--probe-every-steps, --probe-every-tokens, --agree and --min-confidence need --early-exit")
    if (min_samples is not None or confidence_weighted or vote_rule != "window") and self_consistency is None:
        _usage_error("--min-samples, --vote-rule and --confidence-weighted need --self-consistency")
    if vote_rule not in ("window", "posterior"):
        _usage_error(f"--vote-rule: {vote_rule!r} is not window or posterior")
    exit_opts = None
    if early_exit:
        steps = probe_every_steps if probe_every_steps is not None or probe_every_tokens is not None else 1
        exit_opts = EarlyExit(probe_every_tokens=probe_every_tokens, probe_every_steps=steps, agree=agree,
                              min_confidence=min_confidence)
    vote_opts = None
    if self_consistency is not None:
        vote_opts = SelfConsistency(self_consistency, min_samples=min_samples, rule=vote_rule,
                                    confidence_weighted=confidence_weighted)
    options = Reasoning(early_exit=exit_opts, self_consistency=vote_opts, **budget)
    return options if options.is_set else None


def _stream(client, prompt: str, single: bool, kwargs: dict[str, Any]) -> tuple[str, Any, Any, Any]:
    """Print text as it arrives (one sample), or each sample's line as it completes; the finish reasons, usage,
    timing and vote of the stream's last chunk."""
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    usage = timing = vote = None
    for chunk in client.stream(prompt, **kwargs):
        if single:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        texts.setdefault(chunk.index, []).append(chunk.text)
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
            if not single:
                typer.echo(f"[{chunk.index}] {''.join(texts[chunk.index])} ({chunk.finish_reason})")
        if chunk.usage is not None:  # the stream's last chunk
            usage, timing, vote = chunk.usage, chunk.timing, chunk.self_consistency
    return ", ".join(str(reasons[i]) for i in sorted(reasons)), usage, timing, vote


def _unary(client, prompt: str, single: bool, kwargs: dict[str, Any]) -> tuple[str, Any, Any, Any]:
    """Print the completion (or a line per sample); its finish reasons, usage, timing and vote."""
    result = client.generate(prompt, **kwargs)
    if single:
        sys.stdout.write(result.text)
    else:
        for c in result.choices:
            typer.echo(f"[{c.index}] {c.text} ({c.finish_reason})")
    reason = ", ".join(str(c.finish_reason) for c in result.choices)
    return reason, result.usage, result.timing, result.self_consistency


def _summary(reason: str, usage, timing, vote, single: bool) -> None:
    """The vote's table (if any) and the timing line."""
    cached = f" ({usage.cached_prompt_tokens} cached)" if usage.cached_prompt_tokens else ""
    thinking = f" ({usage.reasoning_tokens} reasoning)" if usage.reasoning_tokens else ""
    thinking += f" + {usage.probe_tokens} probe tokens" if usage.probe_tokens else ""
    newline = "\n" if single else ""  # after the streamed or printed text
    if vote is not None:
        table = ", ".join(f"{v.answer or '(none)'} x{v.count}" for v in vote.votes)
        typer.echo(f"vote: {vote.answer} ({table}; {vote.samples_used} samples used, {vote.samples_cancelled} cancelled, "
                   f"stopped by {vote.stop_reason})")
    typer.echo(f"{newline}[{reason} | {usage.prompt_tokens} prompt{cached} + {usage.completion_tokens} completion tokens"
               f"{thinking} | queue {timing.queue_ms:.1f} ms, ttft {timing.ttft_ms:.1f} ms, total {timing.total_ms:.1f} ms]")


def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    address: str = typer.Option("127.0.0.1:50051", envvar="COTSERVE_ADDRESS", help="Address of the gateway."),
    model: str = typer.Option("", help="Model name (empty: the only model served)."),
    max_new_tokens: int = typer.Option(DEFAULT_MAX_NEW_TOKENS, help="Tokens to generate at most."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature, 0..2 (0 = greedy; the default, or 1.0 with --self-consistency)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    sla: str = typer.Option("interactive", help="SLA class: realtime, interactive or batch."),
    api_key: Optional[str] = typer.Option(None, envvar="COTSERVE_API_KEY", help="API key, sent as a Bearer token."),
    timeout_s: Optional[float] = typer.Option(None, help="Deadline for the whole call, in seconds."),
    pre_processor: str = typer.Option("", help="Sandbox module run on the prompt first (e.g. cot-guard)."),
    post_processor: str = typer.Option("", help="Sandbox module run on the completed text (e.g. strip-think)."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it arrives (with --n, each sample's line as it completes)."),
    n: int = typer.Option(1, "--n", help="Samples of the prompt, 1..16: computed once, sampled n times (seed + i for sample i)."),
    cache_salt: str = typer.Option("", help="Share cached prompt blocks only with requests that give the same salt."),
    max_thinking_tokens: Optional[int] = typer.Option(None, help="Thinking tokens at most; then the forcing text ends the thinking and the model answers."),
    max_thinking_steps: Optional[int] = typer.Option(None, help="Reasoning steps at most (the worker's --reasoning-step ends a step)."),
    min_thinking_tokens: Optional[int] = typer.Option(None, help="The end of thinking cannot be sampled before this many thinking tokens."),
    forcing_text: Optional[str] = typer.Option(None, help="Text appended when a budget ends the thinking (default: the model's end marker)."),
    early_exit: bool = typer.Option(False, "--early-exit", help="Stop thinking once probes agree on the answer (every reasoning step unless --probe-every-tokens)."),
    probe_every_steps: Optional[int] = typer.Option(None, help="With --early-exit: probe after every this many reasoning steps (default 1)."),
    probe_every_tokens: Optional[int] = typer.Option(None, help="With --early-exit: probe after every this many thinking tokens instead of steps."),
    agree: Optional[int] = typer.Option(None, help="With --early-exit: probes in a row that must agree, 1..16 (default 2)."),
    min_confidence: Optional[float] = typer.Option(None, help="With --early-exit: the agreeing probes' mean token probability must reach this, (0, 1]."),
    self_consistency: Optional[int] = typer.Option(None, help="Vote over up to this many samples (1..64), stopping once the vote is settled; needs --temperature > 0."),
    min_samples: Optional[int] = typer.Option(None, help="With --self-consistency: samples per round and before any stop (default min(3, max))."),
    vote_rule: str = typer.Option("window", help="With --self-consistency: window (identical answers in a row) or posterior (the leader stays the majority)."),
    confidence_weighted: bool = typer.Option(False, "--confidence-weighted", help="With --self-consistency: weight votes by each sample's mean token probability."),
    tls_ca: Optional[Path] = typer.Option(None, envvar="COTSERVE_TLS_CA", help="Speak TLS to the gateway, trusting this PEM CA bundle."),
    tls_cert: Optional[Path] = typer.Option(None, envvar="COTSERVE_TLS_CLIENT_CERT", help="PEM client certificate, for a gateway that asks for mutual TLS (with --tls-key)."),
    tls_key: Optional[Path] = typer.Option(None, envvar="COTSERVE_TLS_CLIENT_KEY", help="PEM private key of --tls-cert."),
) -> None:
    """Generate a completion through the gateway and print it with its timing line."""
    from cotserve.sdk import Client, CotserveError

    reasoning = _reasoning(early_exit, probe_every_steps, probe_every_tokens, agree, min_confidence, self_consistency,
                           min_samples, vote_rule, confidence_weighted, max_thinking_tokens=max_thinking_tokens,
                           max_thinking_steps=max_thinking_steps, min_thinking_tokens=min_thinking_tokens,
                           forcing_text=forcing_text)
    if temperature is None:  # a vote needs samples that can differ
        temperature = 1.0 if self_consistency is not None else 0.0
    kwargs = dict(model=model, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, sla=sla,
                  timeout_s=timeout_s, api_key=api_key, pre_processor=pre_processor, post_processor=post_processor,
                  n=n, cache_salt=cache_salt, reasoning=reasoning)
    single = n == 1 and self_consistency is None  # one sample: its text alone; else a line per sample
    try:
        with Client(address, root_certificates=str(tls_ca) if tls_ca else None,
                    client_cert=str(tls_cert) if tls_cert else None, client_key=str(tls_key) if tls_key else None) as client:
            outcome = (_stream if stream else _unary)(client, prompt, single, kwargs)
    except CotserveError as err:
        typer.echo(f"error: {err.code.name}: {err.message}", err=True)
        raise typer.Exit(1) from None
    except (ValueError, OSError) as err:  # the TLS files
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    _summary(*outcome, single=single)


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """The client's command on the `cotserve` command line."""
    root.command("generate")(generate)
