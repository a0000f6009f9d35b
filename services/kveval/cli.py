"""`cotserve kv eval | calibrate`: the quality cost of the compressed KV cache, measured."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cotserve.common.clitools import int_list, wide_console

kv_app = typer.Typer(help="The compressed KV cache: quality against full precision, per-layer sensitivity.", no_args_is_help=True)


def _load(model: Optional[Path], text: Path, device: str):
    from cotserve.worker.models.loader import load_model
    from cotserve.worker.config import DEMO_MODEL
    from cotserve.worker.sizing import resolve_device

    loaded = load_model(model or DEMO_MODEL, device=resolve_device(device))
    ids = loaded.tokenizer.encode(text.read_text(errors="replace")).ids
    return loaded, ids


def _contexts(text: str) -> list[int]:
    return int_list(text, "512,1024,2048", minimum=2)


@kv_app.command("eval")
def kv_eval(
    text: Path = typer.Option(..., exists=True, dir_okay=False, help="Text to evaluate on (tokenized with the model's tokenizer)."),
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: the bundled demo model)."),
    context: str = typer.Option("512,1024,2048", help="Comma-separated context lengths in tokens."),
    eval_tokens: int = typer.Option(64, min=1, help="Decode steps evaluated at the end of each window."),
    topk_dense_layers: str = typer.Option("", help="Comma-separated layers that read every page in the top-k configurations (e.g. 0,1)."),
    windows: int = typer.Option(4, min=1, help="Windows of each context length, evenly spaced over the text, pooled."),
    block_size: int = typer.Option(16, min=1, help="Tokens per KV page."),
    device: str = typer.Option("auto", help="cpu, cuda, cuda:N or auto."),
) -> None:
    """Perplexity, KL, top-1 agreement and KV bytes read per decode step of each cache configuration against full precision."""
    from rich.table import Table

    from cotserve.kveval.evaluate import evaluate_cache, standard_configs

    console = wide_console()
    loaded, ids = _load(model, text, device)
    dense = frozenset(int_list(topk_dense_layers, "0,1", minimum=0)) if topk_dense_layers else frozenset()
    if any(layer >= loaded.config.num_layers for layer in dense):
        raise typer.BadParameter(f"{sorted(dense)}: the model's layers are 0..{loaded.config.num_layers - 1}",
                                 param_hint="--topk-dense-layers")
    try:
        rows = evaluate_cache(loaded, ids, _contexts(context), eval_tokens, block_size, lambda pages: standard_configs(pages, dense),
                              progress=lambda m: console.print(m, style="dim"), windows=windows)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--context") from None
    table = Table(title=f"KV cache quality against full precision: {loaded.name}, {windows} window(s) x {eval_tokens} decode steps "
                        "per context")
    for col in ("context", "cache", "tokens", "perplexity", "ppl change", "mean KL", "top-1 agree", "KV bytes/step", "vs full"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.context), r.config, str(r.tokens), f"{r.perplexity:.3f}", f"{100 * r.ppl_change:+.2f}%", f"{r.mean_kl:.5f}",
                      f"{100 * r.top1_agreement:.1f}%", f"{r.bytes_per_step:,.0f}", f"{r.bytes_fraction:.3f}")
    console.print(table)


@kv_app.command("calibrate")
def kv_calibrate(
    text: Path = typer.Option(..., exists=True, dir_okay=False, help="Text to calibrate on."),
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: the bundled demo model)."),
    context: int = typer.Option(512, min=2, help="Context length in tokens."),
    eval_tokens: int = typer.Option(64, min=1, help="Decode steps measured."),
    budget: int = typer.Option(1, min=0, help="Layers that may stay at full precision."),
    device: str = typer.Option("auto", help="cpu, cuda, cuda:N or auto."),
) -> None:
    """Each layer's sensitivity (output KL when only that layer is FP8) and the skip list for a budget."""
    from cotserve.kveval.evaluate import calibrate

    loaded, ids = _load(model, text, device)
    if context > min(len(ids), loaded.config.max_context):
        raise typer.BadParameter(f"{context} tokens asked; the text has {len(ids)}, the model takes {loaded.config.max_context}",
                                 param_hint="--context")
    ranked = calibrate(loaded, ids, context, eval_tokens)
    for layer, kl in ranked:
        typer.echo(f"layer {layer:3d}: KL {kl:.6f}")
    skip = sorted(layer for layer, _ in ranked[:budget])
    typer.echo(f"recommended: --kv-cache-dtype fp8_e4m3 --kv-skip-layers {','.join(map(str, skip))}" if skip
               else "recommended: --kv-cache-dtype fp8_e4m3 (no layer kept at full precision)")


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """These commands on the `cotserve` command line."""
    root.add_typer(kv_app, name="kv")
