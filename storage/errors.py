"""The errors the run folder raises: bad files and bad requests, each naming its culprit.

Failures of an episode are data (columns in the tables); these exceptions are for files
that cannot be trusted and for calls that ask for something the folder cannot give.
"""

from __future__ import annotations

from pathlib import Path


class StorageError(Exception):
    """Anything wrong with a run folder or one of its files."""


class CorruptFileError(StorageError):
    """A file that cannot be read back whole: truncated, bit-flipped, not Parquet/JSON."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: corrupt file ({problem})")
        self.path = path
        self.problem = problem


class SchemaMismatchError(StorageError):
    """A table or file that is not the record it should be: foreign, or other columns.

    ``path`` is None for an in-memory table handed to a conversion.
    """

    def __init__(self, path: Path | None, problem: str) -> None:
        super().__init__(f"{path if path is not None else 'table'}: {problem}")
        self.path = path
        self.problem = problem


class SchemaVersionError(SchemaMismatchError):
    """A rollflow file written under another ``SCHEMA_VERSION``."""


class StageExistsError(StorageError):
    """A finished stage output is never rewritten: its existence means it is complete."""


class ConfigMismatchError(StorageError):
    """The frozen ``config.toml`` of a run differs from the one being written."""


class NoDataError(StorageError):
    """A query asked about a step, split or run the folder holds no rows for."""
