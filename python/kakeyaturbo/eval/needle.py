"""Needle retrieval through a compressed cache (EVAL.md, "Long contexts").

A prompt of ``length`` tokens is a haystack of long coherent text (the evaluation split of the
``prose`` domain, or any text) with a key phrase hidden at a ``depth`` (the share of the haystack
before it, snapped to a paragraph start): *"The special magic number for the {key} is
{number}."*, and a question at the end: *"What is the special magic number for the {key}
mentioned in the text above? The special magic number for the {key} is"*. The number is random
(seeded per prompt). Every method sees the same prompts; a compressed method goes through the
same prefix compression as the eval (:func:`kakeyaturbo.eval.harness.compress_prefix`): all
prompt tokens but the last are prefilled, the filled cache is compressed, and the answer is
greedily decoded through it from the last prompt token on (the decoded tokens stay
uncompressed, like a serving engine's staging block). A prompt is retrieved when the first
number in the answer is the needle's.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..calibration import corpus
from ..errors import InvalidParameterError

NEEDLE = "The special magic number for the {key} is {number}."
QUESTION = ("What is the special magic number for the {key} mentioned in the text above? "
            "The special magic number for the {key} is")
#: Keys of the needles, one picked per prompt (seeded).
KEYS = ("silver harbour", "quiet orchard", "northern lighthouse", "copper kettle", "paper lantern",
        "granite bridge", "velvet curtain", "amber meadow", "hollow oak", "crimson kite")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
LENGTHS = (2048, 4096, 8192)
DIGITS = 7
#: Trial ``t``'s haystack starts at the ``STRIDE * t``-th evaluation document.
STRIDE = 4


@dataclass
class Prompt:
    """One needle prompt: its token ids (BOS first when the tokenizer has one), the needle's
    key and number, the requested and the actual depth (share of the haystack tokens before the
    needle), and where the needle's tokens start."""

    ids: List[int]
    key: str
    number: str
    length: int
    depth: float
    actual_depth: float
    needle_at: int
    trial: int


def _paragraph_ids(tok: Any, text: str) -> List[List[int]]:
    return [tok.encode(p + "\n\n", add_special_tokens=False)
            for p in text.split("\n\n") if p.strip()]


def build_prompt(tok: Any, haystack: Sequence[List[int]], length: int, depth: float, *,
                 key: str, number: str, trial: int = 0) -> Prompt:
    """A prompt of exactly ``length`` tokens: BOS (when the tokenizer has one), the haystack
    paragraphs (token ids of each, in order; as many as fit) with the needle inserted before
    the paragraph that starts nearest ``depth`` of the haystack's tokens, and the question.
    Raises InvalidParameterError when ``depth`` is outside [0, 1] or the haystack is too short."""
    if not 0.0 <= depth <= 1.0:
        raise InvalidParameterError(f"depth must be in [0, 1], got {depth}")
    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    needle = tok.encode(NEEDLE.format(key=key, number=number) + "\n\n", add_special_tokens=False)
    question = tok.encode("\n\n" + QUESTION.format(key=key), add_special_tokens=False)
    room = length - len(bos) - len(needle) - len(question)
    if room < 1:
        raise InvalidParameterError(f"length {length} leaves no room for a haystack")
    hay: List[int] = []
    starts: List[int] = []
    for p in haystack:
        if len(hay) >= room:
            break
        starts.append(len(hay))
        hay.extend(p)
    if len(hay) < room:
        raise InvalidParameterError(f"the haystack holds {len(hay)} tokens, {room} needed for "
                                    f"a {length}-token prompt")
    hay = hay[:room]
    starts = [s for s in starts if s < room] + [room]
    at = min(starts, key=lambda s: (abs(s - depth * room), s))
    ids = bos + hay[:at] + needle + hay[at:] + question
    assert len(ids) == length
    return Prompt(ids=ids, key=key, number=number, length=length, depth=float(depth),
                  actual_depth=at / room, needle_at=len(bos) + at, trial=trial)


def haystacks(tok: Any, text: "str | None" = None, trials: int = 1) -> List[List[List[int]]]:
    """``trials`` haystacks (paragraph token ids): the evaluation split of ``text`` (a domain
    or file; default ``prose``), trial ``t`` starting at its ``STRIDE * t``-th document."""
    _, ev = corpus.parts(text or "prose", tok)
    if len(ev.docs) < STRIDE * (trials - 1) + 1:
        raise InvalidParameterError(f"{text or 'prose'} has {len(ev.docs)} evaluation documents, "
                                    f"{trials} trials need {STRIDE * (trials - 1) + 1}")
    out = []
    for t in range(trials):
        paras: List[List[int]] = []
        for _, doc in ev.docs[STRIDE * t:]:
            paras.extend(_paragraph_ids(tok, doc))
            if sum(len(p) for p in paras) > max(LENGTHS) * 2:
                break
        out.append(paras)
    return out


def prompts(tok: Any, lengths: Sequence[int] = LENGTHS, depths: Sequence[float] = DEPTHS,
            trials: int = 2, text: "str | None" = None, seed: int = 0) -> List[Prompt]:
    """Every (length, depth, trial) prompt; the key and the ``DIGITS``-digit number of each
    are drawn from a generator seeded by ``(seed, length, depth, trial)``, so a prompt does not
    depend on which others are made."""
    stacks = haystacks(tok, text, trials)
    out = []
    for length in lengths:
        for d in depths:
            for t in range(trials):
                g = np.random.default_rng([seed, int(length), int(round(d * 1000)), t])
                number = str(int(g.integers(10 ** (DIGITS - 1), 10 ** DIGITS)))
                key = KEYS[int(g.integers(len(KEYS)))]
                out.append(build_prompt(tok, stacks[t], int(length), float(d), key=key,
                                        number=number, trial=t))
    return out


def answer_number(text: str) -> Optional[str]:
    """The first run of digits in an answer (None when there is none)."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def retrieved(answer: str, number: str) -> bool:
    """Whether an answer retrieves the needle: its first number is the needle's."""
    return answer_number(answer) == number


def greedy(model: Any, prefilled: Any, last: int, steps: int, eos: "int | None" = None
           ) -> List[int]:
    """``steps`` greedy tokens from a filled cache, feeding ``last`` (the prompt's last token)
    first; stops after an EOS."""
    import torch

    from .harness import _forward

    out: List[int] = []
    cache = prefilled
    nxt = last
    for _ in range(steps):
        logits, cache = _forward(model, torch.tensor([[nxt]]), cache)
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if eos is not None and nxt == eos:
            break
    return out


def _prefilled(model: Any, p: Prompt, prefill_dir: "os.PathLike[str] | str | None") -> Any:
    """The cache of a prompt's tokens but the last: from ``prefill_dir`` when it is there,
    else a forward pass (kept there when a folder is given)."""
    import torch

    from .harness import _forward

    path = None
    if prefill_dir is not None:
        h = hashlib.sha256(np.asarray(p.ids, dtype=np.int64).tobytes()).hexdigest()[:16]
        path = Path(prefill_dir) / f"{p.length}-{h}.pt"
        if path.is_file():
            return torch.load(path, weights_only=False)
    _, prefilled = _forward(model, torch.tensor([p.ids[:-1]]), keep=1)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        torch.save(prefilled, tmp)
        tmp.replace(path)
    return prefilled


def run(model: Any, tok: Any, prompt_list: Sequence[Prompt], methods: Sequence[Any], *,
        steps: int = DIGITS + 3, progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
        done: Optional[Dict[Tuple[int, float, int], Dict[str, Any]]] = None,
        on_prompt: Optional[Callable[[Dict[str, Any]], None]] = None,
        prefill_dir: "os.PathLike[str] | str | None" = None) -> List[Dict[str, Any]]:
    """Each prompt through the uncompressed cache (``reference``) and every method of
    :mod:`kakeyaturbo.eval.harness` (compressed prefix). Returns one record per prompt:
    length, depth, actual depth, trial, number, and per method the answer, whether it was
    retrieved and the all-in bits per element of its cache. ``done`` (records by (length,
    depth, trial)) are kept and their methods not run again; ``on_prompt`` sees every record
    that was run as it is finished (to save partial results); ``seconds`` in a record: the
    prefill, each method's compression and decoding, and the total. ``prefill_dir``: the
    prefilled cache of every prompt is kept there (named by a hash of its tokens) and read back
    when a later run adds methods, so a long prompt is prefilled once."""
    import torch

    from ..families import describe
    from .harness import compress_prefix

    rope = None
    if any(getattr(m.codec, "pre_rope_keys", False) and "k" in m.streams for m in methods):
        rope = describe(model).require_rope()
    out = []
    with torch.no_grad():
        for p in progress(prompt_list):
            key = (p.length, p.depth, p.trial)
            rec = dict((done or {}).get(key) or {})
            rec.update(length=p.length, depth=p.depth, actual_depth=p.actual_depth,
                       trial=p.trial, number=p.number, key=p.key)
            res = dict(rec.get("methods", {}))
            secs = dict(rec.get("seconds", {}))
            todo = [m for m in methods if m.name not in res]
            ran = "reference" not in res or bool(todo)
            if ran:
                t0 = time.perf_counter()
                prefilled = _prefilled(model, p, prefill_dir)
                secs["prefill"] = time.perf_counter() - t0
                if "reference" not in res:
                    t = time.perf_counter()
                    ans = greedy(model, copy.deepcopy(prefilled), p.ids[-1], steps,
                                 tok.eos_token_id)
                    text = tok.decode(ans)
                    res["reference"] = {"answer": text, "retrieved": retrieved(text, p.number),
                                        "bits_per_element": 16.0}
                    secs["reference"] = time.perf_counter() - t
                for m in todo:
                    t = time.perf_counter()
                    cache = copy.deepcopy(prefilled)
                    bits, elems = compress_prefix(cache, m, rope, model)
                    text = tok.decode(greedy(model, cache, p.ids[-1], steps, tok.eos_token_id))
                    res[m.name] = {"answer": text, "retrieved": retrieved(text, p.number),
                                   "bits_per_element": bits / max(elems, 1)}
                    secs[m.name] = time.perf_counter() - t
                secs["total"] = time.perf_counter() - t0
            rec["methods"] = res
            rec["seconds"] = secs
            out.append(rec)
            if on_prompt is not None and ran:
                on_prompt(rec)
    return out


def merge(*runs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Records of several runs on the same prompts merged by (length, depth, trial): each
    prompt's methods put together (the first run's answer kept where two ran a method). Raises
    InvalidParameterError when two runs hold a prompt with other needles."""
    out: Dict[Tuple[int, float, int], Dict[str, Any]] = {}
    for records in runs:
        for r in records:
            key = (int(r["length"]), float(r["depth"]), int(r["trial"]))
            have = out.get(key)
            if have is None:
                out[key] = dict(r, methods=dict(r["methods"]))
                continue
            if (have["number"], have["key"]) != (r["number"], r["key"]):
                raise InvalidParameterError(f"prompt {key} holds other needles in two runs")
            have["methods"] = dict(r["methods"], **have["methods"])
    return [out[k] for k in sorted(out)]


def summary(records: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per method: retrieval rate overall, per length and per (length, depth), the prompts
    where it differs from the reference, and its mean bits per element."""
    methods: List[str] = []
    for r in records:
        for name in r["methods"]:
            if name not in methods:
                methods.append(name)
    out: Dict[str, Dict[str, Any]] = {}
    for name in methods:
        rows = [r for r in records if name in r["methods"]]
        hit = [bool(r["methods"][name]["retrieved"]) for r in rows]
        by_len: Dict[str, List[bool]] = {}
        by_cell: Dict[str, List[bool]] = {}
        differs = 0
        for r, h in zip(rows, hit):
            by_len.setdefault(str(r["length"]), []).append(h)
            by_cell.setdefault(f"{r['length']}@{r['depth']:g}", []).append(h)
            ref = r["methods"].get("reference", {}).get("retrieved")
            differs += int(ref is not None and ref != h)
        out[name] = {
            "prompts": len(rows),
            "retrieved": float(np.mean(hit)) if hit else float("nan"),
            "by_length": {k: float(np.mean(v)) for k, v in by_len.items()},
            "by_length_depth": {k: float(np.mean(v)) for k, v in by_cell.items()},
            "differs_from_reference": differs,
            "bits_per_element": float(np.mean([r["methods"][name]["bits_per_element"]
                                               for r in rows])) if rows else float("nan"),
        }
    return out


def markdown(records: Sequence[Dict[str, Any]], title: str = "") -> str:
    """Two tables: retrieval per method and length (with the prompts where it differs from the
    uncompressed cache), and per method, length and depth."""
    s = summary(records)
    lengths = sorted({int(r["length"]) for r in records})
    depths = sorted({float(r["depth"]) for r in records})
    lines = [title, ""] if title else []
    lines += ["| method | bits/elem | " + " | ".join(f"{n} tokens" for n in lengths)
              + " | all | differs from uncompressed |",
              "|---|---|" + "---|" * len(lengths) + "---|---|"]
    order = sorted(s, key=lambda n: (n != "reference", -s[n]["bits_per_element"], n))
    for n in order:
        r = s[n]
        cells = [f"{100 * r['by_length'].get(str(n_), float('nan')):.0f} %" for n_ in lengths]
        lines.append(f"| {n} | {r['bits_per_element']:.2f} | " + " | ".join(cells)
                     + f" | {100 * r['retrieved']:.0f} % | {r['differs_from_reference']} |")
    lines += ["", "| method | " + " | ".join(f"{n} @ {d:g}" for n in lengths for d in depths) + " |",
              "|---|" + "---|" * (len(lengths) * len(depths))]
    for n in order:
        r = s[n]["by_length_depth"]
        lines.append(f"| {n} | " + " | ".join(
            f"{100 * r[f'{n_}@{d:g}']:.0f}" if f"{n_}@{d:g}" in r else "-"
            for n_ in lengths for d in depths) + " |")
    return "\n".join(lines) + "\n"
