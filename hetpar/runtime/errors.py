"""The runtime's errors, in a module that imports nothing: the CLI names them to turn them
into one line without loading torch (``hetpar --help`` and a bad argument answer at once)."""

from __future__ import annotations


class ModelFileError(Exception):
    """A model file is missing, does not import, or breaks the contract."""


class TraceError(Exception):
    """The model cannot be captured as a graph."""


class DataError(Exception):
    """A token file that does not fit the model or the plan; the message says how."""
