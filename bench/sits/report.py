"""The scorecard's outputs: the matrix as text (each dimension's cell beside the seed's three
columns, and what could not be measured here, with why and where it would be), the JSON document,
a PNG chart of the figures (Pillow, which vLLM installs), and a self-contained HTML page (the table,
the chart inline, every figure)."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from bench.sits.card import DIMENSIONS, SEED_COLUMNS, Dimension

STATUS = {"measured": "measured", "partial": "measured, some figures not here", "not_measured": "NOT measured"}


def document(dims: list[Dimension], setup: dict) -> dict:
    return {"scorecard": "SITS2026 (seed 003)", "setup": setup, "seed_columns": list(SEED_COLUMNS),
            "dimensions": [d.as_dict() for d in dims]}


def text(doc: dict) -> str:
    s = doc["setup"]
    lines = [f"SITS2026 scorecard: {s['mesh']}, {s['host']}, {s['when']} ({s['seconds']:.0f} s)", ""]
    width = max(len(c) for c in [*SEED_COLUMNS, "GaaS, measured here"]) + 2
    number = {key: i for i, (key, _, _) in enumerate(DIMENSIONS, 1)}
    for d in doc["dimensions"]:
        lines.append(f"{number[d['key']]}. {d['title']}  [{STATUS[d['status']]}]")
        lines.append(f"   {'GaaS, measured here':<{width}}{d['cell'] or '-- ' + (d['reason'] or 'no figures')}")
        for col, cell in d["seed"].items():
            lines.append(f"   {col:<{width}}{cell}")
        for u in d["not_measured"]:
            lines.append(f"   not here: {u['what']}: {u['why']} (measured on {u['where']})")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ chart

COLORS = {"gaas": (38, 110, 190), "alt": (150, 150, 150), "seed": (205, 140, 60), "line": (200, 60, 60)}


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def _two_lines(label: str) -> str:
    """A label split at its middle space, for a bar's two lines."""
    words = label.replace(":", "").split()
    if len(words) < 2:
        return label
    cut = min(range(1, len(words)), key=lambda i: abs(len(" ".join(words[:i])) - len(" ".join(words[i:]))))
    return " ".join(words[:cut]) + "\n" + " ".join(words[cut:])


def _bars(draw, box, title: str, bars: list[tuple[str, float, str]], unit: str, target: float | None = None) -> None:
    x0, y0, x1, y1 = box
    small, big = _font(11), _font(13)
    draw.text((x0 + 6, y0 + 4), title, fill=(0, 0, 0), font=big)
    top, bottom = y0 + 40, y1 - 38
    if not bars:
        draw.text((x0 + 10, (top + bottom) // 2), "not measured here", fill=(120, 0, 0), font=small)
        return
    peak = max([v for _, v, _ in bars] + ([target] if target else [])) or 1.0
    slot = (x1 - x0 - 20) / len(bars)
    for i, (label, value, color) in enumerate(bars):
        bx = x0 + 10 + i * slot
        h = (bottom - top) * value / peak
        draw.rectangle((bx + slot * 0.15, bottom - h, bx + slot * 0.85, bottom), fill=COLORS[color])
        draw.text((bx + slot * 0.15, bottom - h - 14), f"{value:.3g}{unit}", fill=(0, 0, 0), font=small)
        for j, part in enumerate(label.split("\n")[:2]):
            draw.text((bx + 2, bottom + 4 + 12 * j), part[:14], fill=(40, 40, 40), font=small)
    if target:
        ty = bottom - (bottom - top) * target / peak
        draw.line((x0 + 8, ty, x1 - 8, ty), fill=COLORS["line"], width=1)
        draw.text((x1 - 90, ty - 13), f"target {target:.0f}{unit}", fill=COLORS["line"], font=small)


def _trace(draw, box, title: str, series: dict[str, list[tuple[float, float]]], note: str) -> None:
    x0, y0, x1, y1 = box
    small, big = _font(11), _font(13)
    draw.text((x0 + 6, y0 + 4), title, fill=(0, 0, 0), font=big)
    draw.text((x0 + 6, y0 + 20), note[:70], fill=(60, 60, 60), font=small)
    top, bottom, left, right = y0 + 44, y1 - 24, x0 + 34, x1 - 10
    points = [p for line in series.values() for p in line]
    if len(points) < 2:
        draw.text((x0 + 10, (top + bottom) // 2), "not measured here", fill=(120, 0, 0), font=small)
        return
    tmax = max(t for t, _ in points) or 1.0
    vmax = max(v for _, v in points) or 1.0
    draw.line((left, top, left, bottom, right, bottom), fill=(0, 0, 0))
    palette = [COLORS["gaas"], COLORS["seed"], COLORS["line"], COLORS["alt"]]
    for i, (name, line) in enumerate(sorted(series.items())):
        xy = [(left + (right - left) * t / tmax, bottom - (bottom - top) * v / vmax) for t, v in line]
        if len(xy) > 1:
            draw.line(xy, fill=palette[i % len(palette)], width=2)
        draw.text((left + 8, top + 14 * i), name, fill=palette[i % len(palette)], font=small)
    draw.text((x0 + 4, top - 4), f"{vmax:.0f}", fill=(0, 0, 0), font=small)
    draw.text((right - 40, bottom + 4), f"{tmax:.0f} s", fill=(0, 0, 0), font=small)


def chart_png(doc: dict) -> bytes:
    """Six panels, one a dimension, as PNG bytes."""
    from PIL import Image, ImageDraw

    dims = {d["key"]: d for d in doc["dimensions"]}

    def figures(key: str) -> dict:
        return (dims.get(key) or {}).get("figures") or {}
    w, h, cols = 1200, 760, 3
    img = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(img)
    draw.text((12, 8), f"SITS2026 scorecard - {doc['setup']['mesh']} - {doc['setup']['when']}", fill=(0, 0, 0),
              font=_font(16))
    pw, ph = w // cols, (h - 40) // 2

    def box(i: int) -> tuple[int, int, int, int]:
        r, c = divmod(i, cols)
        return (c * pw + 4, 40 + r * ph + 4, (c + 1) * pw - 4, 40 + (r + 1) * ph - 4)

    f = figures("gpu_aware_routing")
    bars = [(f"{name}\nTTFT p95", f[name]["ttft_p95_ms"], "gaas" if i == 0 else "alt")
            for i, name in enumerate(k for k in (f.get("policy") or "mesh policy", "round_robin") if k in f)]
    _bars(draw, box(0), "1 GPU-aware routing: skewed load", bars, " ms")
    f = figures("kv_cache_sharing")
    _bars(draw, box(1), "2 KV sharing: hit rate by level (%)",
          [(_two_lines(r["level"]), 100 * (r["hit_rate"] or 0), "gaas" if r["shared"] else "alt")
           for r in f.get("levels", ())], "%")
    f = figures("dynamic_batching")
    trace = (f.get("loop_on") or {}).get("trace") or []
    series: dict[str, list[tuple[float, float]]] = {}
    for p in trace:
        for worker, w in p["workers"].items():
            series.setdefault(worker, []).append((p["t"], w["window"]))
    note = ""
    if f.get("loop_on"):
        on = f["loop_on"]["phases"]["step"]["gold"]
        off = (f.get("loop_off") or {}).get("phases", {}).get("step", {}).get("gold")
        key = "mesh_ttft_p95_ms" if on.get("mesh_ttft_p95_ms") is not None else "ttft_p95_ms"
        note = (f"gold p95 in the step: {on[key]:.0f} ms on"
                + (f", {off[key]:.0f} ms off" if off and off.get(key) is not None else "")
                + f" (target {on['target_ms']:.0f})")
    _trace(draw, box(2), "3 batching: each worker's window (loop on)", series, note)
    f = figures("memory_fragmentation")
    seed = [(_two_lines(col), float(cells["memory_fragmentation"].rstrip("%")), "seed")
            for col, cells in SEED_COLUMNS.items()]
    ours = ([("GaaS\ninternal", 100 * f["internal_fragmentation"], "gaas"),
             ("GaaS\ndirectory", 100 * f["directory"]["fragmentation"], "gaas")] if f else [])
    _bars(draw, box(3), "4 fragmentation (%), seed vs measured", seed + ours, "%")
    f = figures("long_context_switch").get("switch")
    seed = [(_two_lines(col), float(cells["long_context_switch"].split()[0]), "seed")
            for col, cells in SEED_COLUMNS.items()]
    ours = [("GaaS\ncached", f["cached_ms"], "gaas")] if f else []
    _bars(draw, box(4), "5 switch 4K -> 32K (ms), cached session", seed + ours,
          " ms")
    f = figures("heterogeneous_orchestration")
    x0, y0, x1, _ = box(5)
    draw.text((x0 + 6, y0 + 4), "6 heterogeneous orchestration", fill=(0, 0, 0), font=_font(13))
    if f:
        lines = [f"{len(f['profiles'])} device profiles; decision {f['decision_us']:.0f} us"]
        lines += [f"{x['need'][:34]}: {len(x['fits'])} fit" for x in f["decisions"]][:8]
        lines += [f"serving: {b}" for b in f["backends"]][:2]
        for i, line in enumerate(lines):
            draw.text((x0 + 10, y0 + 30 + 16 * i), line[:60], fill=(30, 30, 30), font=_font(11))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


# ------------------------------------------------------------------------------------------- HTML

def page(doc: dict, png: bytes) -> str:
    e = html.escape
    s = doc["setup"]
    head = "".join(f"<th>{e(c)}</th>" for c in ["dimension", "GaaS, measured here", *SEED_COLUMNS])
    rows = []
    for d in doc["dimensions"]:
        cell = e(d["cell"]) if d["cell"] else f"<em>not measured: {e(d['reason'] or 'no figures')}</em>"
        notes = "".join(f"<li>{e(u['what'])}: {e(u['why'])} (<b>{e(u['where'])}</b>)</li>" for u in d["not_measured"])
        rows.append(f"<tr class='{d['status']}'><td><b>{e(d['title'])}</b></td><td>{cell}"
                    + (f"<ul class='notes'>{notes}</ul>" if notes else "") + "</td>"
                    + "".join(f"<td>{e(v)}</td>" for v in d["seed"].values()) + "</tr>")
    details = "".join(f"<details><summary>{e(d['title'])}: every figure</summary><pre>"
                      f"{e(json.dumps(d['figures'], indent=2))}</pre></details>" for d in doc["dimensions"])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>SITS2026 scorecard</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; width: 100%; }}
th, td {{ border: 1px solid #ccc; padding: .5em; vertical-align: top; text-align: left; }}
th {{ background: #f3f3f3; }}
tr.not_measured td:nth-child(2) {{ background: #fdecea; }}
tr.partial td:nth-child(2) {{ background: #fff8e1; }}
tr.measured td:nth-child(2) {{ background: #e8f5e9; }}
ul.notes {{ font-size: .85em; color: #555; margin: .4em 0 0 1em; padding: 0; }}
pre {{ background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: .8em; }}
img {{ max-width: 100%; border: 1px solid #ddd; margin: 1em 0; }}
</style></head><body>
<h1>SITS2026 scorecard</h1>
<p>{e(s['mesh'])}; {e(s['host'])}; {e(s['when'])}; {s['seconds']:.0f} s. Every GaaS cell is measured by this run;
the other three columns are seed 003's table, for reference.</p>
<table><tr>{head}</tr>{''.join(rows)}</table>
<img alt="the scorecard's figures" src="data:image/png;base64,{base64.b64encode(png).decode()}">
{details}
</body></html>
"""


def write_all(doc: dict, out_json: Path) -> tuple[Path, Path, Path]:
    """The JSON at out_json, the PNG and HTML beside it (same name); their paths."""
    from bench.common.output import write_json

    png = chart_png(doc)
    write_json(out_json, doc)
    png_path, html_path = out_json.with_suffix(".png"), out_json.with_suffix(".html")
    png_path.write_bytes(png)
    html_path.write_text(page(doc, png))
    return out_json, png_path, html_path
