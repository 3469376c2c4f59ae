"""Whether a model's calibrated codecs are the same on another CPU: the default model's codecs
of a recipe fitted from the same cached statistics in child processes whose OpenBLAS runs
different kernels (``OPENBLAS_CORETYPE``: what CPUs of those kinds run), each compared with
the first child's, and the first child's codecs saved with ``ModelCodec.save`` and loaded in
every child (``ModelCodec.load``). A codec differing means a different fingerprint: blocks and
saved prefixes coded with one are refused by the other.

    .venv/bin/python benches/codec_portability.py [--recipe calibrated-4bit] \
        [--coretypes default,Haswell,SkylakeX,Zen] [--out bench-out/portability]

Prints a table and writes ``portability.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys
from kakeyaturbo import assets, calibration, recipes
from kakeyaturbo.cache import codec_for
from kakeyaturbo.eval import model as model_mod
recipe, save, load = sys.argv[1], sys.argv[2], sys.argv[3]
mp, tp = assets.default_model(), assets.default_text()
model, tok = model_mod.load(mp)
rec = recipes.load(recipe)
stats, sens = calibration.for_recipe(rec, model, tok, mp, tp)
mc = codec_for(rec, stats=stats, sensitivity=sens)
if save:
    mc.save(save)
fps = lambda m: {f"{s}.{l}.{h}": c.fingerprint for (s, l, h), c in m.codecs.items()}
print(json.dumps({"fitted": fps(mc), "loaded": fps(calibration.ModelCodec.load(load)) if load else None}))
"""


def child(recipe: str, coretype: str, save: str, load: str) -> dict:
    env = dict(os.environ)
    if coretype != "default":
        env["OPENBLAS_CORETYPE"] = coretype
    run = subprocess.run([sys.executable, "-c", _CHILD, recipe, save, load], capture_output=True,
                         text=True, env=env, timeout=3600)
    if run.returncode != 0:
        raise SystemExit(f"child ({coretype}) failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="calibrated-4bit")
    ap.add_argument("--coretypes", default="default,Haswell,SkylakeX,Zen")
    ap.add_argument("--out", default="bench-out/portability")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    file = str(out / "codec.safetensors")
    types = args.coretypes.split(",")
    first = child(args.recipe, types[0], file, "")
    rows = [{"coretype": types[0], "codecs": len(first["fitted"]), "refit_differs": 0,
             "file_differs": None}]
    for t in types[1:]:
        got = child(args.recipe, t, "", file)
        rows.append({"coretype": t, "codecs": len(got["fitted"]),
                     "refit_differs": sum(got["fitted"][k] != v for k, v in first["fitted"].items()),
                     "file_differs": sum(got["loaded"][k] != v for k, v in first["fitted"].items())})
    print(f"{args.recipe}: codecs fitted from the same statistics under each OpenBLAS core type, "
          f"against the first ({types[0]}); the first's codec file loaded in each")
    print("| OPENBLAS_CORETYPE | codecs | fitted again: differ | loaded from the file: differ |")
    print("|---|---|---|---|")
    for r in rows:
        fd = "-" if r["file_differs"] is None else r["file_differs"]
        print(f"| {r['coretype']} | {r['codecs']} | {r['refit_differs']} | {fd} |")
    (out / "portability.json").write_text(json.dumps({"recipe": args.recipe, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
