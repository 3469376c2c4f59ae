"""What ``kakeyaturbo eval`` and ``kakeyaturbo calibrate`` do once their arguments passed the
checks of :mod:`kakeyaturbo.cli` (needs the ``eval`` extra: torch, transformers)."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from . import __version__, assets, recipes
from .calibration import (Calibration, calibration_windows, collect_groups, collect_sensitivity_groups,
                          for_recipe_groups, sensitivity_path, stats_path)
from .cache.pretrained import codec_for_model
from .calibration import corpus
from .calibration.bundle import is_calibration_file
from .calibration.model_codec import ModelCodec, is_codec_file
from .calibration.gather import missing, model_dtype
from .calibration.mixture import pool_sensitivity, pool_stats
from .errors import InvalidParameterError, KakeyaError
from .eval import data, harness, model, peers, report
from .families import describe

#: What the statistics and the sensitivity cost per window against a plain forward pass of it
#: (`THREADS=1 benches/bench_collect.py --windows 1 --repeats 3` on the default model, quiet,
#: 2026-12-04: 4.03 s and 11.51 s against 3.78 s).
STATS_PER_FORWARD = 1.1
SENSITIVITY_PER_FORWARD = 3.0


def duration(seconds: float) -> str:
    """``"40 s"`` or ``"3.5 minutes"``."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} minutes"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _progress(desc: str) -> Any:
    from tqdm import tqdm

    return lambda it: tqdm(it, desc=desc, file=sys.stderr)


def _names(s: str) -> List[str]:
    return [n.strip() for n in s.split(",") if n.strip()]


def _model_and_text(args: argparse.Namespace) -> Tuple[Path, Path]:
    if args.model == "hard-case":
        model_path = assets.hard_case_model()
    else:
        model_path = Path(args.model).expanduser() if args.model else assets.default_model()
    text_path = Path(args.text).expanduser() if args.text else assets.default_text()
    return model_path, text_path


def forward_seconds(m: Any, tok: Any, text_path: Path, window: int) -> float:
    """Seconds of one forward pass of a ``window``-token calibration window (the second of two
    runs: the first warms the allocator and the thread pool)."""
    import torch

    wins = calibration_windows(tok, text_path, 1, window)
    ids = torch.tensor(wins[:1])
    with torch.no_grad():
        for _ in range(2):
            t0 = time.perf_counter()
            m(input_ids=ids)
            dt = time.perf_counter() - t0
    return dt


def _windows_of(what: "bool | int", total: int) -> int:
    return total if what is True else int(what or 0)


def calibration_plan(todo: List[Tuple[str, str, int]]) -> Dict[str, Tuple[int, str]]:
    """``{what: (windows, "domain n, ...")}`` of what :func:`kakeyaturbo.calibration.gather.missing`
    says is still to collect (a mixture's domains each with their share)."""
    out: Dict[str, Tuple[int, str]] = {}
    for what in ("statistics", "sensitivity"):
        parts = [(corpus.describe(d), c) for w, d, c in todo if w == what]
        if parts:
            out[what] = (sum(c for _, c in parts), ", ".join(f"{d} {c}" for d, c in parts))
    return out


def announce_calibration(m: Any, tok: Any, text_path: Path, settings: recipes.CalibrationSettings,
                         stats: "bool | int", sensitivity: "bool | int",
                         todo: Optional[List[Tuple[str, str, int]]] = None) -> float:
    """Says up front how long gathering the missing statistics and sensitivity will take: a
    forward pass of one window measured now, times the windows still to collect (``stats`` /
    ``sensitivity``: True for all of the settings' windows, or a count; ``todo``, the list
    :func:`~kakeyaturbo.calibration.gather.missing` gives, names each domain's share) and the
    measured cost of each kind against a forward pass. Returns the estimate in seconds."""
    plan = calibration_plan(todo or [])
    n_stats = _windows_of(stats, settings.windows)
    n_sens = _windows_of(sensitivity, settings.sensitivity_windows)
    fwd = forward_seconds(m, tok, text_path, settings.window)
    est = STATS_PER_FORWARD * fwd * n_stats + SENSITIVITY_PER_FORWARD * fwd * n_sens
    parts = []
    for what, n in (("statistics", n_stats), ("sensitivity", n_sens)):
        if n:
            where = f" ({plan[what][1]})" if what in plan else ""
            parts.append(f"{what} on {n} windows{where}")
    _say(f"calibrating once for this model ({' and '.join(parts)} of {settings.window} tokens; "
         f"a forward pass of one window took {fwd:.2f} s here): about {duration(est)}; "
         f"cached under {assets.CACHE / 'calibration'}")
    return est


def _calibration_text(args: argparse.Namespace, text_path: Path) -> Optional[str]:
    """``eval --calibration-text``: ``same`` is the evaluation text's own calibration split;
    None: each recipe's ``[calibration] corpus``."""
    spec = getattr(args, "calibration_text", None)
    if spec is None:
        return None
    return corpus.check_spec(str(text_path) if spec == "same" else spec)


def _calibrations(args: argparse.Namespace, m: Any, tok: Any, model_path: Path, text_path: Path,
                  cal_text: Optional[str], recs: List[recipes.Recipe],
                  sources: Optional[Dict[str, str]] = None) -> Dict[Any, Any]:
    """Per calibrated recipe's name, its ``[(stats, sensitivity), ...]`` (one pair per group of
    K/V layers of one shape, :func:`~kakeyaturbo.calibration.for_recipe_groups`), or its
    ModelCodec where a file gives it: ``--calibration`` or the recipe's ``[calibration] path``
    naming a calibration file (codecs of every group of layers it calibrates) or a codec file
    (``ModelCodec.save``, ``kakeyaturbo calibrate --codec-out``); statistics are shared by
    recipes that depend on the same ones. ``sources``, where given, receives per recipe's name
    where its calibration came from (for the results' meta)."""
    out: Dict[Any, Any] = {}
    sources = {} if sources is None else sources
    named = args.calibration if any(r.mode == "calibrated" for r in recs) else None  # else unused
    if named and is_codec_file(named):
        for rec in recs:
            if rec.mode == "calibrated":
                out[rec.name] = codec_for_model(m, rec, named)[0]
                sources[rec.name] = f"codec file {named}"
                _say(f"{rec.name}: codecs from codec file {named}")
        return out
    if named:
        cal = Calibration.load(named).check_model(m)
        _say(f"calibration {named} ({cal.library}, made for {cal.model_type} "
             f"{cal.fingerprint})")
        for rec in recs:  # codecs of every group of layers the file calibrates
            if rec.mode == "calibrated":
                out[rec.name] = codec_for_model(m, rec, cal)[0]
                sources[rec.name] = (f"calibration file {named} (text "
                                     f"{cal.settings.get('text', 'unrecorded')})")
        return out
    for rec in recs:
        if rec.mode != "calibrated":
            continue
        if rec.calibration.path and (is_codec_file(rec.calibration.path)
                                     or is_calibration_file(rec.calibration.path)):
            out[rec.name] = codec_for_model(m, rec)[0]  # (every group of layers a calibration file holds)
            sources[rec.name] = f"file {rec.calibration.path}"
            _say(f"{rec.name}: codecs from {rec.calibration.path}")
            if cal_text is not None:
                _say(f"warning: --calibration-text does not apply to {rec.name}: its [calibration] path "
                     "names the file its codecs come from")
            continue
        text = cal_text or rec.calibration.corpus
        sources[rec.name] = (f"statistics file {rec.calibration.path}" if rec.calibration.path
                             else f"text {text}")
        key = (rec.calibration, max(rec.n_sink, 1), rec.needs_sensitivity, rec.key_rope)
        if key not in out:
            todo = missing(rec, m, tok, model_path, text, all_groups=True)
            if todo:
                plan = calibration_plan(todo)
                announce_calibration(m, tok, text_path, rec.calibration,
                                     plan.get("statistics", (0, ""))[0],
                                     plan.get("sensitivity", (0, ""))[0], todo)
            out[key] = for_recipe_groups(rec, m, tok, model_path, text, progress=_progress)
        out[rec.name] = out[key]
    return out


def unused_options(args: argparse.Namespace, recs: List[recipes.Recipe]) -> List[str]:
    """``eval`` options that would be ignored with these recipes: each a line to warn with."""
    out = []
    if args.calibration and not any(r.mode == "calibrated" for r in recs):
        out.append(f"--calibration {args.calibration} is unused: no calibrated recipe among --recipes")
    if args.attribute and not recs:
        out.append("--attribute is unused: it attributes the loss of recipes, and --recipes names none")
    return out


def evaluate(args: argparse.Namespace) -> int:
    """``kakeyaturbo eval``: the EVAL.md protocol; writes results.json, .md and .png."""
    t_start = time.perf_counter()
    model_path, text_path = _model_and_text(args)
    cal_text = _calibration_text(args, text_path)
    cal_from = (f"file {args.calibration}" if args.calibration else
                f"text {cal_text or 'as each recipe names it (shipped recipes: mixture)'} (calibration split)")
    _say(f"model {model_path}\ntext  {text_path} (evaluation split)\ncalibration {cal_from}")
    recs = [recipes.load(n) for n in _names(args.recipes)]
    for line in unused_options(args, recs):
        _say(f"warning: {line}")
    m, tok = model.load(model_path, args.dtype)
    wins = data.evaluation_windows(tok, text_path, args.windows, args.ctx + args.n_eval + 1)
    if not wins:
        raise InvalidParameterError(
            f"the evaluation split of {text_path.name} holds no window of {args.ctx + args.n_eval + 1} tokens")
    if len(wins) < args.windows:
        _say(f"text holds only {len(wins)} windows")
    if len(wins) < 2:
        _say("warning: one window: the 95 % intervals (a bootstrap over windows) are the point "
             "estimates themselves; evaluate 2 windows or more for an interval")
    layers = describe(m).num_layers  # a multimodal model's config holds its decoder's
    methods = harness.baseline_methods(_names(args.baselines))
    for name in _names(args.peers):
        why = peers.unavailable(name) or peers.unsupported(name, m)
        if why:
            _say(why)
            continue
        methods.append(harness.peer_method(name))
    if not methods and not recs:
        raise InvalidParameterError("nothing to evaluate: every method asked for was skipped (see above)")
    sources: Dict[str, str] = {}
    cals = _calibrations(args, m, tok, model_path, text_path, cal_text, recs, sources)
    for rec in recs:
        got = cals.get(rec.name, [(None, None)])
        if isinstance(got, ModelCodec):
            methods.append(harness.codec_method(rec, layers, codec=got))
        else:
            (stats, sens), *groups = got
            methods.append(harness.codec_method(rec, layers, stats=stats, sensitivity=sens, groups=groups))
        if args.attribute:
            methods += harness.attribution_methods(methods[-1], layers, args.attribute)
    res_methods = harness.evaluate(m, wins, args.ctx, methods, progress=_progress("windows"))
    any_m = next(iter(res_methods.values()), None)
    # The calibration text only where a recipe was calibrated on it; per recipe, where from.
    gathered = any(v.startswith("text ") for v in sources.values())
    res = {
        "meta": {"model": model_path.name, "text": text_path.name, "windows": len(wins),
                 "calibration_text": (cal_text or "recipe") if gathered else None, "calibration": sources,
                 "ctx": args.ctx, "n_eval": args.n_eval,
                 "ppl_ref": any_m["ppl_ref"] if any_m else float("nan"),
                 "date": datetime.date.today().isoformat(), "layers": layers,
                 "dtype": model_dtype(m), "library": f"kakeyaturbo {__version__}",
                 "seconds": round(time.perf_counter() - t_start, 1)},
        "methods": res_methods,
    }
    paths = report.write(res, Path(args.out).expanduser())
    print(report.markdown(res))
    _say(f"wrote {', '.join(str(p) for p in paths.values())} in {res['meta']['seconds']:.0f} s")
    return 0


def calibrate(args: argparse.Namespace) -> int:
    """``kakeyaturbo calibrate``: statistics and sensitivity on the calibration split of a corpus
    (``--calibration-text``; default ``--text`` if given, else the shipped mixture, collected per
    domain and pooled); with ``--out FILE`` one self-contained calibration file, else the cache
    ``eval`` reads."""
    model_path, text_path = _model_and_text(args)
    spec = args.calibration_text or (str(text_path) if args.text else "mixture")
    text = corpus.check_spec(str(text_path) if spec == "same" else spec)
    _say(f"model {model_path}\ntext  {text} (calibration split)")
    m, tok = model.load(model_path, args.dtype)
    dtype = model_dtype(m)
    settings = recipes.CalibrationSettings(
        windows=args.windows, window=args.window, weighting=args.weighting,
        sensitivity_windows=max(args.sensitivity_windows, 1),
        score=args.score if args.sensitivity_windows > 0 else min(args.score, args.window - 2),  # (unused)
        labels=args.labels, corpus=text).checked()
    # The windows first: a text may hold fewer than asked, and the estimate, the warning and the
    # file's record then say how many are used.
    wins_of: Dict[Tuple[str, str], List[List[int]]] = {}
    plan = []
    for what, n in (("statistics", args.windows), ("sensitivity", args.sensitivity_windows)):
        for d, c in (corpus.composition(text, n, tok) if n > 0 else []):
            wins_of[what, d] = calibration_windows(tok, d, c, args.window)
            plan.append((what, d, len(wins_of[what, d])))
    used = {what: sum(c for w, _, c in plan if w == what) for what in ("statistics", "sensitivity")}
    for what, flag, asked in (("statistics", "--windows", args.windows),
                              ("sensitivity", "--sensitivity-windows", args.sensitivity_windows)):
        if used[what] < asked:
            _say(f"warning: the calibration split of {corpus.describe(text)} holds only {used[what]} windows "
                 f"of {args.window} tokens: the {what} use {used[what]}, not the {asked} of {flag}")
    announce_calibration(m, tok, text_path, settings, used["statistics"], used["sensitivity"], plan)
    mixed = corpus.is_mixture(text)
    to_cache = args.out is None or mixed  # a mixture's domains are cached where eval finds them

    def write(obj: Any, path: Path) -> None:
        for p in obj.save(path):
            _say(f"wrote {p}")

    # Every group of K/V layers of one shape (Gemma 4: its full layers, then its sliding ones) in
    # one pass over the windows, each cached where the evaluation looks for it (the first group
    # under the names it always had).
    from .families import describe as describe_model

    groups = [None] + [g[0] for g in describe_model(m).shape_groups()[1:]]
    n_groups = f" ({len(groups)} groups of layers)" if len(groups) > 1 else ""
    meta = {"text": text, "rope": args.rope}

    def per_group(what: str, n_windows: int, gather_one: Any, path_of: Any, pool: Any) -> List[Any]:
        """Per group, ``what`` of every domain of the corpus (each cached where asked), pooled."""
        got: List[List[Tuple[Any, int]]] = [[] for _ in groups]
        for d, c in corpus.composition(text, n_windows, tok):
            wins = wins_of[what, d]
            parts = gather_one(wins, progress=_progress(f"{what} {d}{n_groups}"),
                               meta={"model": model_path.name, **corpus.meta(d)})
            for n, one in enumerate(parts):
                if to_cache:
                    try:
                        write(one, path_of(d, c, groups[n]))
                    except KakeyaError as e:
                        if args.out is None:  # the cache is the output asked for
                            raise
                        _say(f"warning: {what} of {d} not cached ({e}); {args.out} is still written")
                got[n].append((one, c))
        return [pool(g, meta=meta) if mixed else g[0][0] for g in got]

    stats_of = per_group(
        "statistics", args.windows,
        lambda wins, **kw: collect_groups(m, wins, groups=groups, n_sink=args.n_sink, weighting=args.weighting,
                                          rope=args.rope, samples=args.samples, **kw),
        lambda d, c, g: stats_path(model_path, d, replace(settings, windows=c), dtype, args.rope, g), pool_stats)
    sens_of: List[Any] = [None] * len(groups)
    if args.sensitivity_windows > 0:
        sens_of = per_group(
            "sensitivity", args.sensitivity_windows,
            lambda wins, **kw: collect_sensitivity_groups(m, wins, groups=groups, n_sink=args.n_sink,
                                                          score=args.score, rope=args.rope, labels=args.labels,
                                                          **kw),
            lambda d, c, g: sensitivity_path(model_path, d, replace(settings, sensitivity_windows=c), args.n_sink,
                                             dtype, args.rope, g), pool_sensitivity)
    pairs = list(zip(stats_of, sens_of))
    if not (args.out or args.codec):
        return 0
    record = {"model": model_path.name, "text": text, "split": "calibration",
              "windows": used["statistics"], "window": args.window, "weighting": args.weighting,
              "n_sink": args.n_sink, "samples": args.samples,
              "sensitivity_windows": used["sensitivity"],
              "score": args.score if args.sensitivity_windows > 0 else None,
              "labels": args.labels if args.sensitivity_windows > 0 else None,
              "dtype": dtype, "rope": args.rope}
    cal = Calibration.for_model(m, *pairs[0], record, groups=pairs[1:])
    if args.out:
        out = cal.save(Path(args.out).expanduser())
        _say(f"wrote {out} (made for {cal.model_type} {cal.fingerprint})")
    if args.codec:
        codec, rec = codec_for_model(m, recipes.load(args.codec), cal)
        out = codec.save(Path(args.codec_out).expanduser(), m)
        _say(f"wrote {out} ({rec.name}: {len(codec.codecs)} codecs, {codec.model_bytes} bytes)")
    return 0
