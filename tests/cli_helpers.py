"""Running the hetpar command as a user does, and checking its one-line errors."""

import subprocess
import sys


def hetpar(*args, cwd=None):
    """``python -m hetpar ARGS`` in a subprocess, output captured, bounded."""
    return subprocess.run([sys.executable, "-m", "hetpar", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def assert_one_line_error(result, *fragments):
    """A non-zero exit with exactly one stderr line, no traceback, containing every fragment."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
