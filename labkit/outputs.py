"""Writing results so that they are never lost, mixed or half-written.

A run's results are several files (`requests.parquet`, `steps.parquet`,
`summary.json`) that only make sense together. Writing them one by one into the
folder the user named leaves, after a kill or a full disk, the new requests beside
the old run's steps; two runs given the same folder mix their files. So a results
folder is written the way a database commits:

- **claimed first** (`OutDir`): before anything runs, the folder is checked (not a
  file, no earlier results unless the user said ``--overwrite``, a parent we can write)
  and *locked*: an exclusive `flock` on a hidden sibling ``.<name>.lock``. A second
  writer is refused at once, naming the folder; the lock dies with its process, so a
  killed run never blocks the next one.
- **written aside**: the files go into a fresh hidden sibling folder
  ``.<name>.saving-<pid>-<random>`` on the same filesystem;
- **swapped in whole**: a new folder is renamed into place; an existing one is
  exchanged with the new one in one atomic `renameat2(RENAME_EXCHANGE)` (Linux), then
  the old one is deleted. Files in the folder that are not results (a sweep run's
  ``notebook.ipynb``) are carried over first, by hard link. At every instant the folder
  holds the old results or the new ones. Where the exchange is not available, the old
  folder is renamed aside first and put back by the next writer if a kill struck in
  between.

Leftover hidden siblings of a killed writer are removed by the next one that holds the
lock. `trace gen --out` writes one file: `check_regular_target` refuses anything that
is not a regular file (a device such as ``/dev/null``, a FIFO, a directory) before a
temporary file is renamed over it.

`strict_json` is the one JSON encoding of results: NaN and infinities (an undefined
percentile, a speed over zero seconds) become ``null``, so every JSON parser reads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import math
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from labkit.errors import ConfigError

RESULT_FILES = ("requests.parquet", "steps.parquet", "summary.json")
_SAVING = ".saving-"
_OLD = ".old-"


class OutDirError(ConfigError):
    """An output folder that cannot be used: the message names it and why."""


# ----------------------------------------------------------------------- JSON
def json_safe(value):
    """`value` with every non-finite float replaced by None and numpy scalars made
    plain, recursively (dicts, lists, tuples)."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def strict_json(value, **kwargs) -> str:
    """JSON that strict parsers accept: NaN and infinities are written as null."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


# ------------------------------------------------------------- result folders
class OutDir:
    """A results folder claimed for writing: checked and locked when made, written by
    `write` (aside, then swapped in whole), released by `close` (or `with`)."""

    def __init__(self, path: str | os.PathLike, overwrite: bool = False,
                 results: Iterable[str] = RESULT_FILES, flag: str = "--out") -> None:
        self.path = Path(os.path.realpath(os.fspath(path)))
        self.overwrite, self.results, self.flag = overwrite, tuple(results), flag
        self._made: list[Path] = []  # parent folders we created (removed if unused)
        self._check_target()
        self._make_parents()
        self._lock_fd = self._take_lock()
        self.written = False
        try:
            self._check_target()  # again, now that no other writer can change it
            self._clean_leftovers()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------- checks
    def _check_target(self) -> None:
        p, flag = self.path, self.flag
        if p.exists() and not p.is_dir():
            raise OutDirError(f"{flag} {str(p)!r} exists and is not a directory")
        if p.is_dir() and not self.overwrite:
            held = [name for name in self.results if (p / name).exists()]
            if held:
                raise OutDirError(f"{flag} {str(p)!r} already holds results ({held[0]}); "
                                  "choose a new folder, or pass --overwrite (overwrite=True) to "
                                  "replace them")
        parent = _existing_ancestor(p.parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutDirError(f"{flag} {str(p)!r}: cannot write into {str(parent)!r}")

    def _make_parents(self) -> None:
        missing = []
        for folder in [self.path.parent, *self.path.parent.parents]:
            if folder.exists():
                break
            missing.append(folder)
        try:
            for folder in reversed(missing):
                folder.mkdir()
                self._made.append(folder)
        except OSError as err:
            self._remove_made()
            raise OutDirError(f"{self.flag} {str(self.path)!r}: cannot create "
                              f"{str(err.filename)!r} ({err.strerror})") from None

    def _take_lock(self) -> int:
        lock = self.path.parent / f".{self.path.name}.lock"
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._remove_made()
                raise OutDirError(f"{self.flag} {str(self.path)!r} is being written by another "
                                  "labkit run; wait for it or choose another folder") from None
            # The holder before us may have removed the lock file after we opened it:
            # then our lock is on a file nobody else will open. Try again.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                same = False
            if same:
                self._lock_path = lock
                return fd
            os.close(fd)

    def _clean_leftovers(self) -> None:
        """Hidden siblings of writers killed before they finished (we hold the lock, so
        none is in use). A folder renamed aside whose replacement never arrived is the
        last complete run: it goes back."""
        prefix = f".{self.path.name}"
        for entry in sorted(self.path.parent.iterdir()):
            name = entry.name
            if name.startswith(prefix + _OLD) and not self.path.exists():
                os.rename(entry, self.path)
            elif name.startswith((prefix + _SAVING, prefix + _OLD)) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    # ------------------------------------------------------------ writing
    def write(self, fill: Callable[[Path], None]) -> Path:
        """`fill(folder)` writes the result files into a fresh folder, which then takes
        the place of `path` in one step. Returns `path`."""
        if self._lock_fd is None:
            raise RuntimeError("this OutDir is closed")
        tmp = self.path.parent / f".{self.path.name}{_SAVING}{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            fill(tmp)
            _sync_tree(tmp)
            if self.path.is_dir():
                self._carry_over(tmp)
                self._swap(tmp)
            else:
                os.rename(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(self.path.parent)
        self.written = True
        return self.path

    def _carry_over(self, tmp: Path) -> None:
        """Entries of the existing folder that are not results (and that the new run
        did not write) go along: files as hard links now, folders after the swap."""
        for entry in self.path.iterdir():
            if entry.name in self.results or (tmp / entry.name).exists():
                continue
            if entry.is_file() and not entry.is_symlink():
                try:
                    os.link(entry, tmp / entry.name)
                except OSError:
                    shutil.copy2(entry, tmp / entry.name)

    def _swap(self, tmp: Path) -> None:
        if _exchange(tmp, self.path):
            old = tmp  # after the exchange, the old results live at the temporary name
        else:
            old = self.path.parent / f".{self.path.name}{_OLD}{os.getpid()}"
            os.rename(self.path, old)
            os.rename(tmp, self.path)
        for entry in old.iterdir():  # folders that are not results
            if entry.name not in self.results and not (self.path / entry.name).exists():
                os.rename(entry, self.path / entry.name)
        shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------ release
    def close(self) -> None:
        if getattr(self, "_lock_fd", None) is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._lock_path)
        os.close(self._lock_fd)
        self._lock_fd = None
        if not self.written:
            self._remove_made()

    def _remove_made(self) -> None:
        for folder in reversed(self._made):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if still empty
        self._made = []

    def __enter__(self) -> OutDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _existing_ancestor(path: Path) -> Path:
    for folder in [path, *path.parents]:
        if folder.exists():
            return folder
    return Path("/")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where not supported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _sync_tree(folder: Path) -> None:
    """The new files' bytes reach the disk before a rename makes them the results."""
    for entry in folder.iterdir():
        if entry.is_file():
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- one file
def check_regular_target(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Refuse an output path that exists and is not a regular file (a device, a FIFO,
    a socket, a directory): writing would replace it. Returns the path."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # the writer names a blocked parent
        return path
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise OutDirError(f"{flag} {str(path)!r} is {kind}; labkit writes only regular files")
    return path
