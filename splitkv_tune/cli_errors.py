"""Bad input as one clear line and exit code 2: output paths, bad files and storages.

Every command checks each output path before it starts working (``check_output``), so a typo
costs nothing, and turns the errors of bad files into ``error: <file>: <problem>`` lines
(``exit_2_on_bad_input``) instead of tracebacks.
"""
from __future__ import annotations

import errno
import functools
import sys
import tempfile
from pathlib import Path

import click

STDOUT = "-"


def number_not_nan(ctx, param, value):
    """A click callback: click's FloatRange lets NaN through (every comparison with it is false)."""
    if value is not None and value != value:
        raise click.BadParameter("must be a number, got nan")
    return value


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def _nearest_existing(path: Path) -> Path:
    for candidate in [path, *path.parents]:
        if candidate.exists():
            return candidate
    return Path(".")


def output_problem(path, *, directory: bool = False) -> str | None:
    """Why ``path`` cannot be written (a file, or with ``directory`` a folder), else ``None``.

    Nothing is created: the nearest existing folder above it is probed with a temporary file.
    """
    path = Path(path).absolute()
    existing = _nearest_existing(path)
    if existing == path:
        if directory and not path.is_dir():
            return f"{path} is a file, not a directory"
        if not directory and path.is_dir():
            return f"{path} is a directory, not a file"
        folder = path if directory else path.parent
    elif not existing.is_dir():
        return f"{existing} is a file, not a directory"
    else:
        folder = existing
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"cannot write in {folder}: {err.strerror}"
    return None


def check_output(path, param_hint: str, *, directory: bool = False, allow_stdout: bool = False):
    """``path`` if it can be written, else a click usage error (exit 2) naming ``param_hint``."""
    if path is None or (allow_stdout and str(path) == STDOUT):
        return path
    problem = output_problem(path, directory=directory)
    if problem:
        raise click.BadParameter(problem, param_hint=param_hint)
    return path


def write_problem(err: OSError) -> str:
    """One line for an OSError raised while writing results (a full disk, a lost mount)."""
    name = f" {err.filename}" if err.filename else ""
    if err.errno == errno.ENOSPC:
        return f"no space left on the device while writing{name}; free space and rerun with --resume"
    return f"cannot write{name}: {err.strerror or err}"


def exit_2_on_bad_input(fn):
    """Run ``fn``; bad tables, grids, storages and failed writes end in one line and exit 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from splitkv_tune.space import GridError
        from splitkv_tune.storage import StorageError
        from splitkv_tune.table_schema import TableError
        try:
            return fn(*args, **kwargs)
        except (TableError, GridError, StorageError) as err:
            fail(str(err))
        except OSError as err:
            fail(write_problem(err))
    return wrapper

