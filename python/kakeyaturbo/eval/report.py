"""Writing results: JSON, a Markdown table and a PNG of KL and dppl against all-in bits.

Every row says what ran it (``kind``): the codec, a numpy re-implementation of a published
formula (``numpy``), or a real library through its own code (the library and its version).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from .._files import write_atomically

Box = Tuple[float, float, float, float]

#: Marker and colour of each kind of method on the plot.
STYLE = {"codec": ("o", "tab:blue"), "baseline": ("s", "tab:orange"), "peer": ("D", "tab:green")}
#: dppl beyond this (in %) is drawn at the panel's edge, its value written beside it.
DPPL_CLIP = 5.0


def impl(r: Dict[str, Any]) -> str:
    """What ran a row: ``kakeyaturbo``, ``numpy`` (a re-implemented formula) or the library."""
    if r.get("impl") and r.get("kind") == "peer":
        return str(r["impl"])
    return {"codec": "kakeyaturbo", "baseline": "numpy", "peer": "library"}.get(r.get("kind", ""), "numpy")


def markdown(res: Dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [
        f"{meta['model']} | {meta['windows']} windows | ctx {meta['ctx']} | n_eval {meta['n_eval']}"
        f" | reference PPL {meta['ppl_ref']:.4f} | {meta['date']}",
        "",
        "| method | run by | bits/elem | x vs bf16 | dppl % (95 % CI) | top-1 % (95 % CI) | KL | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in _sorted(res):
        lo, hi = r["dppl_ci"]
        tlo, thi = r["top1_ci"]
        lines.append(
            f"| {name} | {impl(r)} | {r['bits_per_element']:.2f} | {r['ratio_vs_bf16']:.2f} | "
            f"{100 * r['dppl']:+.2f} ({100 * lo:+.2f}, {100 * hi:+.2f}) | "
            f"{100 * r['top1']:.1f} ({100 * tlo:.1f}, {100 * thi:.1f}) | {r['kl']:.4f} | {r['verdict']} |"
        )
    lines += ["", "run by: kakeyaturbo = this codec; numpy = re-implemented here from the method's "
                  "published formula; a library = run through that library's own code. "
                  "`+sink`: the first token kept raw, as the codec's recipes keep it."]
    return "\n".join(lines) + "\n"


def _sorted(res: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    return sorted(res["methods"].items(), key=lambda kv: -kv[1]["bits_per_element"])


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


# Offsets (points) tried in order for a label, nearest first, then further out.
_OFFSETS = [(dx * r, dy * r) for r in (1, 2, 3, 4)
            for dx, dy in ((5, 4), (5, -10), (-11, 4), (-11, -10), (7, -3), (-13, -3), (-3, 6), (-3, -13))]


#: Pixels kept free around every label.
_PAD = 3.0


def place_labels(ax: Any, points: Sequence[Tuple[float, float]], labels: Sequence[str],
                 fontsize: float = 7) -> List[Any]:
    """Writes ``labels`` beside ``points`` (data coordinates) so that no two labels and no label
    and marker overlap or come within ``_PAD`` pixels of each other: each label takes the first
    free offset of a fixed list around its point (nearest first), checked against everything
    placed so far in display coordinates. Returns the text objects."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    taken: List[Box] = []
    for x, y in points:  # the markers themselves, about 6 points across
        px, py = ax.transData.transform((x, y))
        r = 3 * fig.dpi / 72
        taken.append((px - r, py - r, px + r, py + r))
    frame = ax.get_window_extent(renderer)
    texts = []
    for (x, y), label in zip(points, labels):
        best = None
        for dx, dy in _OFFSETS:
            t = ax.annotate(label, (x, y), textcoords="offset points", xytext=(dx, dy),
                            fontsize=fontsize)
            bb = t.get_window_extent(renderer)
            # A gap of _PAD pixels around every label: labels that merely touch read as one.
            box = (bb.x0 - _PAD, bb.y0 - _PAD, bb.x1 + _PAD, bb.y1 + _PAD)
            inside = frame.x0 <= box[0] and box[2] <= frame.x1 and frame.y0 <= box[1] and box[3] <= frame.y1
            if inside and not any(_overlaps(box, o) for o in taken):
                best = (t, box)
                break
            t.remove()
        if best is None:  # nowhere free: the first offset, the legend still names the point
            t = ax.annotate(label, (x, y), textcoords="offset points", xytext=_OFFSETS[0], fontsize=fontsize)
            bb = t.get_window_extent(renderer)
            best = (t, (bb.x0, bb.y0, bb.x1, bb.y1))
        taken.append(best[1])
        texts.append(best[0])
    return texts


def plot(res: Dict[str, Any], path: Path) -> Dict[str, List[Box]]:
    """Two panels against all-in bits: mean KL (log scale) and dppl (%, the ACCEPT and MARGINAL
    bands shaded, values beyond +-10 % drawn at the edge with their value). Each method is a
    numbered marker (shape and colour by what ran it) named in the legend below. Returns the
    label boxes of each panel in pixels (for tests: no two overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = _sorted(res)
    n = len(rows)
    ncol = 2 if n > 8 else 1
    legend_h = 0.22 * math.ceil(n / ncol) + 0.4
    fig, (ax_kl, ax_d) = plt.subplots(1, 2, figsize=(11, 4.6 + legend_h))
    fig.subplots_adjust(bottom=(legend_h + 0.55) / (4.6 + legend_h), top=0.9, wspace=0.22,
                        left=0.07, right=0.98)
    kl_pts, d_pts, d_labels, handles, labels = [], [], [], [], []
    floor = min([r["kl"] for _, r in rows if r["kl"] > 0] or [1e-6]) / 3
    for i, (name, r) in enumerate(rows, 1):
        marker, colour = STYLE.get(r.get("kind", "baseline"), STYLE["baseline"])
        b = r["bits_per_element"]
        kl = max(r["kl"], floor)  # exact methods (KL 0) sit on the floor of the log axis
        ax_kl.plot([b], [kl], marker=marker, color=colour, ls="")
        kl_pts.append((b, kl))
        y = 100 * r["dppl"]
        lo, hi = (100 * v for v in r["dppl_ci"])
        if abs(y) > DPPL_CLIP:
            yc = math.copysign(DPPL_CLIP * 0.97, y)
            ax_d.plot([b], [yc], marker="^" if y > 0 else "v", color=colour, ls="")
            d_pts.append((b, yc))
            d_labels.append(f"{i}: {y:+.0f} %")
        else:
            ax_d.errorbar([b], [y], yerr=[[max(y - max(lo, -DPPL_CLIP), 0)], [max(min(hi, DPPL_CLIP) - y, 0)]],
                          fmt=marker, color=colour, capsize=2, ms=5)
            d_pts.append((b, y))
            d_labels.append(str(i))
        handles.append(Line2D([], [], marker=marker, color=colour, ls=""))
        labels.append(f"{i}  {name} ({impl(r)})" if r.get("kind") == "peer" else f"{i}  {name}")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean KL(reference || method), nats (log)")
    ax_d.axhspan(-1, 1, color="tab:green", alpha=0.08, lw=0)
    ax_d.axhspan(1, 3, color="tab:orange", alpha=0.08, lw=0)
    ax_d.axhspan(-3, -1, color="tab:orange", alpha=0.08, lw=0)
    ax_d.set_ylim(-DPPL_CLIP, DPPL_CLIP)
    ax_d.set_ylabel("dppl (%) vs uncompressed, 95 % CI")
    ax_d.set_title("|dppl| <= 1 %: ACCEPT band (green), <= 3 %: MARGINAL (orange)", fontsize=8)
    ax_kl.set_title("KL of the next-token distribution (0 drawn at the floor)", fontsize=8)
    bits = [r["bits_per_element"] for _, r in rows]
    ticks = [t for t in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16, 32) if min(bits) / 1.2 <= t <= max(bits) * 1.2]
    for ax in (ax_kl, ax_d):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("all-in bits per K/V element (whole model, log scale)")
        ax.grid(True, which="major", alpha=0.3)
        ax.margins(x=0.08, y=0.1)
    ax_d.set_ylim(-DPPL_CLIP, DPPL_CLIP)
    meta = res["meta"]
    fig.suptitle(f"{meta['model']}: {meta['windows']} windows, ctx {meta['ctx']}, n_eval {meta['n_eval']}")
    fig.canvas.draw()
    nums = [str(i) for i in range(1, n + 1)]
    boxes = {}
    for key, ax, pts, names in (("kl", ax_kl, kl_pts, nums), ("dppl", ax_d, d_pts, d_labels)):
        texts = place_labels(ax, pts, names)
        renderer = fig.canvas.get_renderer()
        boxes[key] = [tuple(t.get_window_extent(renderer).extents) for t in texts]
    kinds = [Line2D([], [], marker=m, color=c, ls="", label=k)
             for k, (m, c) in (("kakeyaturbo", STYLE["codec"]), ("numpy re-implementation", STYLE["baseline"]),
                               ("library peer", STYLE["peer"]))]
    fig.legend(handles=handles + kinds, labels=labels + [h.get_label() for h in kinds],
               loc="lower center", ncol=ncol, fontsize=7, frameon=False, handletextpad=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return boxes


def json_safe(v: Any) -> Any:
    """``v`` with every NaN or infinity replaced by None (``null``): JSON has no such numbers, and
    ``json.dumps`` would write ``NaN``, which JSON readers refuse."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def dumps(v: Any) -> str:
    """Valid JSON of ``v`` (non-finite numbers as ``null``)."""
    return json.dumps(json_safe(v), indent=1, allow_nan=False)


def write(res: Dict[str, Any], out: Path) -> Dict[str, Path]:
    """Writes ``results.json``, ``results.md`` and ``results.png`` into ``out``: all three, or
    (on an error) none, the old ones kept."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "results.png"}
    text, table = dumps(res), markdown(res)
    write_atomically([(paths["json"], lambda p: p.write_text(text)), (paths["md"], lambda p: p.write_text(table)),
                      (paths["png"], lambda p: plot(res, p))], "the results")
    return paths
