"""The HTML report: one self-contained, offline, deterministic page drawn from a :class:`ReportData`.

Charts are SVG generated here (so the page shows them even with scripts off, and the same input
gives byte-identical output: no timestamps, no random ids); a small inline script adds the
timeline tooltip and click-to-sort tables. Nothing is fetched from the network.

Large schedules: the timeline is cut into at most :data:`MAX_POINTS` buckets of consecutive steps
and each bucket shows its *highest* step (max per bucket, the step's own category split), so no
peak is ever smoothed away; transfers closer than half a pixel merge into one bar.
"""

from __future__ import annotations

import html
import json
import math
import re
from importlib import resources
from typing import Any, Mapping, Sequence

import numpy as np

from hloopt.report import ReportData
from hloopt.report.terminal import format_value
from hloopt.units import format_bytes, format_seconds

__all__ = ["MAX_POINTS", "render_html", "write_html"]

#: Most timeline points drawn (buckets of consecutive steps).
MAX_POINTS = 2000

#: Colors of well-known categories; others take the palette in order.
CATEGORY_COLORS = {
    "parameter": "#4e79a7", "parameters": "#4e79a7", "weights": "#4e79a7",
    "optimizer": "#76b7b2", "optimizer_state": "#76b7b2", "optimizer state": "#76b7b2",
    "inputs": "#9c755f", "input": "#9c755f",
    "residual": "#e15759", "residuals": "#e15759",
    "activation": "#ff9da7", "activations": "#ff9da7",
    "temporary": "#f28e2b", "temporaries": "#f28e2b",
    "output": "#59a14f", "outputs": "#59a14f",
    "gradient": "#b07aa1", "gradients": "#b07aa1",
    "constant": "#bab0ac", "static": "#bab0ac", "other": "#d3d3d3",
}
_PALETTE = ["#edc948", "#86bcb6", "#8cd17d", "#d4a6c8", "#9d7660", "#a0cbe8"]

# Chart geometry (SVG user units).
_W, _H = 1000, 340
_ML, _MR, _MT, _MB = 78, 16, 18, 34
_PW, _PH = _W - _ML - _MR, _H - _MT - _MB


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _f(x: float) -> str:
    """A coordinate with one decimal, no trailing zeros (deterministic, compact)."""
    s = f"{x:.1f}"
    return s[:-2] if s.endswith(".0") else s


def category_colors(categories: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    extra = iter(_PALETTE * (1 + len(categories) // len(_PALETTE)))
    for c in categories:
        out[c] = CATEGORY_COLORS.get(c.lower()) or next(extra)
    return out


def buckets(n: int, max_points: int = MAX_POINTS) -> np.ndarray:
    """Bucket edges over ``n`` steps: ``edges[i]:edges[i+1]`` is bucket ``i`` (at most max_points)."""
    b = min(n, max_points)
    return (np.arange(b + 1, dtype=np.int64) * n) // max(b, 1)


def downsample(data: ReportData, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The timeline as at most ``max_points`` buckets, each represented by its highest step."""
    n = data.num_steps
    cats = list(data.baseline_by_category)
    mat = np.array([np.asarray(data.baseline_by_category[c], dtype=np.int64) for c in cats]).reshape(len(cats), n)
    total = mat.sum(axis=0) if cats else np.zeros(n, dtype=np.int64)
    edges = buckets(n, max_points)
    starts = edges[:-1]
    # argmax of total within each bucket: first index of the bucket maximum.
    bmax = np.maximum.reduceat(total, starts) if n else np.zeros(0, dtype=np.int64)
    rep = np.empty(len(starts), dtype=np.int64)
    for i, (a, b) in enumerate(zip(starts, edges[1:])):
        rep[i] = a + int(np.argmax(total[a:b]))
    plan = None
    if data.plan_timeline is not None:
        plan_arr = np.asarray(data.plan_timeline, dtype=np.int64)
        plan = np.maximum.reduceat(plan_arr, starts) if n else plan_arr
    return {"edges": edges, "rep": rep, "mat": mat[:, rep] if cats else mat, "total": bmax, "plan": plan,
            "cats": cats}


def _nice_ticks(hi: float, count: int = 5) -> list[float]:
    if hi <= 0:
        return [0.0]
    raw = hi / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(hi // step) + 1)]


def _byte_ticks(hi: float) -> list[float]:
    """Ticks at round binary sizes (1, 2, 4, 8... KiB/MiB/GiB) or their 1/2.5/5 decimal multiples."""
    if hi <= 0:
        return [0.0]
    unit = 1024 ** max(0, int(math.log(hi, 1024)) if hi >= 1 else 0)
    return [t * unit for t in _nice_ticks(hi / unit, 5)]


def _memory_svg(data: ReportData, ds: Mapping[str, Any], colors: Mapping[str, str]) -> str:
    n = data.num_steps
    edges, mat, cats = ds["edges"], ds["mat"], ds["cats"]
    top = max([data.baseline_peak_bytes, data.plan_peak_bytes or 0, data.budget_bytes or 0, 1])
    ymax = top * 1.1
    hbm = data.device.get("hbm_bytes")

    def X(step: float) -> float:
        return _ML + _PW * step / max(n, 1)

    def Y(v: float) -> float:
        return _MT + _PH * (1 - v / ymax)

    parts: list[str] = [
        f'<svg id="memory-chart" class="chart" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="Device memory over the schedule" data-steps="{n}" data-buckets="{len(edges) - 1}">'
    ]
    # backward-pass shading
    if data.step_backward:
        bw = np.asarray(data.step_backward, dtype=bool)
        runs = np.flatnonzero(np.diff(np.concatenate([[0], bw.astype(np.int8), [0]])))
        for a, b in zip(runs[::2], runs[1::2]):
            parts.append(f'<rect class="bwd" x="{_f(X(a))}" y="{_MT}" width="{_f(X(b) - X(a))}" height="{_PH}"/>')
        if len(runs):
            parts.append(f'<text class="lbl muted" x="{_f(X(runs[0]) + 4)}" y="{_MT + 12}">backward</text>')
    # grid + y ticks
    for t in _byte_ticks(ymax):
        y = Y(t)
        parts.append(f'<line class="grid" x1="{_ML}" x2="{_W - _MR}" y1="{_f(y)}" y2="{_f(y)}"/>')
        parts.append(f'<text class="tick" x="{_ML - 6}" y="{_f(y + 4)}" text-anchor="end">'
                     f'{_esc(format_bytes(t))}</text>')
    for t in _nice_ticks(max(n - 1, 0), 8):
        x = X(t + 0.5)
        parts.append(f'<text class="tick" x="{_f(x)}" y="{_H - _MB + 16}" text-anchor="middle">{int(t)}</text>')
    parts.append(f'<text class="tick" x="{_W - _MR}" y="{_H - 4}" text-anchor="end">schedule step</text>')
    parts.append(f'<text class="tick" x="12" y="{_f(_MT + _PH / 2)}" text-anchor="middle" '
                 f'transform="rotate(-90 12 {_f(_MT + _PH / 2)})">device memory</text>')
    # stacked areas (step shape: each bucket is flat over its steps)
    xs = [X(e) for e in edges]
    cum = np.zeros(mat.shape[1] if mat.ndim == 2 else 0, dtype=np.int64)
    for ci, cat in enumerate(cats):
        lower = cum.copy()
        cum = cum + mat[ci]
        if not cum.any() and not lower.any():
            continue
        fwd, back = [], []
        for i in range(len(cum)):
            yt = _f(Y(cum[i]))
            fwd.append(f"{_f(xs[i])} {yt}L{_f(xs[i + 1])} {yt}")
        for i in range(len(lower) - 1, -1, -1):
            yb = _f(Y(lower[i]))
            back.append(f"{_f(xs[i + 1])} {yb}L{_f(xs[i])} {yb}")
        d = "M" + "L".join(fwd) + "L" + "L".join(back) + "Z"
        parts.append(f'<path class="area" data-cat="{_esc(cat)}" fill="{colors[cat]}" d="{d}"/>')
    # plan line
    if ds["plan"] is not None:
        pts = []
        for i, v in enumerate(ds["plan"]):
            yp = _f(Y(v))
            pts.append(f"{_f(xs[i])} {yp}L{_f(xs[i + 1])} {yp}")
        parts.append(f'<path id="plan-line" class="plan" d="M{"L".join(pts)}"/>')
    # budget and HBM lines
    if data.budget_bytes is not None:
        yl = _f(Y(data.budget_bytes))
        parts.append(f'<line id="budget-line" class="budget" x1="{_ML}" x2="{_W - _MR}" y1="{yl}" y2="{yl}"/>')
        parts.append(f'<text class="lbl budget-t" x="{_W - _MR - 4}" y="{_f(Y(data.budget_bytes) - 5)}" '
                     f'text-anchor="end">budget {_esc(format_bytes(data.budget_bytes))}</text>')
    if hbm and hbm <= ymax:
        yl = _f(Y(hbm))
        parts.append(f'<line class="hbm" x1="{_ML}" x2="{_W - _MR}" y1="{yl}" y2="{yl}"/>')
        parts.append(f'<text class="lbl muted" x="{_ML + 4}" y="{_f(Y(hbm) - 5)}">HBM {_esc(format_bytes(hbm))}</text>')
    # peak markers
    markers = [("peak", data.baseline_peak_step, data.baseline_peak_bytes, "base", -6)]
    if data.plan_peak_step is not None and data.plan_peak_bytes is not None:
        if (data.plan_peak_step, data.plan_peak_bytes) == (data.baseline_peak_step, data.baseline_peak_bytes):
            markers = [("peak, with and without plan", data.baseline_peak_step, data.baseline_peak_bytes, "base", -6)]
        else:
            # the plan's label goes below its point so the two never overprint
            markers.append(("plan peak", data.plan_peak_step, data.plan_peak_bytes, "planpk", 16))
    for label, step, value, cls, dy in markers:
        x, y = X(step + 0.5), Y(value)
        anchor = "end" if x > _ML + _PW * 0.75 else "start"
        dx = -8 if anchor == "end" else 8
        parts.append(f'<circle id="{cls}-peak" class="peak {cls}" cx="{_f(x)}" cy="{_f(y)}" r="4.5"/>')
        parts.append(f'<text class="lbl peak-t" x="{_f(x + dx)}" y="{_f(y + dy)}" text-anchor="{anchor}">'
                     f'{label} {_esc(format_bytes(value))} @ step {step}</text>')
    parts.append(f'<line id="hover-line" class="hover" x1="0" x2="0" y1="{_MT}" y2="{_MT + _PH}" visibility="hidden"/>')
    parts.append(f'<rect id="memory-hover" class="overlay" x="{_ML}" y="{_MT}" width="{_PW}" height="{_PH}"/>')
    parts.append(f'<line class="axis" x1="{_ML}" x2="{_W - _MR}" y1="{_MT + _PH}" y2="{_MT + _PH}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _host_svg(data: ReportData, edges: np.ndarray) -> str:
    """Host memory the plan holds over the schedule (the simulator's host timeline), each bucket
    at its highest step, with the host budget: the same steps as the device chart above."""
    if data.host_timeline is None:
        return ""
    n = data.num_steps
    host = np.asarray(data.host_timeline, dtype=np.int64)
    values = np.maximum.reduceat(host, edges[:-1]) if n else host
    H = 200
    PH = H - _MT - _MB
    most = int(values.max(initial=0))
    budget = data.host_budget_bytes
    # a host budget far above what the plan holds (hundreds of GiB of DRAM) is written, not drawn
    drawn = budget is not None and budget <= 4 * max(most, 1)
    ymax = max(most, budget if drawn and budget is not None else 0, 1) * 1.1

    def X(step: float) -> float:
        return _ML + _PW * step / max(n, 1)

    def Y(v: float) -> float:
        return _MT + PH * (1 - v / ymax)

    parts = [f'<svg id="host-chart" class="chart" viewBox="0 0 {_W} {H}" role="img" '
             f'aria-label="Host memory over the schedule" data-steps="{n}">']
    for t in _byte_ticks(ymax):
        y = Y(t)
        parts.append(f'<line class="grid" x1="{_ML}" x2="{_W - _MR}" y1="{_f(y)}" y2="{_f(y)}"/>')
        parts.append(f'<text class="tick" x="{_ML - 6}" y="{_f(y + 4)}" text-anchor="end">'
                     f'{_esc(format_bytes(t))}</text>')
    parts.append(f'<text class="tick" x="12" y="{_f(_MT + PH / 2)}" text-anchor="middle" '
                 f'transform="rotate(-90 12 {_f(_MT + PH / 2)})">host memory</text>')
    xs = [X(e) for e in edges]
    if len(values):
        top = "L".join(f"{_f(xs[i])} {_f(Y(v))}L{_f(xs[i + 1])} {_f(Y(v))}" for i, v in enumerate(values))
        parts.append(f'<path id="host-area" class="area" fill="var(--h2d)" fill-opacity="0.35" '
                     f'd="M{_f(xs[0])} {_f(Y(0))}L{top}L{_f(xs[-1])} {_f(Y(0))}Z"/>')
    if budget is not None and drawn:
        yl = _f(Y(budget))
        parts.append(f'<line id="host-budget-line" class="budget" x1="{_ML}" x2="{_W - _MR}" y1="{yl}" y2="{yl}"/>')
        parts.append(f'<text class="lbl budget-t" x="{_W - _MR - 4}" y="{_f(Y(budget) - 5)}" '
                     f'text-anchor="end">host budget {_esc(format_bytes(budget))}</text>')
    elif budget is not None:
        parts.append(f'<text id="host-budget-label" class="lbl budget-t" x="{_W - _MR - 4}" y="{_MT + 12}" '
                     f'text-anchor="end">host budget {_esc(format_bytes(budget))} (above the scale)</text>')
    parts.append(f'<line class="axis" x1="{_ML}" x2="{_W - _MR}" y1="{_MT + PH}" y2="{_MT + PH}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _merge_intervals(iv: list[tuple[float, float, str]], min_gap: float) -> list[tuple[float, float, str, int]]:
    out: list[tuple[float, float, str, int]] = []
    for a, b, name in sorted(iv):
        if out and a - out[-1][1] <= min_gap:
            pa, pb, pn, k = out[-1]
            out[-1] = (pa, max(pb, b), pn, k + 1)
        else:
            out.append((a, b, name, 1))
    return out


def _transfer_svg(data: ReportData) -> str:
    n = data.num_steps
    starts = list(data.step_start_s)
    if len(starts) == n and n:
        # the end of the last step is unknown; extend by the mean step length
        end = starts[-1] + (starts[-1] - starts[0]) / max(n - 1, 1)
    else:
        end = starts[-1] if starts else 0.0
    end = max([end] + [t.end_s for t in data.transfers])
    if end <= 0:
        return ""
    lanes = [("compute", 0), ("D2H", 1), ("H2D", 2)]
    H = 160
    lane_h, top = 30, 14

    def X(t: float) -> float:
        return _ML + _PW * t / end

    px = end / _PW
    parts = [f'<svg id="transfer-chart" class="chart" viewBox="0 0 {_W} {H}" role="img" '
             f'aria-label="Compute and host transfers over time">']
    for name, i in lanes:
        y = top + i * (lane_h + 6)
        parts.append(f'<text class="tick" x="{_ML - 6}" y="{y + lane_h / 2 + 4:.0f}" text-anchor="end">{name}</text>')
        parts.append(f'<rect class="lane" x="{_ML}" y="{y}" width="{_PW}" height="{lane_h}"/>')
    # compute lane: runs of forward / backward steps
    if starts:
        bw = list(data.step_backward) if data.step_backward else [False] * n
        bounds = starts[:n] + [end]
        i = 0
        while i < n:
            j = i
            while j + 1 < n and bw[j + 1] == bw[i]:
                j += 1
            cls = "bwd-c" if bw[i] else "fwd-c"
            a, b = X(bounds[i]), X(bounds[j + 1])
            what = "backward" if bw[i] else "forward"
            parts.append(f'<rect class="{cls}" x="{_f(a)}" y="{top}" width="{_f(max(b - a, 0.5))}" height="{lane_h}">'
                         f'<title>{what}: steps {i}-{j}, '
                         f'{_esc(format_seconds(bounds[j + 1] - bounds[i]))}</title></rect>')
            if b - a > 70:
                parts.append(f'<text class="lane-t" x="{_f(a + 6)}" y="{top + lane_h / 2 + 4:.0f}">{what}</text>')
            i = j + 1
    for lane, direction in ((1, "d2h"), (2, "h2d")):
        y = top + lane * (lane_h + 6)
        iv = [(t.start_s, t.end_s, f"{t.key}#{t.instance}") for t in data.transfers if t.direction == direction]
        for a, b, name, k in _merge_intervals(iv, px / 2):
            what = _esc(name) if k == 1 else f"{k} transfers from {_esc(name)}"
            parts.append(f'<rect class="{direction}" x="{_f(X(a))}" y="{y + 3}" width="{_f(max(X(b) - X(a), 1.0))}" '
                         f'height="{lane_h - 6}"><title>{direction.upper()} {what}: {_esc(format_seconds(a))} - '
                         f'{_esc(format_seconds(b))}</title></rect>')
    for t in _nice_ticks(end, 8):
        parts.append(f'<text class="tick" x="{_f(X(t))}" y="{H - 14}" text-anchor="middle">'
                     f'{_esc(format_seconds(t)) if t else "0"}</text>')
    parts.append(f'<text class="tick" x="{_W - _MR}" y="{H - 1}" text-anchor="end">time in the step</text>')
    parts.append("</svg>")
    return "".join(parts)


def _table(table_id: str, headers: Sequence[tuple[str, str]], rows: Sequence[Sequence[tuple[str, Any]]]) -> str:
    """A sortable table: headers are (label, "num"|"text"); cells are (text shown, sort value)."""
    out = [f'<table id="{table_id}" class="sortable"><thead><tr>']
    for label, kind in headers:
        out.append(f'<th data-type="{kind}" tabindex="0">{_esc(label)}</th>')
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for (_label, kind), (shown, value) in zip(headers, row):
            cls = ' class="num"' if kind == "num" else ""
            out.append(f'<td{cls} data-v="{_esc(value)}">{_esc(shown)}</td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _kv_table(table_id: str, items: Sequence[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in items)
    return f'<table id="{table_id}" class="kv"><tbody>{rows}</tbody></table>'


def _tooltip_data(data: ReportData, ds: Mapping[str, Any]) -> str:
    labels = data.step_labels
    payload = {
        "cats": ds["cats"],
        "n": data.num_steps,
        "edges": [int(e) for e in ds["edges"]],
        "rep": [int(r) for r in ds["rep"]],
        "label": [labels[int(r)] for r in ds["rep"]],
        "bwd": [bool(data.step_backward[int(r)]) for r in ds["rep"]] if data.step_backward else [],
        "v": [[int(x) for x in row] for row in ds["mat"]],
        "plan": [int(p) for p in ds["plan"]] if ds["plan"] is not None else None,
        "geom": {"left": _ML, "width": _PW, "W": _W},
    }
    return json.dumps(payload, separators=(",", ":")).replace("</", "<\\/")


def _summary_cards(data: ReportData) -> str:
    cards = [("Peak, all on device", format_bytes(data.baseline_peak_bytes),
              f"step {data.baseline_peak_step}: {data.step_labels[data.baseline_peak_step] if data.num_steps else ''}")]
    if data.budget_bytes is not None:
        cards.append(("Budget", format_bytes(data.budget_bytes), ""))
    if data.plan_peak_bytes is not None:
        d = data.plan_peak_bytes - data.baseline_peak_bytes
        fits = data.budget_bytes is None or data.plan_peak_bytes <= data.budget_bytes
        cards.append(("Peak with plan", format_bytes(data.plan_peak_bytes),
                      ("-" if d < 0 else "+") + format_bytes(abs(d)) + ("" if fits else " (over budget)")))
    if data.baseline_step_time_s is not None:
        sub = ""
        if data.plan_step_time_s is not None:
            sub = f"with plan {format_seconds(data.plan_step_time_s)} " \
                  f"({(data.plan_step_time_s / data.baseline_step_time_s - 1) * 100:+.1f}%)" \
                if data.baseline_step_time_s else f"with plan {format_seconds(data.plan_step_time_s)}"
        cards.append(("Step time", format_seconds(data.baseline_step_time_s), sub))
    if data.device_compute_s is not None and data.host_compute_s is not None:
        cards.append(("Compute, device / host", f"{format_seconds(data.device_compute_s)} / "
                      f"{format_seconds(data.host_compute_s)}",
                      "host: the optimizer update" if data.host_compute_s else "nothing computed on the host"))
    if data.host_timeline is not None:
        cards.append(("Host memory with plan", format_bytes(max(data.host_timeline, default=0)),
                      "" if data.host_budget_bytes is None else f"of {format_bytes(data.host_budget_bytes)} allowed"))
    hbm = data.device.get("hbm_bytes")
    if hbm:
        cards.append(("HBM per device", format_bytes(hbm), str(data.device.get("name", ""))))
    return "".join(f'<div class="card"><div class="k">{_esc(k)}</div><div class="v">{_esc(v)}</div>'
                   f'<div class="s">{_esc(s)}</div></div>' for k, v, s in cards)


def _subtitle(data: ReportData) -> str:
    parts = [f"HLO module {data.module_name}"] if data.target else []
    parts.append(f"on {data.device.get('name', '?')}")
    if data.plan_timeline is not None:
        parts.append("all residuals on device vs the plan"
                     + (f" for a budget of {format_bytes(data.budget_bytes)}" if data.budget_bytes is not None else ""))
    return ", ".join(parts)


def render_html(data: ReportData) -> str:
    """The report page for ``data`` (deterministic: the same data gives the same bytes)."""
    data.validate()
    ds = downsample(data)
    colors = category_colors(ds["cats"])
    legend = "".join(f'<span class="sw" style="background:{colors[c]}"></span>{_esc(c)}' for c in ds["cats"])
    if data.plan_timeline is not None:
        legend += '<span class="sw line"></span>with plan'
    if data.budget_bytes is not None:
        legend += '<span class="sw dash"></span>budget'
    sharding = ""
    if data.num_partitions > 1:
        mesh = "x".join(map(str, data.mesh)) if data.mesh else "unknown"
        sharding = (f'<p class="note" id="sharding">SPMD program on {data.num_partitions} devices '
                    f'(mesh {_esc(mesh)}): every figure is per device.</p>')
    transfer = _transfer_svg(data) if (data.transfers or data.step_start_s) else ""
    transfer_sec = ""
    if transfer:
        n_out = sum(1 for t in data.transfers if t.direction == "d2h")
        transfer_sec = ('<section><h2>Transfer schedule</h2><div class="legend">'
                        '<span class="sw" style="background:#94a3b8"></span>forward compute'
                        '<span class="sw" style="background:#475569"></span>backward compute'
                        '<span class="sw" style="background:var(--d2h)"></span>D2H: offload to host'
                        '<span class="sw" style="background:var(--h2d)"></span>H2D: reload before use</div>'
                        f'<p class="note">The plan\'s replay over one step: {n_out} offloads and '
                        f'{len(data.transfers) - n_out} reloads beside the compute; hover a bar for its residual.</p>'
                        f'{transfer}</section>')
    host_sec = ""
    if data.host_timeline is not None:
        host_sec = ('<section><h2>Host memory</h2><p class="note">What the plan keeps in host memory over '
                    'the same steps: argument groups placed there and offloaded residuals, with the host '
                    'budget.</p><div class="chartbox">' + _host_svg(data, ds["edges"]) + '</div></section>')
    with_plan = any(b.action for b in data.live_at_peak)
    live_rows = [[(b.name, b.name), (b.shape, b.shape), (format_bytes(b.bytes), b.bytes), (b.category, b.category)]
                 + ([(b.action or "-", b.action)] if with_plan else [])
                 + [(b.op_name or "-", b.op_name), (b.source or "-", b.source)] for b in data.live_at_peak]
    live = _table("live-table", [("buffer", "text"), ("shape", "text"), ("bytes", "num"), ("category", "text")]
                  + ([("plan", "text")] if with_plan else []) + [("op", "text"), ("source", "text")],
                  live_rows) if live_rows else '<p class="note">No buffer list was given.</p>'
    res_rows = [[(r.name or r.key, r.name or r.key), (r.shape, r.shape), (format_bytes(r.bytes), r.bytes),
                 (str(r.layers), r.layers), (r.action, r.action), (r.reason or "-", r.reason),
                 (r.source or "-", r.source)] for r in data.residuals]
    residuals = _table("residual-table", [("residual", "text"), ("shape", "text"), ("bytes", "num"),
                                          ("layers", "num"), ("decision", "text"), ("reason", "text"),
                                          ("source", "text")], res_rows) if res_rows else \
        '<p class="note">No residual candidates.</p>'
    device_items = [(k, format_value(k, v)) for k, v in data.device.items() if k not in ("sources",)]
    sources = data.device.get("sources") or {}
    device_items += [(f"source of {k}", str(v)) for k, v in sources.items()]
    device = _kv_table("device-table", device_items)
    assumptions = _kv_table("assumptions-table", list(data.assumptions.items())) if data.assumptions else \
        '<p class="note">None recorded.</p>'
    n = data.num_steps
    nb = len(ds["edges"]) - 1
    sampled = f" Drawn as {nb} buckets of consecutive steps, each showing its highest step." if nb < n else ""
    subs = {
        "TITLE": _esc(f"hloopt report: {data.target or data.module_name}"),
        "MODULE": _esc(data.target or data.module_name),
        "DEVICE": _esc(_subtitle(data)),
        "SHARDING": sharding,
        "CARDS": _summary_cards(data),
        "LEGEND": legend,
        "MEMORY_SVG": _memory_svg(data, ds, colors),
        "STEPS_NOTE": _esc(f"{n} steps.{sampled}"),
        "TRANSFER": host_sec + transfer_sec,
        "LIVE": live,
        "RESIDUALS": residuals,
        "DEVICE_TABLE": device,
        "ASSUMPTIONS": assumptions,
        "DATA": _tooltip_data(data, ds),
    }
    page = resources.files("hloopt.report").joinpath("template.html").read_text(encoding="utf-8")
    # one pass, so text inside a value (a module named "{{DATA}}") is never substituted again
    return re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: subs[m.group(1)], page)


def write_html(data: ReportData, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(data))
