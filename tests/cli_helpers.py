"""Running the hetpar command as a user does, and checking its one-line errors."""

def hetpar(*args, cwd=None):
    """``python -m hetpar ARGS`` in a process of its own, output captured, bounded (forked from the
    tests' zygote: [Note: workers forked from a zygote] in tests/zygote.py)."""
    from conftest import run_python

    return run_python(["-m", "hetpar", *map(str, args)], cwd=cwd, timeout_s=300)


def assert_one_line_error(result, *fragments):
    """A non-zero exit with exactly one stderr line, no traceback, containing every fragment."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
