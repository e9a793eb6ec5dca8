"""A model file's ``key=value`` arguments (``--model-arg``), parsed without importing torch."""

from __future__ import annotations

from typing import Any

from hetpar.runtime.errors import ModelFileError


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings; values become int, float, bool or str.

    Raises:
        ModelFileError: a pair has no ``=`` or an empty key.
    """
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ModelFileError(f"--model-arg {pair!r} is not key=value (e.g. --model-arg n_layers=4)")
        args[key.strip()] = _parse_value(raw.strip())
    return args


def _parse_value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw
