"""The heatmap page: one self-contained HTML file (no external scripts, styles or fonts) that draws
both views. Served live by the telemetry service over HTTP (it re-reads `/api/heatmap` every two
seconds) and written as a static file, data embedded, by `cotserve heatmap --out FILE.html`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Callable

from cotserve.common.v1 import common_pb2
from cotserve.telemetry.v1 import telemetry_pb2

log = logging.getLogger("cotserve.telemetry")

METRIC_BY_NAME = {"e2e": telemetry_pb2.LATENCY_METRIC_E2E, "ttft": telemetry_pb2.LATENCY_METRIC_TTFT,
                  "tpot": telemetry_pb2.LATENCY_METRIC_TPOT, "queue": telemetry_pb2.LATENCY_METRIC_QUEUE}
METRIC_TITLES = {"e2e": "end-to-end latency", "ttft": "time to first token", "tpot": "time per output token",
                 "queue": "queue time"}
SLA_BY_NAME = {"": common_pb2.SLA_CLASS_UNSPECIFIED, "all": common_pb2.SLA_CLASS_UNSPECIFIED,
               "realtime": common_pb2.SLA_CLASS_REALTIME, "interactive": common_pb2.SLA_CLASS_INTERACTIVE,
               "batch": common_pb2.SLA_CLASS_BATCH}
KV_LEGEND = ("KV occupancy: share of the worker's KV-cache pool (its blocks) in use when the request was admitted. "
             "A paged cache preallocates most accelerator memory, so pool occupancy, not device memory, is what moves.")


def heatmap_request(metric: str, sla: str = "", tenant: str = "", window_s: float = 0, model_version: str = "") -> telemetry_pb2.GetHeatmapRequest:
    """The request for named filters; ValueError names the bad one and what is allowed."""
    if metric not in METRIC_BY_NAME:
        raise ValueError(f"metric: want one of {', '.join(METRIC_BY_NAME)}, got {metric!r}")
    if sla.lower() not in SLA_BY_NAME:
        raise ValueError(f"sla: want all, realtime, interactive or batch, got {sla!r}")
    if not (0 <= window_s <= 2**32 / 1000 - 1):
        raise ValueError(f"window_s: want 0 (all) up to 4294967, got {window_s}")
    return telemetry_pb2.GetHeatmapRequest(metric=METRIC_BY_NAME[metric], sla_class=SLA_BY_NAME[sla.lower()], tenant=tenant,
                                           window_ms=int(window_s * 1000), model_version=model_version)


def heatmap_json(resp: telemetry_pb2.GetHeatmapResponse, filters: dict) -> dict:
    metric = next(k for k, v in METRIC_BY_NAME.items() if v == resp.metric)
    return {
        "metric": metric, "title": METRIC_TITLES[metric], "filters": filters, "slot_ms": resp.slot_ms,
        "bucket_upper_ms": [None if math.isinf(b) else b for b in resp.bucket_upper_ms],
        "cells": [{"model_version": c.model_version, "kv_pct": c.kv_occupancy_pct, "count": c.count,
                   "p50": c.p50_ms, "p95": c.p95_ms, "p99": c.p99_ms} for c in resp.cells],
        "slices": [{"model_version": s.model_version, "start_unix_ms": s.start_unix_ms,
                    "buckets": [[i, n] for i, n in zip(s.bucket_indexes, s.counts)]} for s in resp.slices],
        "generated_unix_ms": int(time.time() * 1000), "kv_legend": KV_LEGEND,
    }


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cotserve latency heatmaps</title>
<style>
body{font:14px system-ui,sans-serif;margin:20px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 6px}
.meta{color:#666;margin-bottom:10px} table{border-collapse:collapse;background:#fff}
th,td{border:1px solid #ccc;padding:6px 10px;text-align:center} th{background:#eee}
td.cell{min-width:150px} td.empty{color:#aaa} .q{font-weight:600} .n{color:#555;font-size:12px}
.legend{color:#555;font-size:12px;max-width:900px;margin-top:6px} canvas{background:#fff;border:1px solid #ccc}
select,input{margin-right:12px}
</style></head><body>
<h1>cotserve latency heatmaps: <span id="metric-title"></span></h1>
<div class="meta" id="status">loading ...</div>
<div id="controls"></div>
<h2>Model version &times; KV-cache occupancy (P50 / P95 / P99, ms; colour: P50)</h2>
<table id="matrix"></table>
<div class="legend" id="kv-legend"></div>
<h2>Time &times; latency (requests per bucket, per time slot)</h2>
<div id="timeviews"></div>
<script>
const EMBEDDED = __EMBEDDED__;
const KV = [0, 25, 50, 75];
function fmt(v){ return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2); }
function heat(t){ // 0..1 -> green .. yellow .. red
  const h = 120 * (1 - Math.max(0, Math.min(1, t))); return `hsl(${h},70%,80%)`; }
function el(tag, attrs, text){ const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v); if (text !== undefined) e.textContent = text; return e; }
function bounds(data, i){ const up = data.bucket_upper_ms[i]; const lo = i ? data.bucket_upper_ms[i-1] : 0;
  return [lo, up === null ? Infinity : up]; }
function render(data){
  document.getElementById("metric-title").textContent = data.title;
  const total = data.cells.reduce((a, c) => a + c.count, 0);
  const f = data.filters || {};
  document.getElementById("status").textContent = `${total} requests` +
    (f.sla ? ` · class ${f.sla}` : " · all classes") + (f.tenant ? ` · tenant ${f.tenant}` : "") +
    (f.window_s ? ` · last ${f.window_s} s` : " · whole retention") +
    ` · updated ${new Date(data.generated_unix_ms).toLocaleTimeString()}`;
  document.getElementById("kv-legend").textContent = data.kv_legend;
  const table = document.getElementById("matrix"); table.replaceChildren();
  const head = el("tr"); head.append(el("th", {}, "model version"));
  for (const k of KV) head.append(el("th", {}, `${k}–${k + 25} %`)); table.append(head);
  const versions = [...new Set(data.cells.map(c => c.model_version))].sort();
  const maxP50 = Math.max(1e-9, ...data.cells.map(c => c.p50));
  for (const v of versions){
    const row = el("tr"); row.append(el("th", {}, v));
    for (const k of KV){
      const c = data.cells.find(c => c.model_version === v && c.kv_pct === k);
      if (!c){ row.append(el("td", {class: "cell empty", "data-version": v, "data-kv": k, "data-count": 0}, "—")); continue; }
      const td = el("td", {class: "cell", "data-version": v, "data-kv": k, "data-count": c.count,
                            "data-p50": c.p50, "data-p95": c.p95, "data-p99": c.p99});
      td.style.background = heat(c.p50 / maxP50);
      td.append(el("div", {class: "q"}, `${fmt(c.p50)} / ${fmt(c.p95)} / ${fmt(c.p99)}`), el("div", {class: "n"}, `n = ${c.count}`));
      row.append(td);
    }
    table.append(row);
  }
  if (!versions.length){ const r = el("tr"); r.append(el("td", {colspan: 5, class: "empty"}, "no requests yet")); table.append(r); }
  const tv = document.getElementById("timeviews"); tv.replaceChildren();
  for (const v of [...new Set(data.slices.map(s => s.model_version))].sort()){
    const slices = data.slices.filter(s => s.model_version === v);
    let maxIdx = 0, maxN = 1;
    for (const s of slices) for (const [i, n] of s.buckets){ maxIdx = Math.max(maxIdx, i); maxN = Math.max(maxN, n); }
    const t0 = Math.min(...slices.map(s => s.start_unix_ms)), t1 = Math.max(...slices.map(s => s.start_unix_ms));
    const cols = Math.round((t1 - t0) / data.slot_ms) + 1;
    const W = 900, H = 300, L = 70, B = 40, cw = (W - L - 10) / cols, plotH = H - B - 10;
    const top = (() => { const [lo, up] = bounds(data, maxIdx); return up === Infinity ? lo * 1.1 : up; })();
    const y = ms => H - B - Math.min(ms, top) / top * plotH;  // linear in milliseconds, like the PNG
    tv.append(el("div", {class: "meta"}, `${v}: ${slices.length} slots of ${data.slot_ms / 1000} s`));
    const cv = el("canvas", {width: W, height: H, "data-version": v, "data-slots": slices.length}); tv.append(cv);
    const g = cv.getContext("2d"); g.font = "11px sans-serif"; g.fillStyle = "#222";
    for (const s of slices){
      const x = L + Math.round((s.start_unix_ms - t0) / data.slot_ms) * cw;
      for (const [i, n] of s.buckets){
        const [lo, up] = bounds(data, i);
        g.fillStyle = `rgba(200,40,20,${0.15 + 0.85 * Math.log1p(n) / Math.log1p(maxN)})`;
        g.fillRect(x, y(up), Math.max(1, cw - 1), Math.max(1, y(lo) - y(up)));
      }
    }
    g.fillStyle = "#222"; g.strokeStyle = "#888"; g.beginPath(); g.moveTo(L, 5); g.lineTo(L, H - B); g.lineTo(W - 5, H - B); g.stroke();
    for (let k = 0; k <= 4; k++){ const ms = top * k / 4; g.fillText(`${ms >= 100 ? ms.toFixed(0) : ms.toFixed(1)} ms`, 4, y(ms) + 4); }
    g.fillText(new Date(t0).toLocaleTimeString(), L, H - B + 16);
    g.fillText(new Date(t1 + data.slot_ms).toLocaleTimeString(), W - 80, H - B + 16);
    g.fillText("time", W / 2, H - B + 30);
  }
}
function controls(){
  const p = new URLSearchParams(location.search), c = document.getElementById("controls");
  const sel = (name, opts) => { const s = el("select", {id: name});
    for (const o of opts){ const op = el("option", {value: o}, o || "all"); if ((p.get(name) || "") === o) op.selected = true; s.append(op); }
    s.onchange = () => { p.set(name, s.value); location.search = p.toString(); }; c.append(el("label", {}, name + " "), s); };
  sel("metric", ["ttft", "e2e", "tpot", "queue"]); sel("sla", ["", "realtime", "interactive", "batch"]);
}
async function refresh(){
  try {
    const r = await fetch("api/heatmap" + location.search);
    const data = await r.json();
    if (!r.ok) throw new Error(data.error);
    render(data);
  } catch (e) { document.getElementById("status").textContent = "cannot load: " + e.message; }
}
if (EMBEDDED) render(EMBEDDED); else { controls(); refresh(); setInterval(refresh, 2000); }
</script></body></html>
"""


def page_html(embedded: dict | None = None) -> str:
    """The page; with `embedded` data it is a static snapshot, else it polls `api/heatmap`."""
    data = "null" if embedded is None else json.dumps(embedded).replace("</", "<\\/")
    return _TEMPLATE.replace("__EMBEDDED__", data)


async def start_http(heatmap: Callable[[telemetry_pb2.GetHeatmapRequest], telemetry_pb2.GetHeatmapResponse],
                     host: str, port: int, ssl_context=None):
    """The page over HTTP (aiohttp, on the service's event loop, as the gateway's API): `/` (the page),
    `/api/heatmap` (JSON, query: metric, sla, tenant, window_s, model_version; answered by `heatmap`, the service's
    own) and `/healthz`. Returns the started runner (`await runner.cleanup()` stops it) and the bound port."""
    from aiohttp import web

    from cotserve.common.errors import CotserveError

    headers = {"Cache-Control": "no-store"}

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html", charset="utf-8", headers=headers)

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n", headers=headers)

    async def api(request: web.Request) -> web.Response:
        q = request.query
        try:
            filters = {"sla": q.get("sla", ""), "tenant": q.get("tenant", ""), "window_s": float(q.get("window_s", 0) or 0)}
            req = heatmap_request(q.get("metric", "ttft"), model_version=q.get("model_version", ""), **filters)
            body, status = heatmap_json(heatmap(req), filters), 200
        except (ValueError, CotserveError) as exc:
            body, status = {"error": getattr(exc, "message", str(exc))}, 400
        return web.json_response(body, status=status, headers=headers)

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/heatmap", api)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"http_port: cannot bind {host}:{port} ({exc.strerror})") from None
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
