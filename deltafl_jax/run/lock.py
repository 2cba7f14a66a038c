"""One process at a time per output folder: an exclusive advisory lock on ``deltafl.lock``
(:data:`deltafl_jax.outputs.directory.LOCK`) in the folder, held by ``experiments.run`` (each program's
output directory), ``experiments.tune`` (its ``--output_dir``) and ``experiments.leaderboard``
(its ``--out``) for as long as they write there.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on the file, not the file's existence nor the PID in it:

- the kernel releases it when the process ends in any way (exit, exception, SIGKILL, a crash),
  so a stale lock is never a question: a dead run's folder is free at once, and the next run
  takes it over (the file it left behind is reused);
- a PID written in the file is never trusted (PIDs are reused, and mean nothing on another
  host); the holder's pid, host, start time and command are written into the file after the
  lock is taken, only to name the holder in the refusal. A crash between creating the file and
  writing them leaves an empty file, which locks nothing;
- on NFS, Linux implements flock with the server's byte-range locks, so runs on two hosts that
  share the folder exclude each other (not with the ``local_lock=flock`` mount option). A
  filesystem that cannot lock at all (e.g. Lustre mounted without ``flock``) gives a
  :class:`FolderLock` with ``held`` false and a ``warning`` line, and the command goes on.

A released lock removes its file (still holding the lock); a process that locked the file
just before it was removed sees that the path no longer names the file it locked and tries
again, so two processes never hold locks on two different files of one folder.

Only the process that writes the folder locks it: in a multi-process run
(:mod:`deltafl_jax.run.distributed`) that is process 0; the others write only the shared
checkpoints, collectively with it, and take no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Iterator, List, Optional, Sequence

from deltafl_jax.errors import ConfigError
from deltafl_jax.outputs.directory import LOCK

# Errors of a filesystem that cannot lock (the lock is then skipped, with a warning).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HELD: dict = {}   # os.path.realpath(folder) -> FolderLock, the folders this process holds


class FolderLock:
    """A held (or, on a filesystem without locks, attempted) lock of one folder."""

    def __init__(self, folder: str, fd: Optional[int], created: Sequence[str] = (),
                 warning: str = ""):
        self.folder = folder
        self.fd = fd
        self.created = list(created)   # the folders made for the lock, deepest first
        self.warning = warning

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Remove the lock file (still holding the lock), unlock, and remove the folder when
        it was made for the lock and nothing else was written into it."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.folder, LOCK))
            os.close(self.fd)
            self.fd = None
            _HELD.pop(os.path.realpath(self.folder), None)
        _remove_empty(self.created)
        self.created = []


def _remove_empty(folders: Sequence[str]) -> None:
    """Remove each of `folders` (deepest first) that is empty; stop at the first that is not."""
    for d in folders:
        try:
            os.rmdir(d)
        except OSError:
            return


def _make(folder: str) -> List[str]:
    """Make `folder` and its missing parents; the ones made, deepest first."""
    missing, p = [], os.path.abspath(folder)
    while not os.path.isdir(p) and p != os.path.dirname(p):
        missing.append(p)
        p = os.path.dirname(p)
    os.makedirs(folder, exist_ok=True)
    return missing


def _describe(text: str) -> str:
    """'pid P on host H since T, COMMAND' from a lock file's contents ('' when unreadable)."""
    try:
        info = json.loads(text)
        return (f"pid {info['pid']} on host {info['host']} since {info['since']}, "
                f"{info['command']}")
    except (ValueError, KeyError, TypeError):
        return ""


def _refusal(flag: str, folder: str, holder: str) -> ConfigError:
    who = f" ({holder})" if holder else ""
    return ConfigError(f"{flag}={folder} is in use by another process{who}; wait until it ends "
                       f"or choose another directory")


def _holder_text(path: str) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(path) as f:
            return _describe(f.read(4096))
    return ""


def holder(folder: str) -> Optional[str]:
    """None when no other process holds `folder`'s lock (or the folder has none); else a
    description of the holder ('' when it wrote none). Changes nothing in the folder."""
    if not folder or os.path.realpath(folder) in _HELD:
        return None
    path = os.path.join(folder, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(path)
    except OSError:
        return None
    finally:
        os.close(fd)    # closing the descriptor drops a shared lock taken above
    return None


def check_free(folder: Optional[str], flag: str = "--output_dir") -> None:
    """ConfigError (one line) when another process holds `folder`'s lock."""
    found = holder(folder) if folder else None
    if found is not None:
        raise _refusal(flag, folder, found)


def _command() -> str:
    """The command that holds the lock, e.g. 'experiments/run.py' (no flags: one short line)."""
    parts = os.path.normpath(sys.argv[0] if sys.argv and sys.argv[0] else "python").split(os.sep)
    return "/".join(parts[-2:])


def _stamp(fd: int) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": _command()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)


def _lock_file(folder: str, flag: str) -> Optional[int]:
    """A descriptor of `folder`/deltafl.lock holding its exclusive lock; ConfigError when
    another process holds it; None when the path was replaced meanwhile (try again)."""
    path = os.path.join(folder, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        mine = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)     # released and removed by its holder meanwhile: a new file
            return None
        _stamp(fd)
        return fd
    except BlockingIOError:
        os.close(fd)
        raise _refusal(flag, folder, _holder_text(path)) from None
    except BaseException:
        os.close(fd)
        raise


def acquire(folder: str, flag: str = "--output_dir") -> FolderLock:
    """Lock `folder` (made when absent, with its missing parents, which release removes
    again when they are left empty).

    ConfigError (one line, the holder named) when another process holds it; the folder is
    then left as it was. On a filesystem without locks the result has ``held`` false and a
    ``warning``."""
    for _ in range(100):
        created = _make(folder)
        try:
            fd = _lock_file(folder, flag)
        except FileNotFoundError:   # the folder was removed meanwhile (a released lock)
            continue
        except ConfigError:
            _remove_empty(created)
            raise
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            return FolderLock(folder, None, created,
                              warning=f"warning: {flag}={folder} cannot be locked ({e.strerror}"
                                      f"); two processes writing into it would corrupt it")
        if fd is not None:
            lock = FolderLock(folder, fd, created)
            _HELD[os.path.realpath(folder)] = lock
            return lock
    raise ConfigError(f"{flag}={folder}: cannot take its lock (its lock file keeps changing)")


@contextlib.contextmanager
def locked(folder: Optional[str], flag: str = "--output_dir",
           log=None) -> Iterator[Optional[FolderLock]]:
    """`folder` locked for the block (:func:`acquire`; nothing without a folder); a warning
    about a filesystem without locks goes to `log`."""
    if not folder:
        yield None
        return
    lock = acquire(folder, flag)
    if lock.warning and log is not None:
        log(lock.warning)
    try:
        yield lock
    finally:
        lock.release()
