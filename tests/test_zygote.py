"""The test zygote runs a program as ``python PROGRAM ARGS`` would ([Note: workers forked from a zygote]):
the same exit status, output, argv, environment, working directory and import path as the
interpreter started on it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import _Zygote, run_python, subprocess_env

PROGRAM = '''
import json, os, sys
import helper  # a module beside the program: its folder comes first on sys.path
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                  "helper": helper.VALUE, "file": os.path.basename(__file__)}))
sys.stdout.flush()
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "message":
    sys.exit("hetpar: one line for the user")
if mode == "raise":
    raise ValueError("boom")
if mode == "hang":
    import time
    time.sleep(120)
import atexit
atexit.register(lambda: print("atexit ran", file=sys.stderr))
'''


@pytest.fixture
def program(tmp_path) -> Path:
    folder = tmp_path / "prog"
    folder.mkdir()
    (folder / "helper.py").write_text("VALUE = 7\n")
    path = folder / "train.py"
    path.write_text(PROGRAM)
    return path


@pytest.fixture
def zygote():
    one = _Zygote.get()
    if one is None:
        pytest.skip("no zygote on this machine (HETPAR_TEST_ZYGOTE=0 or no fork)")
    return one


def _both(zygote, program: Path, args: list[str], tmp_path: Path) -> tuple[tuple, tuple]:
    """(returncode, stdout, stderr) of the program run by the interpreter and by the zygote."""
    env = {**subprocess_env(), "RANK": "3"}
    plain = subprocess.run([sys.executable, str(program), *args], cwd=program.parent, env=env, capture_output=True,
                           text=True, timeout=120)
    out, err = tmp_path / "out", tmp_path / "err"
    worker = zygote.start([str(program), *args], program.parent, env, str(out), str(err))
    assert worker.wait() is not None
    return (plain.returncode, plain.stdout, plain.stderr), (worker.returncode, out.read_text(), err.read_text())


@pytest.mark.parametrize("args", [["ok", "x y"], ["exit", "3"], ["exit", "0"], ["exit", "-1"], ["exit", "257"], ["message"]])
def test_a_forked_worker_exits_prints_and_sees_what_the_interpreter_does(zygote, program, tmp_path, args):
    plain, forked = _both(zygote, program, args, tmp_path)
    assert forked == plain
    assert '"name": "__main__"' in forked[1] and '"rank": "3"' in forked[1] and '"helper": 7' in forked[1]


def test_an_uncaught_exception_exits_1_with_its_traceback(zygote, program, tmp_path):
    plain, forked = _both(zygote, program, ["raise"], tmp_path)
    assert forked[0] == plain[0] == 1 and forked[1] == plain[1]
    assert forked[2].startswith("Traceback (most recent call last):")
    assert forked[2].splitlines()[-1] == plain[2].splitlines()[-1] == "ValueError: boom"


def test_a_signalled_worker_reports_the_signal(zygote, program, tmp_path):
    worker = zygote.start([str(program), "hang"], program.parent, subprocess_env(), str(tmp_path / "o"),
                          str(tmp_path / "e"))
    deadline = time.monotonic() + 60
    out = tmp_path / "o"
    while not (out.exists() and out.read_text()) and time.monotonic() < deadline:  # started and printed
        time.sleep(0.05)
    assert worker.poll() is None
    worker.send_signal(signal.SIGTERM)
    assert worker.wait() == -signal.SIGTERM


def test_launches_after_the_zygote_died_start_interpreters(zygote, program):
    from conftest import run_torchrun

    zygote.proc.kill()
    zygote.proc.wait()
    try:
        result = run_torchrun(program, 2, ["ok"])
        assert result.returncode == 0, result.stderr
        assert result.stdout.count('"name": "__main__"') == 2 and _Zygote._one is False
    finally:
        _Zygote._one = None  # the next launch starts a zygote again


def test_python_dash_m_runs_the_module_from_the_working_directory(zygote, tmp_path):
    """``run_python(["-m", MODULE, ...])`` (the hetpar command's tests) as ``python -m``: argv[0] the module's
    file, the working directory first on the import path, its exit status."""
    (tmp_path / "mymod.py").write_text("import sys, os\nprint(__name__, os.path.basename(sys.argv[0]), sys.argv[1:])\n"
                                       "sys.exit(int(sys.argv[1]))\n")
    plain = subprocess.run([sys.executable, "-m", "mymod", "4", "b"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    forked = run_python(["-m", "mymod", "4", "b"], cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert forked.returncode == 4 and forked.stdout == "__main__ mymod.py ['4', 'b']\n"
