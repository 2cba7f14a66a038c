"""The crash-safe cache of prepared datasets: a dataset directory is built privately, given
``checksums.json`` and installed with one rename; opening it checks the files' sizes against
those checksums, and a failed read checks their sha256.

A whole cache. :func:`~deltafl_jax.datasets.prepared.write` has tfds build the dataset in a
private temporary ``data_dir``
(``<data_dir>/deltafl_<name>/.incomplete-<config>-<host>-<pid>-<rand>/``), then adds
``checksums.json`` (the size and sha256 of every file, and a digest of the content that was
written) and moves the finished version directory into place with one ``rename``. A rename onto a
non-empty directory fails, so when two processes prepare the same dataset at once the first one
installs its copy and the second finds it there: if that copy is whole and holds the same content
it keeps it and discards its own; otherwise (older source, damaged) it moves the old one aside and
installs its own. We chose this over an ``fcntl`` lock because it needs no lock file that outlives
a killed process, works where file locks do not (NFS, some FUSE mounts), and readers never see a
half-written directory without taking any lock; the cost is that two concurrent preparations both
do the work. A killed preparation leaves only its ``.incomplete-*`` directory, removed by the next
:func:`~deltafl_jax.datasets.prepared.write` on the same host.

Checking it. Opening costs O(metadata): :func:`~deltafl_jax.datasets.prepared.open_prepared`
compares the files' presence and sizes with ``checksums.json`` before tfds reads anything, and
hashes nothing, and :func:`~deltafl_jax.datasets.prepared.open_or_prepare` rebuilds a dataset that
fails this (a missing or truncated file, no checksums) with a one-line warning on stderr. The full
sha256 pass (:func:`check_files`) runs at preparation, in ``python -m data_prep.verify``, and when
reading the metadata or the records fails (or gives inconsistent metadata): a file that then fails
its sha256 is a :class:`DamagedDataset` telling the user to prepare it again. A byte altered in
place that the reads survive (array_record's padding) is seen by ``data_prep.verify`` only.

Its source. A prepared dataset is keyed by what its raw source held, not by its path alone: the
metadata records the size, modification time and sha256 of every source file read
(:func:`file_facts`; :func:`~deltafl_jax.datasets.prepared.write` records the files below
``metadata["source"]`` unless the dataset names them), and a load that names its source compares
the files there with the record (:func:`source_change`) and prepares the dataset again, with one
line on stderr naming the file, when one changed. Sources up to
:data:`~deltafl_jax.datasets.prepared.HASH_EVERY_LOAD` bytes are hashed at every such load; larger
ones (a raw FEMNIST or StackOverflow of gigabytes) when a file's size or modification time
changed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.data import DataError
from deltafl_jax.errors import DamagedDataset

INFO_FILE = "dataset_info.json"   # tfds' file, listed by every whole dataset's checksums
CHECKSUMS_FILE = "checksums.json"
_INCOMPLETE = ".incomplete-"
_TRASH = ".trash-"
_CHUNK = 1 << 22


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_sha256(name: str, config: str, version: str, spec, clients: Sequence[Mapping],
                   metadata: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    """A digest of what :func:`~deltafl_jax.datasets.prepared.write` packages (tfds'
    array_record files are not byte-for-byte reproducible, so two preparations of the same
    data are compared by this instead); `spec` is the records' feature spec."""
    digest = hashlib.sha256()
    digest.update(json.dumps([name, config, version, dict(metadata)], sort_keys=True,
                             default=str).encode("utf-8"))

    def add(tag: str, value) -> None:
        value = np.ascontiguousarray(value)
        digest.update(f"\0{tag}:{value.dtype.str}:{value.shape}\0".encode("utf-8"))
        digest.update(value.tobytes())

    for client in clients:
        digest.update(f"\0client:{client['client_id']}".encode("utf-8"))
        for key, (_, dtype) in spec.items():
            add(key, np.asarray(client[key], dtype=dtype))
    for key in sorted(arrays):
        add(f"array:{key}", arrays[key])
    return digest.hexdigest()


def _write_checksums(path: str, content_sha256: str) -> None:
    """Record the size and sha256 of every file of the finished dataset directory `path`."""
    files = {}
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if entry != CHECKSUMS_FILE and os.path.isfile(full):
            files[entry] = {"size": os.path.getsize(full), "sha256": _file_sha256(full)}
    document = {"format": 1, "content_sha256": content_sha256, "files": files}
    with open(os.path.join(path, CHECKSUMS_FILE), "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1, sort_keys=True)


def read_checksums(path: str) -> Optional[dict]:
    """The checksums.json of the dataset directory `path`, or None when absent or unreadable."""
    try:
        with open(os.path.join(path, CHECKSUMS_FILE), encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or not isinstance(document.get("files"), dict):
        return None
    return document


def check_files(path: str, full: bool = True) -> List[Tuple[str, Optional[str]]]:
    """(file, problem) for every file that the checksums of the dataset directory `path` list,
    problem None when the file matches, else a few words ("has 10 bytes, not 20"). Sizes are
    always compared; sha256 only when `full`, and only of files of the right size (a size
    mismatch already settles it). A manifest that is absent, unreadable or incomplete is one
    entry, (checksums.json, why)."""
    if not os.path.exists(os.path.join(path, CHECKSUMS_FILE)):
        return [(CHECKSUMS_FILE, "is missing")]
    document = read_checksums(path)
    if document is None:
        return [(CHECKSUMS_FILE, "is unreadable")]
    files = document["files"]
    if INFO_FILE not in files:
        return [(CHECKSUMS_FILE, f"does not list {INFO_FILE}")]
    out: List[Tuple[str, Optional[str]]] = []
    try:
        for entry, want in sorted(files.items()):
            full_path = os.path.join(path, entry)
            if not os.path.isfile(full_path):
                out.append((entry, "is missing"))
                continue
            size = os.path.getsize(full_path)
            if size != int(want["size"]):
                out.append((entry, f"has {size} bytes, not {want['size']}"))
            elif full and _file_sha256(full_path) != want["sha256"]:
                out.append((entry, "fails its sha256 check"))
            else:
                out.append((entry, None))
    except (OSError, KeyError, TypeError, ValueError) as err:
        return [(CHECKSUMS_FILE, f"cannot be checked: {err}")]
    return out


def damage(path: str, full: bool = True) -> Optional[str]:
    """None when the dataset directory `path` matches its checksums, else why not (a few
    words). `full=False` compares only the files' presence and sizes (no file is read): what
    :func:`~deltafl_jax.datasets.prepared.open_prepared` checks; `full=True` also their sha256
    (see :func:`check_files`)."""
    for entry, problem in check_files(path, full):
        if problem is not None:
            return f"{entry} {problem}"
    return None


def damaged_or_raise(name: str, path: str, err: BaseException):
    """After reading `path` failed with `err`: the full sha256 check, then DamagedDataset
    when a file does not match its checksums, else `err` again (it was not the files)."""
    reason = damage(path, full=True)
    if reason is not None:
        raise DamagedDataset(name, path, reason) from err
    raise err


def _private_name(kind: str, config: str) -> str:
    """A directory name private to this process: <kind><config>-<rand>-<host>-<pid>."""
    return f"{kind}{config}-{uuid.uuid4().hex[:8]}-{socket.gethostname()}-{os.getpid()}"


_PRIVATE = re.compile(r"^(?:\.incomplete-|\.trash-)[^-]*-[0-9a-f]{8}-(?P<host>.+)-(?P<pid>\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists
        return True
    return True


def remove_leftovers(builder_root: str) -> None:
    """Remove the temporary directories of killed preparations on this host (their process is
    gone). Other hosts' directories are left alone: their processes cannot be checked here."""
    host = socket.gethostname()
    try:
        entries = os.listdir(builder_root)
    except OSError:
        return
    for entry in entries:
        match = _PRIVATE.match(entry)
        if match and match.group("host") == host and not _pid_alive(int(match.group("pid"))):
            shutil.rmtree(os.path.join(builder_root, entry), ignore_errors=True)


def _install(built: str, out_dir: str, builder_root: str, config: str,
             content_sha256: str) -> bool:
    """Move the finished directory `built` to `out_dir` with one atomic rename.

    Returns False when a whole copy of the same content was already there (a concurrent
    preparation finished first): it is kept, as readers may be using it, and `built` is left to
    be discarded. Any other directory there (another source, damaged) is moved aside first.
    """
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    for _ in range(20):
        try:
            os.rename(built, out_dir)  # fails on a non-empty out_dir: never a mixed directory
            return True
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        existing = read_checksums(out_dir)
        if (existing is not None and existing.get("content_sha256") == content_sha256
                and damage(out_dir) is None):
            return False
        trash = os.path.join(builder_root, _private_name(_TRASH, config))
        try:
            os.rename(out_dir, trash)
        except FileNotFoundError:  # someone else moved it meanwhile: try again
            continue
        shutil.rmtree(trash, ignore_errors=True)
    raise DataError(f"cannot install the prepared dataset at {out_dir}: other processes keep "
                    f"replacing it")


def build_and_install(builder_root: str, out_dir: str, config: str, content: str,
                      build: Callable[[str], str]) -> None:
    """Have `build(tmp_root)` write the dataset in a data_dir private to this process (it returns
    the finished directory), record its checksums, and install it at `out_dir` (:func:`_install`);
    the private directory is removed whatever happens."""
    tmp_root = os.path.join(builder_root, _private_name(_INCOMPLETE, config))
    try:
        built = build(tmp_root)
        _write_checksums(built, content)
        _install(built, out_dir, builder_root, config, content)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# The source a dataset was prepared from


def file_facts(paths: Sequence[str]) -> dict:
    """{path: {"size", "mtime_ns", "sha256"}} of the source files `paths`: what a preparation
    read, recorded in the prepared dataset's metadata so that the next load can tell whether
    the source still holds it (:func:`source_change`)."""
    out = {}
    for path in sorted(paths):
        st = os.stat(path)
        out[path] = {"size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns),
                     "sha256": _file_sha256(path)}
    return out


def source_change(recorded: Mapping[str, Mapping], paths: Sequence[str],
                  always_hash: bool = True) -> Optional[str]:
    """None when the source files `paths` hold what `recorded` (their :func:`file_facts` at
    preparation) says, else a few words naming the first difference: a file read now that was
    not then, or the other way round, another size, other contents (sha256). With
    `always_hash`, every file is hashed whatever its size and modification time (a file
    rewritten in place keeps its size, and a copy or an archive's extraction keeps a
    modification time); without, only a file whose modification time changed (for sources too
    large to hash at every load). A modification time alone (the same bytes, touched) is no
    change, as the prepared data would be the same."""
    now, then = set(paths), set(recorded)
    if now != then:
        added, gone = sorted(now - then), sorted(then - now)
        return f"{added[0]} is new" if added else f"{gone[0]} is no longer read"
    for path in sorted(now):
        want = recorded[path]
        try:
            size = os.path.getsize(path)
            if size != int(want["size"]):
                return f"{path} has {size} bytes, not {want['size']}"
            if not always_hash and os.stat(path).st_mtime_ns == int(want["mtime_ns"]):
                continue
            if _file_sha256(path) != want["sha256"]:
                return f"{path} holds other bytes: the same size, another sha256"
        except (OSError, KeyError, TypeError, ValueError) as err:
            return f"{path} cannot be checked ({err})"
    return None
