"""The heatmap as a PNG (matplotlib, headless): the version x KV-occupancy matrix on the left, the
time x latency density of each model version on the right."""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path


def _ms(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _matrix(fig, cell, data: dict, versions: list[str]) -> None:
    """The left panel: P50/P95/P99 per model version x KV-occupancy quarter, coloured by P50."""
    import matplotlib.pyplot as plt
    import numpy as np

    cells = data["cells"]
    ax = fig.add_subplot(cell)
    p50 = np.full((len(versions), 4), np.nan)
    for c in cells:
        p50[versions.index(c["model_version"]), c["kv_pct"] // 25] = c["p50"]
    cmap = plt.get_cmap("RdYlGn_r").copy()
    cmap.set_bad("#eeeeee")
    ax.imshow(np.ma.masked_invalid(p50), cmap=cmap, aspect="auto", vmin=0, vmax=max(1e-9, np.nanmax(p50) if cells else 1))
    for r in range(len(versions)):
        for k in range(4):
            if np.isnan(p50[r, k]):
                ax.text(k, r, "no requests", ha="center", va="center", fontsize=8, color="#999")
    for c in cells:
        r, k = versions.index(c["model_version"]), c["kv_pct"] // 25
        ax.text(k, r, f"P50 {_ms(c['p50'])}\nP95 {_ms(c['p95'])}\nP99 {_ms(c['p99'])}\nn = {c['count']}",
                ha="center", va="center", fontsize=9)
    ax.set_xticks(range(4), ["0–25 %", "25–50 %", "50–75 %", "75–100 %"])
    ax.set_yticks(range(len(versions)), [v if len(v) < 28 else v[:25] + "…" for v in versions])
    ax.set_xlabel("KV-cache pool occupancy at admission (paged pool, not device memory)")
    ax.set_title(f"{data['metric']} P50 / P95 / P99 (ms) per model version × KV occupancy\n(colour: P50)", fontsize=11)


def _density(fig, cell, data: dict, version: str) -> None:
    """A right-hand panel: one model version's requests per time slot x latency bucket."""
    import numpy as np
    from matplotlib.colors import LogNorm

    upper = [math.inf if b is None else b for b in data["bucket_upper_ms"]]
    ax = fig.add_subplot(cell)
    slices = [s for s in data["slices"] if s["model_version"] == version]
    t0 = min(s["start_unix_ms"] for s in slices)
    ncols = (max(s["start_unix_ms"] for s in slices) - t0) // data["slot_ms"] + 1
    max_idx = max(i for s in slices for i, _ in s["buckets"])
    density = np.zeros((max_idx + 1, ncols))
    for s in slices:
        for i, n in s["buckets"]:
            density[i, (s["start_unix_ms"] - t0) // data["slot_ms"]] += n
    edges_y = [0.0] + [u if math.isfinite(u) else upper[i - 1] * 1.1 for i, u in enumerate(upper[: max_idx + 1])]
    edges_x = [t0 / 1000 + k * data["slot_ms"] / 1000 for k in range(ncols + 1)]
    mesh = ax.pcolormesh(edges_x, edges_y, np.ma.masked_equal(density, 0), cmap="inferno_r",
                         norm=LogNorm(vmin=1, vmax=max(1, density.max())), shading="flat")
    fig.colorbar(mesh, ax=ax, label="requests")
    ticks = np.linspace(edges_x[0], edges_x[-1], min(6, ncols + 1))
    ax.set_xticks(ticks, [datetime.fromtimestamp(t).strftime("%H:%M:%S") for t in ticks], fontsize=8)
    ax.set_ylabel(f"{data['metric']} (ms)")
    ax.set_title(f"{version}: requests per {data['slot_ms'] / 1000:g} s slot × latency bucket", fontsize=11)


def render_png(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = data["cells"]
    versions = sorted({c["model_version"] for c in cells}) or ["(no requests)"]
    slice_versions = sorted({s["model_version"] for s in data["slices"]})
    nrows = max(1, len(slice_versions))
    fig = plt.figure(figsize=(15, 1.6 + 3.2 * max(nrows, 1 + 0.5 * len(versions))), dpi=100)
    grid = fig.add_gridspec(nrows, 2, width_ratios=[1, 1.25], wspace=0.25, hspace=0.5)
    f = data.get("filters") or {}
    scope = (f"class {f['sla']}" if f.get("sla") else "all classes") + (f", tenant {f['tenant']}" if f.get("tenant") else "")
    fig.suptitle(f"cotserve {data['title']} ({scope}, {sum(c['count'] for c in cells)} requests)", fontsize=13)
    _matrix(fig, grid[:, 0], data, versions)
    for row, version in enumerate(slice_versions):
        _density(fig, grid[row, 1], data, version)
    if not slice_versions:
        fig.add_subplot(grid[0, 1]).text(0.5, 0.5, "no requests yet", ha="center", va="center")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
