"""Writing results: JSON, a Markdown table and a PNG plot of dppl against all-in bits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict


def markdown(res: Dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [
        f"{meta['model']} | {meta['windows']} windows | ctx {meta['ctx']} | n_eval {meta['n_eval']}"
        f" | reference PPL {meta['ppl_ref']:.4f} | {meta['date']}",
        "",
        "| method | bits/elem | x vs bf16 | dppl % (95 % CI) | top-1 % (95 % CI) | KL | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = sorted(res["methods"].items(), key=lambda kv: -kv[1]["bits_per_element"])
    for name, r in rows:
        lo, hi = r["dppl_ci"]
        tlo, thi = r["top1_ci"]
        lines.append(
            f"| {name} | {r['bits_per_element']:.2f} | {r['ratio_vs_bf16']:.2f} | "
            f"{100 * r['dppl']:+.2f} ({100 * lo:+.2f}, {100 * hi:+.2f}) | "
            f"{100 * r['top1']:.1f} ({100 * tlo:.1f}, {100 * thi:.1f}) | {r['kl']:.4f} | {r['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def plot(res: Dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in res["methods"].items():
        lo, hi = r["dppl_ci"]
        y = 100 * r["dppl"]
        marker = "o" if r["kind"] == "codec" else "s"
        ax.errorbar(r["bits_per_element"], y, yerr=[[y - 100 * lo], [100 * hi - y]],
                    fmt=marker, capsize=3)
        ax.annotate(name, (r["bits_per_element"], y), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    ax.axhline(1.0, ls="--", lw=0.8, c="grey")
    ax.axhline(-1.0, ls="--", lw=0.8, c="grey")
    ax.set_xlabel("all-in bits per K/V element (whole model)")
    ax.set_ylabel("dppl (%) vs uncompressed")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title(f"{res['meta']['model']}: {res['meta']['windows']} windows, ctx {res['meta']['ctx']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(res: Dict[str, Any], out: Path) -> Dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "results.png"}
    paths["json"].write_text(json.dumps(res, indent=1))
    paths["md"].write_text(markdown(res))
    plot(res, paths["png"])
    return paths
