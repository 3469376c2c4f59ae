"""`kakeyaturbo eval` and `kakeyaturbo calibrate`: the EVAL.md protocol on a causal LM and a
text, with baselines and library peers; the calibration of the calibrated mode.

A tool's manners: every argument is checked before anything is loaded (one line naming the
argument and what was expected, exit status 2); a library error at run time is one line and
exit status 1; a Python traceback only with ``--debug``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, List, NoReturn, Optional, Sequence

from . import CALIBRATED_FORMAT_VERSION, FORMAT_VERSION, __version__, assets, recipes, texts
from ._extras import missing, require
from .errors import KakeyaError, MissingDependencyError
from .eval import baselines, peers
from .eval.model import DTYPES

DEFAULT_BASELINES = ("identity,fp8_e4m3,fp8_e4m3+sink,int4+sink,kivi2+sink,turboquant3+sink,"
                     "turboquant4+sink")
# hqq-int4 runs with --peers: HQQ fits every layer's quantiser by proximal iterations, which alone
# took a quarter of a default run's time on 2 cores.
DEFAULT_PEERS = "quanto-int4,quanto-int2"
DEFAULT_RECIPES = "calibrated-4bit,calibrated-3bit,balanced"


class _Parser(argparse.ArgumentParser):
    """argparse, failing in one line: ``kakeyaturbo eval: error: argument --windows: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Bad(Exception):
    """An argument that failed a check after parsing: its flag and what was expected."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")


def _count(lo: int, hi: Optional[int] = None) -> Any:
    """An argparse type: an integer in ``[lo, hi]``."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            want = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"expected an integer {want}, got {v}")
        return v
    parse.__name__ = "integer"
    return parse


def _names(s: str) -> List[str]:
    return [n.strip() for n in s.split(",") if n.strip()]


def _path(flag: str, arg: str) -> Path:
    """A path argument with ``~`` expanded: a NUL or a ``~user`` the system does not know is a
    bad argument (``Path.expanduser`` raises RuntimeError; :func:`texts.expand`)."""
    try:
        return texts.expand(arg, "path")
    except KakeyaError as e:
        raise _Bad(flag, str(e)) from None


def _writable(flag: str, folder: Path) -> None:
    """An output's folder can be written into: one that cannot (read-only, or a system folder
    such as /proc) would fail only when the results are written, after the whole run. Probed
    by making and removing a folder in it."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kakeyaturbo-", dir=folder))
    except OSError as e:
        raise _Bad(flag, f"cannot write into the directory {str(folder)!r}: {e.strerror or e}") from None


# --- checks, before anything is loaded ------------------------------------------------------


def _check_model(arg: Optional[str]) -> None:
    if arg is None:
        assets.package_file(assets.MODEL_PACKAGE, assets.MODEL_FILE,
                            "the default model (SmolLM2-135M; or pass --model PATH)")
        return
    if arg == "hard-case":
        gone = [p for p, _ in assets.HARD_PARTS if not _installed(p)]
        cached = assets.CACHE / assets.HARD_NAME
        if gone and not (cached.is_file() and cached.stat().st_size == assets.HARD_SIZE):  # checked on use
            cmd = assets.install_command(*(p for p, _ in assets.HARD_PARTS))
            raise MissingDependencyError(f"the hard-case model is not installed: {cmd}", cmd)
        return
    p = _path("--model", arg)
    if not p.exists():
        raise _Bad("--model", f"no such file or directory: {arg!r} (expected a GGUF file, a "
                              "checkpoint directory holding config.json, or 'hard-case')")
    if p.is_dir() and not (p / "config.json").is_file():
        raise _Bad("--model", f"directory {arg!r} holds no config.json (expected a transformers "
                              "checkpoint directory or a GGUF file)")
    if p.is_file() and p.suffix.lower() != ".gguf":
        raise _Bad("--model", f"file {arg!r} is not a .gguf file (expected a GGUF file or a "
                              "checkpoint directory)")


def _installed(module: str) -> bool:
    return not missing([module])


def _check_text(arg: Optional[str], flag: str = "--text", mixture: bool = False) -> None:
    if arg is None:
        assets.package_file(assets.WIKI_PACKAGE, assets.WIKI_FILE,
                            "the default text (Wikipedia summaries; or pass --text FILE)")
        return
    if arg == "same" and flag == "--calibration-text":
        return
    if arg in texts.DOMAINS or (mixture and texts.is_mixture(arg)):
        try:
            texts.check_spec(arg, allow_mixture=mixture)
        except KakeyaError as e:
            raise _Bad(flag, str(e)) from None
        return
    p = _path(flag, arg)
    if not p.is_file():
        what = "a mixture ('mixture', 'mixture:DOMAIN=WEIGHT,...'), " if mixture else ""
        raise _Bad(flag, f"no such file: {arg!r} (expected {what}a domain "
                         f"({', '.join(texts.DOMAINS)}), a UTF-8 text file or the wiki JSON)")


def _check_recipes(arg: str) -> List[Any]:
    out = []
    for name in _names(arg):
        try:
            out.append(recipes.load(name))
        except KakeyaError as e:
            raise _Bad("--recipes", str(e)) from None
    return out


def _check_baselines(arg: str) -> None:
    for name in _names(arg):
        if not baselines.known(name):
            raise _Bad("--baselines", f"unknown baseline {name!r}; known: "
                                      f"{', '.join(baselines.BASELINES)}, each also with '+sink'")


def _check_peers(arg: str) -> None:
    for name in _names(arg):
        if name not in peers.PEERS:
            raise _Bad("--peers", f"unknown peer {name!r}; known: {', '.join(peers.PEERS)}")


def _check_out_dir(arg: str) -> None:
    p = _path("--out", arg)
    if p.exists() and not p.is_dir():
        raise _Bad("--out", f"{arg!r} is a file (expected a directory for results.json, .md and .png)")
    # A directory to be made under a file would fail only when the results are written.
    up = p
    while not up.exists() and up.parent != up:
        up = up.parent
    if up.exists() and not up.is_dir():
        raise _Bad("--out", f"{arg!r} lies under the file {str(up)!r} (expected a directory to write into)")
    _writable("--out", up)


def _check_calibration_file(flag: str, arg: Optional[str]) -> None:
    if arg is not None and not _path(flag, arg).is_file():
        raise _Bad(flag, f"no such file: {arg!r} (expected a calibration file written by "
                         "kakeyaturbo calibrate --out FILE, or a codec file by --codec-out FILE)")


def _check_eval_methods(args: argparse.Namespace, recs: List[Any]) -> None:
    """Something to evaluate, and a context longer than every method's sink (tokens kept raw:
    at ``--ctx`` <= the sink nothing is compressed, and every method would pass at 16 bits)."""
    if not (recs or _names(args.baselines) or _names(args.peers)):
        raise _Bad("--recipes", "nothing to evaluate: --recipes, --baselines and --peers are all empty "
                                "(name at least one method)")
    sinks = [(r.n_sink, f"recipe {r.name!r}") for r in recs]
    sinks += [(baselines.parse(n)[1], f"baseline {n!r}") for n in _names(args.baselines)]
    sink, who = max(sinks, default=(0, ""), key=lambda s: s[0])
    if args.ctx <= sink:
        raise _Bad("--ctx", f"expected more than the {sink} sink token(s) {who} keeps uncompressed, "
                            f"got {args.ctx} (nothing would be compressed)")
    if args.calibration is not None and args.calibration_text is not None:
        raise _Bad("--calibration-text", "does not apply with --calibration FILE (the file's statistics "
                                         "or codecs were made on the text it records): give one of the two")


def _same_file(pa: Path, pb: Path) -> bool:
    """Whether the (expanded) paths ``pa`` and ``pb`` name the same file (existing or not)."""
    if pa.exists() and pb.exists():
        return pa.samefile(pb)
    return pa.resolve() == pb.resolve()


def _model_file(arg: Optional[str]) -> Optional[str]:
    """The file ``--model`` reads: a path as given, the default model's, or where the hard-case
    model is (or will be) assembled; None where the default model is not installed."""
    if arg == "hard-case":
        return str(assets.CACHE / assets.HARD_NAME)
    if arg is None:
        try:
            return str(assets.default_model())
        except KakeyaError:
            return None
    return arg


def _text_file(arg: Optional[str]) -> Optional[str]:
    """The file ``--text`` reads (the default text's too)."""
    if arg is None:
        try:
            return str(assets.default_text())
        except KakeyaError:
            return None
    return arg


def _check_outputs(args: argparse.Namespace) -> None:
    """``calibrate``'s output files overwrite none of its inputs nor each other."""
    inputs = [("--model", _model_file(args.model)), ("--text", _text_file(args.text)),
              ("--calibration-text", args.calibration_text)]
    for flag in ("--out", "--codec-out"):
        out = getattr(args, flag[2:].replace("-", "_"))
        if out is None:
            continue
        for name, src in inputs:
            # The hard-case model is assembled at its cached path before anything is written.
            read = src is not None and (_path(name, src).is_file() or
                                        (name == "--model" and args.model == "hard-case"))
            if read and _same_file(_path(flag, out), _path(name, src)):
                raise _Bad(flag, f"{out!r} is the {name} input: it would be overwritten (expected "
                                 "another file to write)")
    if args.out is not None and args.codec_out is not None and \
            _same_file(_path("--codec-out", args.codec_out), _path("--out", args.out)):
        raise _Bad("--codec-out", f"must differ from --out ({args.out!r}): the codec file would "
                                  "overwrite the calibration file")


def check(args: argparse.Namespace) -> None:
    """Every argument of a parsed command line, before anything is loaded: raises ``_Bad``
    (an argument) or MissingDependencyError (the eval extra, a data package)."""
    _check_model(args.model)
    _check_text(args.text)
    if args.calibration_text is not None:
        _check_text(args.calibration_text, "--calibration-text", mixture=True)
    if args.command == "eval":
        recs = _check_recipes(args.recipes)
        _check_baselines(args.baselines)
        _check_peers(args.peers)
        _check_eval_methods(args, recs)
        _check_out_dir(args.out)
        _check_calibration_file("--calibration", args.calibration)
    else:
        if args.n_sink >= args.window:
            raise _Bad("--n-sink", f"expected fewer than --window = {args.window} tokens (the statistics "
                                   f"leave the sink out of every window), got {args.n_sink}")
        if args.sensitivity_windows > 0 and args.score + args.n_sink + 2 > args.window:
            top = args.window - args.n_sink - 2
            raise _Bad("--score", f"expected at most --window - --n-sink - 2 = {top} scored tokens (a "
                                  f"sensitivity window holds the sink, one more cached token, the scored "
                                  f"tokens and their last target), got {args.score}")
        if args.out is not None:
            p = _path("--out", args.out)
            if p.is_dir():
                raise _Bad("--out", f"{args.out!r} is a directory (expected the calibration file to write)")
            if not p.parent.is_dir():
                raise _Bad("--out", f"directory {str(p.parent)!r} does not exist")
            _writable("--out", p.parent)
        if (args.codec is None) != (args.codec_out is None):
            raise _Bad("--codec", "--codec RECIPE and --codec-out FILE go together")
        if args.codec is not None:
            try:
                rec = recipes.load(args.codec)
            except KakeyaError as e:
                raise _Bad("--codec", str(e)) from None
            if rec.mode != "calibrated":
                raise _Bad("--codec", f"recipe {rec.name!r} is per-block: it has no codecs to fit")
            if rec.key_rope != args.rope:
                raise _Bad("--codec", f"recipe {rec.name!r} codes keys {rec.key_rope} RoPE; "
                                      f"calibrate with --rope {rec.key_rope}")
            p = _path("--codec-out", args.codec_out)
            if p.is_dir() or not p.parent.is_dir():
                raise _Bad("--codec-out", f"{args.codec_out!r} is a directory or its directory does not exist")
            _writable("--codec-out", p.parent)
        _check_outputs(args)
    require(f"kakeyaturbo {args.command}")


# --- the commands ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The command line: ``kakeyaturbo eval`` and ``kakeyaturbo calibrate``."""
    ap = _Parser(prog="kakeyaturbo", description="KV-cache codec: evaluation and calibration on a causal LM")
    ap.add_argument("--version", action="version",
                    version=f"kakeyaturbo {__version__} (per-block container v{FORMAT_VERSION}, "
                            f"calibrated container v{CALIBRATED_FORMAT_VERSION})")
    ap.add_argument("--debug", action="store_true", help="show Python tracebacks of errors")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{eval,calibrate}")
    model_help = ("a model directory or GGUF file, or 'hard-case' for EVAL.md's Qwen2.5 0.5B "
                  "(default: the embedded SmolLM2-135M)")
    text_help = ("a domain (wiki-en, wiki-fr, wiki-es, code, prose, chat), a UTF-8 text or the "
                 "wiki JSON (default: the embedded English Wikipedia summaries)")
    cal_help = ("calibration text, its calibration split only: 'mixture' (the shipped "
                "multi-domain mixture), 'mixture:DOMAIN=WEIGHT,...', a domain or a file")
    dtype_help = ("weights and cache dtype: auto = as the checkpoint stores it where the CPU computes in "
                  "it (bfloat16 or float32); default float32, in which every published figure was measured")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show Python tracebacks of errors")
    e = sub.add_parser("eval", parents=[debug],
                       help="perplexity, top-1 and KL of the codec, baselines and library peers on a model")
    e.add_argument("--model", help=model_help)
    e.add_argument("--text", help=text_help)
    e.add_argument("--dtype", choices=DTYPES, default="float32", help=dtype_help)
    e.add_argument("--calibration-text", metavar="TEXT",
                   help=cal_help + "; 'same': the evaluation text's own (default: as each "
                   "recipe's [calibration] corpus says)")
    # 12 windows of 128 scored tokens: intervals of about +-0.35 % on dppl (README, "Evaluation
    # defaults"); a scored token costs far less at 128 per window than at 64, as each method's
    # forward pass has a fixed cost.
    e.add_argument("--windows", type=_count(1), default=12)
    e.add_argument("--ctx", type=_count(1), default=512)
    e.add_argument("--n-eval", type=_count(1), default=128)
    e.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma-separated recipe names or files")
    e.add_argument("--baselines", default=DEFAULT_BASELINES,
                   help="comma-separated numpy baselines; NAME+sink keeps the first token raw "
                        f"(known: {', '.join(baselines.BASELINES)})")
    e.add_argument("--peers", default=DEFAULT_PEERS,
                   help="comma-separated library peers, each run through its own library "
                        f"(known: {', '.join(peers.PEERS)}; '' for none)")
    e.add_argument("--calibration", metavar="FILE",
                   help="a calibration file (kakeyaturbo calibrate --out) for the calibrated recipes, "
                        "instead of the cache, or a codec file (calibrate --codec-out) for the recipe "
                        "it was fitted for")
    e.add_argument("--attribute", type=_count(0), default=0, metavar="GROUPS",
                   help="also run every recipe on K only, on V only, and on each of GROUPS "
                        "groups of consecutive layers alone (where the loss comes from)")
    e.add_argument("--out", default="eval-out")
    c = sub.add_parser("calibrate", parents=[debug],
                       help="the statistics and sensitivity of a model on the calibration split, "
                            "for the calibrated mode")
    c.add_argument("--model", help=model_help)
    c.add_argument("--text", help=text_help)
    c.add_argument("--dtype", choices=DTYPES, default="float32", help=dtype_help)
    c.add_argument("--calibration-text", metavar="TEXT",
                   help=cal_help + " (default: --text if given, else 'mixture')")
    c.add_argument("--windows", type=_count(1), default=16)
    c.add_argument("--window", type=_count(2), default=1024)
    c.add_argument("--n-sink", type=_count(0), default=1, help="leading tokens left out of K/V statistics")
    c.add_argument("--weighting", choices=("attention", "uniform"), default="attention")
    c.add_argument("--rope", choices=("before", "after"), default="before",
                   help="take keys and queries before RoPE (recipes with [k] rope = 'before', the "
                        "default) or after it (rope = 'after')")
    c.add_argument("--samples", type=_count(1), default=512, help="rows kept per (layer, kv-head)")
    c.add_argument("--sensitivity-windows", type=_count(0), default=16,
                   help="windows for the model's sensitivity (gradients; 0: skip it)")
    c.add_argument("--score", type=_count(1), default=256,
                   help="tokens at the end of each sensitivity window that are scored")
    c.add_argument("--labels", choices=recipes.CalibrationSettings.LABELS, default="text",
                   help="next tokens the sensitivity's loss scores: the text's own, or drawn from "
                        "the model's prediction (recipes' [calibration] labels)")
    c.add_argument("--out", metavar="FILE",
                   help="write ONE self-contained calibration file (safetensors: statistics, "
                        "sensitivity, the model's fingerprint) for KakeyaCache.from_pretrained, "
                        "eval --calibration and recipes; default: the cache eval looks in")
    c.add_argument("--codec", metavar="RECIPE",
                   help="also fit this calibrated recipe's codecs from the calibration and write them "
                        "to --codec-out (ModelCodec.save): the same codecs on every machine, where "
                        "fitting them again from the statistics may differ with the CPU's BLAS")
    c.add_argument("--codec-out", metavar="FILE", help="where --codec writes the codecs")
    return ap


def _run(args: argparse.Namespace) -> int:
    from . import commands  # torch, transformers: after the checks

    return commands.evaluate(args) if args.command == "eval" else commands.calibrate(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; returns the exit status (2: a bad argument, 1: an error)."""
    ap = parser()
    args = ap.parse_args(argv)
    debug = getattr(args, "debug", False)
    prog = f"kakeyaturbo {args.command}"
    try:
        check(args)
    except _Bad as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except MissingDependencyError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a path argument the system refuses to look at (a name too long)
        print(f"{prog}: error: a path argument cannot be checked: {e}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line unless --debug: the tool's contract
        if debug:
            traceback.print_exc()
        elif isinstance(e, KakeyaError):
            print(f"{prog}: error: {e}", file=sys.stderr)
        else:
            print(f"{prog}: error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
                  file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
