"""Opening the Optuna storage a sweep writes to, with every way it can be bad made a clear error.

* A journal file (the default, ``<out>/optuna.journal``, or any path given to ``--storage``):
  Optuna's ``JournalFileBackend`` with its symlink lock. The path is made absolute, because the
  lock is a symlink to the journal and Optuna's stale-lock check follows it: a relative target
  resolves against the link's own directory, never exists, and a lock left by a killed process
  would then be waited on forever.
* An RDB URL (``sqlite:///...``, ``postgresql://...``): Optuna's ``RDBStorage`` with its
  heartbeat, so that workers on several machines retry each other's abandoned trials. SQLite
  serves one process only (``check_shared``): ``--workers`` and ``worker`` refuse it.

Before the journal is used its every line is checked. A torn last line (a kill or a full disk
in the middle of an append) is cut off under the journal's lock and kept next to it as
``<journal>.torn-<time>``: left in place, the next append would be glued to it and make a line
that no later read could parse. Anything else that is not a journal record is an error naming
the line; nothing is changed then.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import warnings
from pathlib import Path

JOURNAL_NAME = "optuna.journal"
JOURNAL_LOCK_GRACE_S = 10  # appends hold the lock for milliseconds; a lock this old is a kill's
RDB_SCHEMES = ("sqlite", "postgresql", "mysql")
# A trial whose worker has not beaten for HEARTBEAT_GRACE_S is failed by the next worker that
# looks, and retried (RetryFailedTrialCallback); measuring one config takes seconds at most.
HEARTBEAT_INTERVAL_S = 5
HEARTBEAT_GRACE_S = 20


class StorageError(Exception):
    """A storage that cannot be opened or read; ``str()`` names it and the problem."""


def is_rdb_url(storage: str | None) -> bool:
    return bool(storage) and "://" in storage


def journal_path(storage: str | None, out_dir) -> Path:
    """The absolute journal path of ``--storage`` (a path) or of ``<out_dir>``."""
    return Path(storage if storage else Path(out_dir) / JOURNAL_NAME).absolute()


def _lock(path: Path):
    from optuna.storages.journal import JournalFileSymlinkLock
    return JournalFileSymlinkLock(str(path), grace_period=JOURNAL_LOCK_GRACE_S)


def clear_dangling_lock(path: Path) -> bool:
    """Remove a journal lock whose symlink points nowhere (a relative target, as older versions
    of this tool wrote): Optuna's stale-lock check cannot age it and would wait forever."""
    lock = Path(str(path) + ".lock")
    if lock.is_symlink() and not lock.exists():
        lock.unlink(missing_ok=True)
        return True
    return False


def _scan_journal(path: Path) -> int | None:
    """Byte offset where a torn last line starts (``None`` when the file is whole).

    Raises StorageError when any complete line is not a journal record.
    """
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise StorageError(f"{path} is a directory, not an Optuna journal file") from None
    except OSError as err:
        raise StorageError(f"cannot read {path}: {err.strerror}") from None
    offset = 0
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if not line.endswith(b"\n"):
            return offset
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            record = None
        if not isinstance(record, dict) or "op_code" not in record:
            raise StorageError(f"{path}: line {number} is not an Optuna journal record; "
                               f"the file is not a journal or was damaged (nothing was changed)")
        offset += len(line)
    return None


def repair_torn_tail(path: Path) -> Path | None:
    """Cut a torn last line off the journal, under its lock; return where it was kept."""
    if _scan_journal(path) is None:
        return None
    lock = _lock(path)
    lock.acquire()
    try:
        torn_at = _scan_journal(path)  # again under the lock: another writer may have fixed it
        if torn_at is None:
            return None
        with open(path, "rb+") as handle:
            handle.seek(torn_at)
            tail = handle.read()
            stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
            kept = path.with_name(f"{path.name}.torn-{stamp}")
            kept.write_bytes(tail)
            handle.truncate(torn_at)
            handle.flush()
            os.fsync(handle.fileno())
        return kept
    finally:
        lock.release()


def _check_parent(path: Path, what: str) -> None:
    for parent in [path.parent, *path.parent.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise StorageError(f"{what} {path}: {parent} is a file, not a directory")
            return


def open_journal(path: Path, *, repair: bool = True, create: bool = True):
    """Optuna's journal storage on ``path``; a torn tail is cut off when ``repair``."""
    import optuna

    _check_parent(path, "journal")
    if clear_dangling_lock(path):
        import click
        click.echo(f"warning: removed the journal lock {path}.lock, which pointed nowhere "
                   f"(left by a killed process)", err=True)
    if path.exists():
        if repair:
            kept = repair_torn_tail(path)
            if kept is not None:
                import click
                click.echo(f"warning: {path} ended in a torn record (a kill or a full disk); "
                           f"it was cut off and kept in {kept}", err=True)
        else:
            _scan_journal(path)
    elif not create:
        raise StorageError(f"no journal at {path}")
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StorageError(f"cannot create the folder of journal {path}: "
                               f"{err.strerror}") from None
    try:
        backend = optuna.storages.journal.JournalFileBackend(str(path), lock_obj=_lock(path))
    except OSError as err:
        raise StorageError(f"cannot open journal {path}: {err.strerror}") from None
    return optuna.storages.JournalStorage(backend)


def _check_rdb_url(url: str):
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StorageError(f"--storage {url!r} is not a database URL "
                           f"(expected e.g. sqlite:///path.db or postgresql://host/db)") from None
    if parsed.get_backend_name() not in RDB_SCHEMES:
        raise StorageError(f"--storage {url!r}: unknown database {parsed.get_backend_name()!r}; "
                           f"expected one of {', '.join(RDB_SCHEMES)} or a journal file path")
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise StorageError(f"--storage {url!r}: an in-memory database keeps nothing; "
                               f"give a file, e.g. sqlite:///results/optuna.db")
        folder = Path(parsed.database).absolute().parent
        if not folder.is_dir():
            raise StorageError(f"--storage {url!r}: folder {folder} does not exist")
    return parsed


def _with_driver(url: str) -> str:
    """``postgresql://`` means SQLAlchemy's default driver, psycopg2; where only psycopg 3 is
    installed, use that one."""
    import importlib.util
    if url.startswith("postgresql://") and importlib.util.find_spec("psycopg2") is None \
            and importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


def _retry_callback() -> dict:
    """Optuna's retry of stale trials (RetryHeartbeatStaleTrialCallback from Optuna 4.9,
    RetryFailedTrialCallback before): a failed stale trial comes back as a WAITING one."""
    import inspect

    import optuna
    names = inspect.signature(optuna.storages.RDBStorage).parameters
    if "heartbeat_stale_trial_callback" in names:
        return {"heartbeat_stale_trial_callback":
                optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=3)}


def open_rdb(url: str):
    """Optuna's RDB storage on ``url``; bad URLs, unreachable servers and foreign schemas are
    StorageErrors, and nothing is written to a database whose schema this Optuna cannot read."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    _check_rdb_url(url)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                _with_driver(url), heartbeat_interval=HEARTBEAT_INTERVAL_S,
                grace_period=HEARTBEAT_GRACE_S, **_retry_callback())
    except ImportError as err:
        raise StorageError(f"--storage {url!r}: its database driver is not installed "
                           f"({err})") from None
    except SQLAlchemyError as err:
        reason = str(getattr(err, "orig", None) or err).strip().splitlines()[0]
        raise StorageError(f"--storage {url!r}: cannot use the database: {reason}") from None
    except RuntimeError as err:  # Optuna: the schema was written by another version
        raise StorageError(f"--storage {url!r}: {str(err).strip().splitlines()[0]}") from None


def check_shared(storage: str | None, what: str) -> None:
    """Refuse SQLite where several processes measure: Optuna hands an enqueued trial to the
    first process that asks under a row lock that SQLite does not have, so two workers asking
    at once can take the same trial and both measure it."""
    if is_rdb_url(storage) and _check_rdb_url(storage).get_backend_name() == "sqlite":
        raise StorageError(f"--storage {storage!r}: {what} share the storage among processes, "
                           f"which SQLite cannot do safely; use a journal file (the default) "
                           f"or PostgreSQL")


def open_storage(storage: str | None, out_dir, *, repair: bool = True, create: bool = True):
    """The storage named by ``--storage`` (an RDB URL or a journal path), else
    ``<out_dir>/optuna.journal``."""
    if is_rdb_url(storage):
        return open_rdb(storage)
    return open_journal(journal_path(storage, out_dir), repair=repair, create=create)


def describe(storage: str | None, out_dir) -> str:
    return storage if is_rdb_url(storage) else str(journal_path(storage, out_dir))
