"""Cross-domain evaluation: recipes calibrated on several corpora (each domain, the mixture),
evaluated by the EVAL.md protocol on the evaluation split of every domain, and the matrices
that show what a calibration is worth off its own domain.

Every method of one domain runs on the same windows against one uncompressed reference
(:func:`kakeyaturbo.eval.harness.evaluate`); a codec method is named
``kakeyaturbo:<recipe>@<calibration corpus>``. Results are kept per domain (``out/<domain>.json``)
so that a long run can be resumed and methods added to it: a domain whose file already holds a
method on the same windows does not run it again. Beside the results the file keeps what decides
them (the model's fingerprint and dtype, the text's identity, the windows and each method's
definition); results are reused only where all of it is the same.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .._files import write_atomically
from ..calibration import corpus, for_recipe_groups
from ..calibration.bundle import fingerprint
from ..calibration.gather import model_dtype
from ..errors import CorruptDataError, InvalidParameterError, KakeyaError
from . import report

Progress = Callable[[str], Callable[[Iterable[Any]], Iterable[Any]]]


def method_name(recipe: Any, calibration: str) -> str:
    return f"kakeyaturbo:{recipe.name}@{corpus.describe(calibration)}"


def methods_for(model: Any, tok: Any, model_path: Any, recipes: Sequence[Any],
                calibrations: Sequence[str], baselines: Sequence[str], *,
                progress: Progress = lambda _d: lambda it: it) -> List[Any]:
    """The baselines, then every recipe calibrated on every corpus (statistics from the cache,
    collected where missing, for every group of K/V layers of one shape; recipes with the same
    calibration settings share them)."""
    from ..families import describe
    from . import harness

    layers = describe(model).num_layers  # a multimodal model's config holds its decoder's
    methods = harness.baseline_methods(list(baselines))
    got: Dict[Any, Any] = {}
    for cal in calibrations:
        for rec in recipes:
            if rec.mode != "calibrated":
                if cal == calibrations[0]:
                    methods.append(harness.codec_method(rec, layers))
                continue
            key = (cal, rec.calibration, max(rec.n_sink, 1), rec.needs_sensitivity)
            if key not in got:
                got[key] = for_recipe_groups(rec, model, tok, model_path, cal, progress=progress)
            (stats, sens), *groups = got[key]
            m = harness.codec_method(rec, layers, stats=stats, sensitivity=sens, groups=groups)
            methods.append(replace(m, name=method_name(rec, cal)))
    return methods


def _read(path: Path) -> Dict[str, Any]:
    """A results file :func:`run` wrote; CorruptDataError naming it when it is not such a file."""
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptDataError(f"results file {str(path)!r} is damaged: it is not JSON ({e}); delete "
                               "it to run its domain again") from None
    if not isinstance(got, dict) or not isinstance(got.get("methods"), dict):
        raise CorruptDataError(f"results file {str(path)!r} is damaged: it holds no methods")
    return got


def definition(method: Any) -> Optional[Dict[str, Any]]:
    """What decides a method's results besides its name: its kind, what runs it, its sink,
    streams and boundary layers, and its codec's identity (None for a codec that cannot be
    identified: such a method is never taken from an earlier run)."""
    codec = None
    if method.codec is not None:
        from ..cache.persist import codec_identity

        try:
            codec = codec_identity(method.codec)["fingerprint"]
        except KakeyaError:
            return None
    return {"kind": method.kind, "impl": method.impl, "n_sink": int(method.n_sink),
            "streams": list(method.streams), "boundary": [int(i) for i in method.boundary], "codec": codec}


def identity(model: Any) -> Dict[str, Any]:
    """The model as results depend on it: type, fingerprint of the attention weights, dtype."""
    from ..families import describe

    return {"type": describe(model).model_type, "fingerprint": fingerprint(model), "dtype": model_dtype(model)}


def run(model: Any, tok: Any, methods: Sequence[Any], domains: Sequence[str], *, windows: int,
        ctx: int, n_eval: int, out: Optional[Path] = None, meta: Optional[Dict[str, Any]] = None,
        progress: Progress = lambda _d: lambda it: it) -> Dict[str, Any]:
    """Every method on ``windows`` evaluation windows of ``ctx + n_eval + 1`` tokens of each
    domain. Returns ``{"meta": ..., "domains": {domain: {"windows", "ppl_ref", "methods":
    {name: comparison}}}}``; with ``out``, each domain is written to ``out/<domain>.json`` as it
    finishes and read back when the run is repeated: its finished methods are kept where the
    model, the text, the windows and the method's definition are the same (else run again).
    CorruptDataError naming the file when it is damaged."""
    from . import harness

    res: Dict[str, Any] = {"meta": dict(meta or {}, windows=windows, ctx=ctx, n_eval=n_eval),
                           "domains": {}}
    model_id = identity(model) if out is not None else None
    defs = {m.name: definition(m) for m in methods}
    for d in domains:
        path = None if out is None else Path(out) / f"{corpus.describe(d)}.json"
        ident = {"model": model_id, "text": corpus.key(d), "windows_asked": windows, "ctx": ctx, "n_eval": n_eval}
        have: Dict[str, Any] = {}
        if path is not None and path.is_file():
            old = _read(path)
            if old.get("identity") == ident:
                have = old
        old_defs = have.get("definitions", {})
        done = {n: r for n, r in have.get("methods", {}).items()
                if n not in defs or (defs[n] is not None and old_defs.get(n) == defs[n])}
        todo = [m for m in methods if m.name not in done]
        if todo:
            wins = corpus.evaluation_windows(tok, d, windows, ctx + n_eval + 1)
            if not wins:
                raise InvalidParameterError(f"domain {d!r} holds no evaluation window of "
                                            f"{ctx + n_eval + 1} tokens")
            r = harness.evaluate(model, wins, ctx, todo, progress=progress(f"{d}"))
            ppl_ref = next(iter(r.values()))["ppl_ref"]
            kept = {n: old_defs.get(n) for n in done}
            have = {"domain": d, "windows_asked": windows, "windows": len(wins), "ctx": ctx,
                    "n_eval": n_eval, "ppl_ref": ppl_ref, "methods": dict(done, **r), "identity": ident,
                    "definitions": dict(kept, **{m.name: defs[m.name] for m in todo})}
            # As JSON holds it (tuples as lists, no NaN): a resumed run reads back the same values.
            text = report.dumps(have)
            have = json.loads(text)
            if path is not None:
                write_atomically([(path, lambda p, text=text: p.write_text(text))], "the domain's results")
        res["domains"][d] = have
    return res


def load(dirs: Sequence["Path | str"], domains: Sequence[str]) -> Dict[str, Any]:
    """The results :func:`run` kept in several folders (``<dir>/<domain>.json``), merged per
    domain: methods run on the same windows (same ``windows``, ``ctx`` and ``n_eval``) against the
    same reference, e.g. a baseline run and a later run of other calibrations. Raises
    InvalidParameterError when two folders hold a domain on other windows, or of another model or
    text; CorruptDataError naming a damaged file."""
    res: Dict[str, Any] = {"meta": {"from": [str(d) for d in dirs]}, "domains": {}}
    for d in domains:
        name = corpus.describe(d)
        for folder in dirs:
            path = Path(folder) / f"{name}.json"
            if not path.is_file():
                continue
            got = _read(path)
            have = res["domains"].get(d)
            if have is None:
                res["domains"][d] = got
                continue
            if (have.get("windows"), have.get("ctx"), have.get("n_eval")) != \
                    (got.get("windows"), got.get("ctx"), got.get("n_eval")):
                raise InvalidParameterError(f"{path} holds {name} on other windows than "
                                            f"{dirs[0]}")
            a, b = have.get("identity") or {}, got.get("identity") or {}
            for what in ("model", "text"):
                if a.get(what) is not None and b.get(what) is not None and a[what] != b[what]:
                    raise InvalidParameterError(f"{path} holds {name} of another {what} than {dirs[0]}: "
                                                f"{b[what]} against {a[what]}")
            have["methods"] = dict(have["methods"], **got["methods"])
    return res


def _cell(r: Optional[Dict[str, Any]]) -> str:
    if r is None:
        return "-"
    v = {"ACCEPT": "A", "MARGINAL": "M", "REJECT": "R"}.get(r["verdict"], "?")
    return f"{100 * r['dppl']:+.2f} / {100 * r['top1']:.1f} / {r['kl']:.4f} {v}"


def matrix(res: Dict[str, Any], prefix: str = "", exclude: Optional[str] = None) -> str:
    """One Markdown table: a row per method (those whose name starts with ``prefix`` and not
    with ``exclude``), a column per domain; each cell ``dppl % / top-1 % / KL`` and the
    verdict's letter (A, M, R)."""
    doms = list(res["domains"])
    names: List[str] = []
    for d in doms:
        for n in res["domains"][d]["methods"]:
            if exclude is not None and n.startswith(exclude):
                continue
            if n.startswith(prefix) and n not in names:
                names.append(n)
    bits = {}
    for d in doms:
        for n, r in res["domains"][d]["methods"].items():
            bits.setdefault(n, r["bits_per_element"])
    lines = ["| method | bits/elem | " + " | ".join(corpus.describe(d) for d in doms) + " |",
             "|---|---|" + "---|" * len(doms)]
    for n in names:
        lines.append(f"| {n} | {bits[n]:.2f} | "
                     + " | ".join(_cell(res["domains"][d]["methods"].get(n)) for d in doms) + " |")
    refs = " | ".join(f"{res['domains'][d]['ppl_ref']:.3f} ({res['domains'][d]['windows']})"
                      for d in doms)
    lines.append(f"| reference PPL (windows) | 16 | {refs} |")
    return "\n".join(lines) + "\n"


def long_table(res: Dict[str, Any], prefix: str = "") -> str:
    """One Markdown row per (domain, method whose name starts with ``prefix``): dppl % and top-1 %
    with their bootstrap 95 % intervals over windows, KL and the verdict."""
    lines = ["| domain | method | bits/elem | dppl % (95 % CI) | top-1 % (95 % CI) | KL | verdict |",
             "|---|---|---|---|---|---|---|"]
    for d, dom in res["domains"].items():
        for n, r in dom["methods"].items():
            if not n.startswith(prefix):
                continue
            lo, hi = r["dppl_ci"]
            tlo, thi = r["top1_ci"]
            lines.append(f"| {corpus.describe(d)} | {n} | {r['bits_per_element']:.2f} | "
                         f"{100 * r['dppl']:+.2f} ({100 * lo:+.2f}, {100 * hi:+.2f}) | "
                         f"{100 * r['top1']:.1f} ({100 * tlo:.1f}, {100 * thi:.1f}) | "
                         f"{r['kl']:.4f} | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def goals(res: Dict[str, Any], name: str, *, top1_floor: Optional[float] = None,
          verdicts: Tuple[str, ...] = ("ACCEPT",)) -> Dict[str, Any]:
    """Whether method ``name`` meets a goal on every domain: its verdict in ``verdicts`` and,
    when given, top-1 at least ``top1_floor``; per domain the verdict and top-1."""
    per = {}
    ok = True
    for d, dom in res["domains"].items():
        r = dom["methods"].get(name)
        if r is None:
            per[d] = None
            ok = False
            continue
        good = r["verdict"] in verdicts and (top1_floor is None or r["top1"] >= top1_floor)
        per[d] = {"verdict": r["verdict"], "top1": r["top1"], "dppl": r["dppl"], "met": good}
        ok = ok and good
    return {"method": name, "met": ok, "domains": per}
