"""A compressed prefix on disk: saved from one process, loaded in another, generation continues
token for token as it would have in the first; every kind of damage is a typed error."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import KV_HEADS, LAYERS, VOCAB, build, cache_kw, forward, generate, prompt, torch, transformers

import kakeyaturbo  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import BlockCodec, IdentityCodec, KakeyaCache, compress_cache, persist  # noqa: E402
from kakeyaturbo.errors import (  # noqa: E402
    CorruptDataError,
    InvalidParameterError,
    KakeyaError,
    ModelMismatchError,
    UnsupportedVersionError,
)

PREFIX, SUFFIX, NEW = 40, 5, 10


@pytest.fixture(scope="module")
def model_dir(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama")
    llama.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def cal_file(llama_calibration):
    return llama_calibration[0]


def _cache(kind: str, model, cal_file=None) -> KakeyaCache:
    if kind == "identity":
        return KakeyaCache(IdentityCodec(), model=model, block_size=16, n_sink=2, boundary=(-1,))
    if kind == "balanced":
        return KakeyaCache.from_recipe(recipes.load("balanced"), model=model, pre_rope_keys=True,
                                       block_size=16, n_sink=1)
    return KakeyaCache.from_pretrained(model, "calibrated-3bit", calibration=cal_file, block_size=16)


def _saved(kind: str, model, path: Path, cal_file=None, batch: int = 1) -> KakeyaCache:
    cache = _cache(kind, model, cal_file)
    forward(model, prompt(batch=batch, t=PREFIX), cache)
    cache.save(path)
    return cache


def _ids(batch: int = 1) -> torch.Tensor:
    return torch.cat([prompt(batch=batch, t=PREFIX), prompt(batch=batch, t=SUFFIX, seed=7)], dim=1)


_CHILD = """
import json, sys, torch, transformers
from kakeyaturbo.cache import KakeyaCache
model = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1]).eval()
out = {}
for kind, path, ids, cal in json.loads(sys.argv[2]):
    cache = KakeyaCache.load(path, model, calibration=cal)
    kw = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    seq = model.generate(torch.tensor(ids), max_new_tokens=%d, min_new_tokens=%d, do_sample=False,
                         pad_token_id=0, **{kw: cache})
    out[kind] = seq.tolist()
print(json.dumps(out))
""" % (NEW, NEW)


def test_generation_continues_in_another_process_token_for_token(llama, model_dir, cal_file, tmp_path) -> None:
    """Save after the prefix, continue in this process, load in a fresh one and continue there:
    the same tokens (the loaded cache holds the same bytes, so the same logits)."""
    jobs, want = [], {}
    for kind in ("identity", "balanced", "calibrated"):
        path = tmp_path / f"{kind}.kkpfx"
        cache = _saved(kind, llama, path, cal_file)
        assert cache.layers[0].num_sealed() == 2
        seq, _ = generate(llama, _ids(), cache, n=NEW)
        want[kind] = seq.tolist()
        # The in-process load gives the same continuation as well.
        again, _ = generate(llama, _ids(), KakeyaCache.load(path, llama, calibration=cal_file), n=NEW)
        assert again.tolist() == want[kind]
        jobs.append([kind, str(path), _ids().tolist(), str(cal_file) if kind == "calibrated" else None])
    env = dict(os.environ)
    root = str(Path(kakeyaturbo.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir), json.dumps(jobs)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == want
    assert all(len(v[0]) == PREFIX + SUFFIX + NEW for v in got.values())


def test_left_padded_batch_keeps_its_positions(llama, tmp_path) -> None:
    """Positions that are not 0 .. T-1 (left padding) are stored, and the loaded cache
    continues as the saved one does."""
    ids = prompt(batch=2, t=PREFIX)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = KakeyaCache.from_recipe(recipes.load("balanced"), model=llama, pre_rope_keys=True,
                                    block_size=16, n_sink=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw(llama): cache})
    path = cache.save(tmp_path / "batch.kkpfx")
    header, _ = persist.read_header(path)
    assert header["positions"] == PREFIX and header["batch"] == 2
    loaded = KakeyaCache.load(path, llama)
    assert torch.equal(loaded._positions.pos, cache._positions.pos)
    # The positions close the file (int32 [B, T], then the checksum): a negative one is damage.
    data = bytearray(path.read_bytes())
    struct.pack_into("<i", data, len(data) - 4 - 4 * 2 * PREFIX, -3)
    with pytest.raises(CorruptDataError, match="negative position"):
        KakeyaCache.load(_rewrite(tmp_path / "neg.kkpfx", bytes(data)), llama)
    full = torch.cat([ids, prompt(batch=2, t=SUFFIX, seed=7)], dim=1)
    fmask = torch.cat([mask, torch.ones(2, SUFFIX, dtype=mask.dtype)], dim=1)
    a, _ = generate(llama, full, cache, n=4, attention_mask=fmask)
    b, _ = generate(llama, full, loaded, n=4, attention_mask=fmask)
    assert torch.equal(a, b)


def test_left_padded_batch_continues_without_a_position_store(llama, tmp_path) -> None:
    """A codec that keeps keys with RoPE stores no positions: the loaded cache's first call
    counts each row's positions from the attention mask (a padded row starts lower), so the
    valid continuation goes on, and ids shorter than the prefix are still refused."""
    ids = prompt(batch=2, t=PREFIX)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = KakeyaCache(IdentityCodec(), model=llama, block_size=16, n_sink=1)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              use_cache=True, **{cache_kw(llama): cache})
    path = cache.save(tmp_path / "batch.kkpfx")
    assert persist.read_header(path)[0]["positions"] == 0
    full = torch.cat([ids, prompt(batch=2, t=SUFFIX, seed=7)], dim=1)
    fmask = torch.cat([mask, torch.ones(2, SUFFIX, dtype=mask.dtype)], dim=1)
    with pytest.raises(kakeyaturbo.InvalidInputError, match="do not continue"):
        generate(llama, full[:, :PREFIX - 3], KakeyaCache.load(path, llama, IdentityCodec()), n=4,
                 attention_mask=fmask[:, :PREFIX - 3])
    a, _ = generate(llama, full, cache, n=4, attention_mask=fmask)
    b, _ = generate(llama, full, KakeyaCache.load(path, llama, IdentityCodec()), n=4, attention_mask=fmask)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["identity", "balanced", "calibrated"])
def test_file_is_the_held_bytes_plus_a_small_overhead(llama, cal_file, tmp_path, kind) -> None:
    path = tmp_path / "p.kkpfx"
    cache = _saved(kind, llama, path, cal_file)
    mem = cache.memory()
    held = mem["blobs"] + mem["sink"] + mem["staging"]  # positions 0 .. T-1 are not stored
    header, _ = persist.read_header(path)
    blobs = sum(len(b) for layer in cache.layers for st in layer.export_state()["streams"].values()
                for blk in st["blocks"] for row in blk for b in row)
    assert blobs == mem["blobs"]
    n_blobs = sum(s["blocks"] * s["heads"] for layer in header["layers"] for s in layer["streams"].values())
    over = persist.overhead(path)
    assert over == 16 + header["_header_bytes"] + 4 * n_blobs
    assert path.stat().st_size == held + over
    assert over < 3000  # the header: settings and per layer and stream eight counts


@pytest.mark.parametrize("kind", ["balanced", "calibrated"])
def test_file_bits_equal_the_eval_bits(cal_file, tmp_path, kind) -> None:
    """A bfloat16 cache whose prefix after the sink is one block: the file holds exactly the bits
    `compress_cache` (the eval's accounting) reports, plus the overhead."""
    model = build("llama").to(torch.bfloat16)
    path = tmp_path / "p.kkpfx"
    if kind == "balanced":
        cache = KakeyaCache.from_recipe(recipes.load("balanced"), model=model, pre_rope_keys=True,
                                        block_size=PREFIX - 1, n_sink=1)
    else:
        cache = KakeyaCache.from_pretrained(model, "calibrated-3bit", calibration=cal_file,
                                            block_size=PREFIX - 1)
    forward(model, prompt(t=PREFIX), cache)
    cache.save(path)
    dyn = transformers.DynamicCache(config=model.config)
    forward(model, prompt(t=PREFIX), dyn)
    stats = compress_cache(dyn, cache.codec, n_sink=1, model=model)
    assert path.stat().st_size - persist.overhead(path) == stats["bits"] // 8
    assert stats["bits"] % 8 == 0


# --- refusals ------------------------------------------------------------------------------


def _other_llama():
    """A llama of the same shapes as the fixture's, with other weights."""
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=16,
        max_position_embeddings=512)).eval()


def test_another_model_codec_or_dtype_is_refused(llama, qwen2, cal_file, tmp_path) -> None:
    path = tmp_path / "p.kkpfx"
    _saved("balanced", llama, path)
    with pytest.raises(ModelMismatchError, match="p.kkpfx.*'llama' model, not 'qwen2'"):
        KakeyaCache.load(path, qwen2)
    other = _other_llama()
    with pytest.raises(ModelMismatchError, match="another model: fingerprint"):
        KakeyaCache.load(path, other)
    with pytest.raises(ModelMismatchError, match="another codec"):
        KakeyaCache.load(path, llama, IdentityCodec(pre_rope_keys=True))
    with pytest.raises(ModelMismatchError, match="another codec"):
        KakeyaCache.load(path, llama, BlockCodec(recipes.load("balanced")))  # keys with RoPE
    with pytest.raises(ModelMismatchError, match="another codec"):
        KakeyaCache.load(path, llama, BlockCodec(recipes.load("max-compression"), pre_rope_keys=True))
    with pytest.raises(ModelMismatchError, match="float32 rows.*bfloat16"):
        KakeyaCache.load(path, build("llama").to(torch.bfloat16))
    cpath = tmp_path / "c.kkpfx"
    _saved("calibrated", llama, cpath, cal_file)
    with pytest.raises(InvalidParameterError, match="calibrated recipe 'calibrated-3bit': pass calibration"):
        KakeyaCache.load(cpath, llama)
    g = np.random.default_rng(5)
    wins = [list(g.integers(0, VOCAB, 48)) for _ in range(3)]
    stats = calibration.collect(llama, wins, n_sink=1, samples=8)
    sens = calibration.collect_sensitivity(llama, wins, n_sink=1, score=16)
    refit = calibration.ModelCodec(stats, recipes.load("calibrated-3bit"), sensitivity=sens)
    with pytest.raises(ModelMismatchError, match="another codec.*load the prefix with the codec file"):
        KakeyaCache.load(cpath, llama, refit)
    with pytest.raises(InvalidParameterError, match="does not exist"):
        KakeyaCache.load(tmp_path / "nothing.kkpfx", llama)


def test_a_codec_file_serves_in_place_of_the_calibration(llama, qwen2, cal_file, tmp_path) -> None:
    """The codecs fitted once and saved (``ModelCodec.save(path, model)``): a saved prefix loads
    with them as with the calibration it was fitted from (the same fingerprints, so the same
    continuation), ``from_pretrained`` takes them too; refused for another recipe or model."""
    cpath = tmp_path / "c.kkpfx"
    cache = _saved("calibrated", llama, cpath, cal_file)
    codec_file = cache.codec.save(tmp_path / "llama.kkcodec", llama)
    want, _ = generate(llama, _ids(), KakeyaCache.load(cpath, llama, calibration=cal_file), n=NEW)
    got, _ = generate(llama, _ids(), KakeyaCache.load(cpath, llama, calibration=codec_file), n=NEW)
    assert got.tolist() == want.tolist()
    fresh = KakeyaCache.from_pretrained(llama, "calibrated-3bit", calibration=codec_file, block_size=16)
    assert persist.codec_identity(fresh.codec) == persist.codec_identity(cache.codec)
    with pytest.raises(InvalidParameterError, match="fitted for recipe 'calibrated-3bit', not 'calibrated-4bit'"):
        KakeyaCache.from_pretrained(llama, "calibrated-4bit", calibration=codec_file)
    with pytest.raises(ModelMismatchError, match="llama.kkcodec"):
        KakeyaCache.from_pretrained(qwen2, "calibrated-3bit", calibration=codec_file)
    other = _other_llama()
    with pytest.raises(ModelMismatchError, match="fitted for another model: fingerprint"):
        KakeyaCache.from_pretrained(other, "calibrated-3bit", calibration=codec_file)
    # The statistics path (eval, the benches) says what to do with one instead of reading it.
    named = dataclasses.replace(recipes.load("calibrated-3bit"), calibration=dataclasses.replace(
        recipes.load("calibrated-3bit").calibration, path=str(codec_file)))
    with pytest.raises(InvalidParameterError, match="is a codec file.*calibration file"):
        calibration.for_recipe(named, llama, None, "unused")
    # Saved without a model, it is checked by its shapes alone.
    anon = cache.codec.save(tmp_path / "anon.kkcodec")
    assert calibration.ModelCodec.load(anon).check_model(other).model_info is None


def test_save_needs_the_model_and_an_identified_codec(llama, tmp_path) -> None:
    class Anonymous(IdentityCodec):
        pass

    cache = KakeyaCache(Anonymous(), num_layers=LAYERS, block_size=8)
    forward(llama, prompt(), cache)
    with pytest.raises(InvalidParameterError, match="needs the model"):
        cache.save(tmp_path / "x")
    cache = KakeyaCache(Anonymous(), model=llama, block_size=8)
    forward(llama, prompt(), cache)
    cache.save(tmp_path / "x")  # an IdentityCodec subclass is an IdentityCodec

    class Custom:
        pre_rope_keys = False
        encode, decode = IdentityCodec.encode, IdentityCodec.decode

    cache = KakeyaCache(Custom(), model=llama, block_size=8)
    forward(llama, prompt(), cache)
    with pytest.raises(InvalidParameterError, match="identity\\(\\) method"):
        cache.save(tmp_path / "y")
    Custom.identity = lambda self: "custom v1"
    cache.save(tmp_path / "y")
    loaded = KakeyaCache.load(tmp_path / "y", llama, Custom())
    assert loaded.get_seq_length() == cache.get_seq_length()


def test_save_writes_only_its_file(llama, tmp_path, monkeypatch) -> None:
    """save into a directory is refused before anything is written; the temporary file is one of
    its own (a user's ``<name>.tmp`` is left alone) and is gone after a failed write, the old file
    kept."""
    cache = _cache("identity", llama)
    forward(llama, prompt(), cache)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir.tmp").write_text("user data")
    with pytest.raises(InvalidParameterError, match="dir'.*is a directory"):
        cache.save(tmp_path / "dir")
    # A pipe (or a device: /dev/null, as root) was replaced by the file; a NUL or an over-long
    # name raised ValueError or OSError.
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(InvalidParameterError, match="pipe'.*not a regular file"):
        cache.save(tmp_path / "pipe")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)
    for name in ("a\0b", "a" * 300):
        with pytest.raises(InvalidParameterError, match="cannot write"):
            cache.save(tmp_path / name)
    (tmp_path / "p.kkpfx.tmp").write_text("user data")
    path = cache.save(tmp_path / "p.kkpfx")
    assert (tmp_path / "dir.tmp").read_text() == (tmp_path / "p.kkpfx.tmp").read_text() == "user data"
    before = sorted(tmp_path.iterdir())
    good = path.read_bytes()

    def fail(*_a):
        raise OSError("disk full")

    monkeypatch.setattr(persist.os, "replace", fail)
    forward(llama, prompt(seed=3), cache)
    with pytest.raises(OSError, match="disk full"):
        cache.save(path)
    assert sorted(tmp_path.iterdir()) == before and path.read_bytes() == good


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and /dev")
def test_unreadable_or_special_files_and_a_bad_verify_are_typed(llama, saved) -> None:
    with pytest.raises(CorruptDataError, match="cannot be read"):  # EIO: OSError before
        KakeyaCache.load("/proc/self/mem", llama)
    with pytest.raises(InvalidParameterError, match="not a regular file"):  # "does not exist" before
        KakeyaCache.load("/dev/zero", llama)
    with pytest.raises(TypeError, match="verify"):  # taken as true before
        KakeyaCache.load(saved, llama, verify="no")
    with pytest.raises(TypeError, match="StreamCodec"):  # "cannot save a prefix coded by 1" before
        KakeyaCache.load(saved, llama, codec=1)


def test_ids_shorter_than_the_loaded_prefix_are_a_typed_error(llama, tmp_path) -> None:
    """generate feeds none of ids shorter than the prefix (an error deep in the model) or, one
    short, their tail again (a silent continuation from the wrong tokens): refused up front."""
    path = tmp_path / "p.kkpfx"
    _saved("balanced", llama, path)
    for t in (1, PREFIX - 10, PREFIX - 1):
        with pytest.raises(kakeyaturbo.InvalidInputError, match="do not continue the 40 tokens the cache holds"):
            generate(llama, prompt(t=t), KakeyaCache.load(path, llama), n=2)
    seq, _ = generate(llama, _ids(), KakeyaCache.load(path, llama), n=2)
    assert seq.shape[1] == PREFIX + SUFFIX + 2


# --- damage --------------------------------------------------------------------------------


def _rewrite(path: Path, data: bytes) -> Path:
    """``data`` with its checksum recomputed (damage the checksum cannot see)."""
    path.write_bytes(data[:-4] + struct.pack("<I", zlib.crc32(data[:-4])))
    return path


def _with_header(src: Path, dst: Path, edit, version=None) -> Path:
    """``src`` with its header changed by ``edit`` (and its version, where given), the checksum
    recomputed, written to ``dst``."""
    data = src.read_bytes()
    (hlen,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12:12 + hlen])
    edit(header)
    head = json.dumps(header).encode()
    v = struct.unpack_from("<H", data, 4)[0] if version is None else version
    return _rewrite(dst, data[:4] + struct.pack("<HHI", v, 0, len(head)) + head + data[12 + hlen:])


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "good.kkpfx"
    _saved("balanced", llama, path)
    return path


def test_damage_of_every_kind_is_typed_and_names_the_file(llama, saved, tmp_path) -> None:
    data = saved.read_bytes()
    bad = tmp_path / "bad.kkpfx"

    def refused(exc=CorruptDataError, match="bad.kkpfx"):
        with pytest.raises(exc, match=match):
            KakeyaCache.load(bad, llama)

    for n in (0, 3, 11, 15, 16, 200, len(data) // 2, len(data) - 1):
        bad.write_bytes(data[:n])
        refused()
    for at in (0, 5, 9, 20, len(data) // 3, len(data) - 200, len(data) - 2):
        flipped = bytearray(data)
        flipped[at] ^= 0x40
        bad.write_bytes(bytes(flipped))
        refused()
    with pytest.raises(InvalidParameterError, match="prefix file"):  # OSError before
        KakeyaCache.load(tmp_path / ("a" * 5000), llama)
    bad.write_bytes(b"PK\x03\x04" + data[4:])
    refused(match="not a kakeyaturbo prefix file")
    _rewrite(bad, data[:4] + struct.pack("<H", persist.VERSION + 1) + data[6:])
    refused(UnsupportedVersionError, f"version {persist.VERSION + 1}; this build reads up to {persist.VERSION}")
    _rewrite(bad, data[:6] + struct.pack("<H", 1) + data[8:])
    refused(match="unknown flags")
    _rewrite(bad, data[:8] + struct.pack("<I", 1 << 30) + data[12:])
    refused(match="header length")
    _rewrite(bad, data[:12] + b"\x80" + data[13:])
    refused(match="not JSON")
    _rewrite(bad, data[:-4] + b"junk" + data[-4:])
    refused(match="after the last section")
    # a blob's bytes damaged under a recomputed checksum: its own container refuses it
    (hlen,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12:12 + hlen])
    s = header["layers"][0]["streams"]["k"]
    raw = 4 * s["heads"] * s["dim"] * (s["sink"] + s["staging"])
    at = 12 + hlen + raw + 4 * s["blocks"] * s["heads"] + 40
    blob = bytearray(data)
    blob[at] ^= 0xFF
    _rewrite(bad, bytes(blob))
    refused(match="sealed block does not decode")
    # a NaN or an infinity in the raw rows (the first sink or staging value of layer 0's keys)
    for v in (float("nan"), float("inf")):
        rows = bytearray(data)
        struct.pack_into("<f", rows, 12 + hlen, v)
        _rewrite(bad, bytes(rows))
        refused(match="bad.kkpfx.*raw rows hold NaN or infinite values")

    def header_edit(edit, match="bad.kkpfx.*inconsistent"):
        _with_header(saved, bad, edit)
        refused(match=match)

    header_edit(lambda h: h["layers"][0].update(seen=h["layers"][0]["seen"] + 1))
    header_edit(lambda h: h["layers"].__setitem__(0, 5))  # not an object (AttributeError before)
    header_edit(lambda h: h["layers"][1]["streams"]["v"].update(blocks=1 << 30))
    header_edit(lambda h: h["layers"][1]["streams"]["v"].update(heads=-1))
    header_edit(lambda h: h["layers"][1]["streams"]["v"].update(dim=1 << 20))
    header_edit(lambda h: h["layers"][2]["streams"]["k"].update(sink_start=5))
    header_edit(lambda h: h["layers"].pop())
    header_edit(lambda h: h.update(batch="one"))
    header_edit(lambda h: h.update(dtype="int8"))
    header_edit(lambda h: h["cache"].update(streams=["q"]))
    header_edit(lambda h: h.pop("codec"))
    # (rows read from the wrong bytes may first show as non-finite)
    header_edit(lambda h: h.update(batch=3), match="bad.kkpfx.*(truncated or inconsistent|NaN or infinite)")
    header_edit(lambda h: h.update(positions=7), match="bad.kkpfx.*truncated or inconsistent")
    header_edit(lambda h: h["layers"][0]["streams"]["k"].update(dim=8),
                match="bad.kkpfx' is inconsistent: layer 0 k rows of")
    header_edit(lambda h: h.update(recipe={"name": "x", "mode": "nonsense"}),
                match="bad.kkpfx.*recipe does not load")

    def reshaped(h, heads, dim, streams=("k", "v"), layer=0):
        for name in streams:
            h["layers"][layer]["streams"][name].update(heads=heads, dim=dim)

    # Another (kv-heads, head_dim) of the same byte count: the model's layer caches (2, 16).
    header_edit(lambda h: reshaped(h, 1, 32), match="bad.kkpfx' is inconsistent: layer 0 k rows of "
                                                    r"\(kv-heads, width\) = \(1, 32\).*caches \(2, 16\)")
    header_edit(lambda h: reshaped(h, 4, 8, ("v",), 2), match="bad.kkpfx' is inconsistent: layer 2 v rows")


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_damage_under_a_recomputed_checksum_is_a_kakeya_error(llama, saved, tmp_path_factory, data) -> None:
    raw = bytearray(saved.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 5))
        raw[at] = data.draw(st.integers(0, 255))
    bad = _rewrite(tmp_path_factory.mktemp("fuzz") / "f.kkpfx", bytes(raw))
    try:
        KakeyaCache.load(bad, llama)
    except KakeyaError:
        pass
