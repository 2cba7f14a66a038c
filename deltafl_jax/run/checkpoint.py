"""Checkpoints of a run, with orbax-checkpoint (issue 12, item 1).

A checkpoint is one orbax step directory ``<output_dir>/checkpoints/<round>/`` with four items,
saved by one :class:`orbax.checkpoint.CheckpointManager` composite save:

- ``state``: the :class:`deltafl_jax.rounds.ServerState` leaves (params, algorithm state,
  round, active flags, the server optimizer's state, the per-client state) as NumPy arrays in
  a nested dict keyed by their pytree path (``params/Dense_0/kernel``, ``algo_state/lam``,
  ``round``); standard (PyTree/OCDBT) handler;
- ``host_arrays``: the NumPy arrays of the host-side histories (standard handler);
- ``host``: everything else of the histories, as JSON, with references to ``host_arrays``;
- ``meta``: JSON: the round, the configuration fingerprint, the jax and orbax versions, and the
  dtype, shape and sha256 of every array (so a restore is checked bit for bit).

PRNG keys are not saved: the run re-derives them from its seeds.

Atomicity. orbax writes a step into ``<round>.orbax-checkpoint-tmp-<time>/`` and renames it to
``<round>/`` once every item is written; steps with the tmp suffix are never listed, so a save
killed midway (even SIGKILL) is never loaded, and the manager deletes such leftovers when it
opens the directory. Old steps are deleted only after the new one is finalised, so a complete
checkpoint exists at every moment once the first is written. ``keep`` (2) steps are kept.

Corruption. :meth:`Checkpointer.restore` reads the newest step; if it cannot be read, or an
array differs from its recorded sha256 (a truncated, deleted or altered file), it says so in one
line on stderr, deletes it and falls back to the previous one.

Layout independence. The state is copied to host NumPy arrays before it is saved, so no device
or sharding is recorded; a restore reads NumPy arrays and places each one like the matching
leaf of the caller's template (its sharding, for any device count), or leaves NumPy arrays when
the template holds NumPy arrays.

Asynchronous saving, and donated buffers. :meth:`Checkpointer.save` first copies every state
leaf into a fresh NumPy array (``np.array(leaf, copy=True)``; a device-to-host transfer on an
accelerator, a memcpy on CPU), then hands those copies to orbax, which writes them in a
background thread. Nothing orbax holds refers to a device buffer, so the next round may donate
the state's buffers (``donate_argnums``) at once. We copy ourselves rather than rely on orbax's
own transfer: on CPU orbax keeps a zero-copy view, which makes JAX silently decline the
donation (an extra copy each round); with our copy the behaviour is the same on every backend.
The blocking part of a save is the copy and the sha256 of each array (about 1.4 GB/s here);
see :data:`DEFAULT_CHECKPOINT_EVERY_S` for measured times. Pass ``async_save=False`` to write
synchronously. A save waits for the previous one; :meth:`Checkpointer.wait` (called by the
callback when a stop is requested and at the end of the run) waits for the last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np

from deltafl_jax.run.callbacks import Callback, RunContext

CHECKPOINT_DIR = "checkpoints"
FORMAT = 1
DEFAULT_KEEP = 2
# Recommended defaults of the run's checkpoint flags; see CheckpointCallback.
DEFAULT_CHECKPOINT_EVERY = 0
DEFAULT_CHECKPOINT_EVERY_S = 120.0

_ARRAY_KINDS = "biuf"  # bool, signed, unsigned, float: what orbax stores
_SAFE_PART = re.compile(r"[^A-Za-z0-9_\-]")


def checkpoint_dir(output_dir: str) -> str:
    """Where a run's checkpoints live: ``<output_dir>/checkpoints``."""
    return os.path.join(output_dir, CHECKPOINT_DIR)


class CheckpointError(Exception):
    """A checkpoint that cannot be read (damaged); restore falls back to an older one."""


class CheckpointMismatch(ValueError):
    """A readable checkpoint whose state does not fit this run's (other shapes, dtypes or
    leaves): the configuration differs. The message names the first differing leaf."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint.

    round: rounds completed when it was saved.
    state: the ServerState (leaves placed like the template's).
    host: the host-side dict given to :meth:`Checkpointer.save` (NumPy arrays restored).
    fingerprint: the fingerprint given to :meth:`Checkpointer.save`, as JSON read it back
      (tuples are lists).
    jax_version: the jax version that saved it.
    """

    round: int
    state: Any
    host: Dict[str, Any]
    fingerprint: Dict[str, Any]
    jax_version: str


@contextlib.contextmanager
def _quiet():
    """orbax logs through absl at WARNING level ("Waiting for previous save to complete took
    ..."), which would reach the command line's stderr; keep only its errors."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


class _ReadFailureNoise(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for the sibling reads of a failed
    tensorstore read (orbax gives up on the first error; the others fail after)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage().startswith("Task exception was never retrieved")
                    and isinstance(exc, ValueError)
                    and any(w in str(exc) for w in ("OCDBT", "zarr", "tensorstore")))


_NOISE_MUFFLED = False


def _muffle_read_failure_noise() -> None:
    """After a damaged checkpoint's read fails, tensorstore completes the other reads of that
    restore on a closed asyncio loop and each prints a "RuntimeError: Event loop is closed"
    traceback (an unraisable exception) and an asyncio error log on stderr, long after our one
    warning line. Drop exactly those two kinds of message, from now on (they may come late)."""
    global _NOISE_MUFFLED
    if _NOISE_MUFFLED:
        return
    _NOISE_MUFFLED = True
    previous = sys.unraisablehook

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_ReadFailureNoise())


def _warn(message: str) -> None:
    print(f"deltafl_jax: warning: {message}", file=sys.stderr, flush=True)


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).data).hexdigest()


def _describe(array: np.ndarray) -> Dict[str, Any]:
    return {"dtype": array.dtype.str, "shape": list(array.shape), "sha256": _sha256(array)}


# ----------------------------------------------------------------------------- state <-> tree


def _part(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaf_paths(tree) -> Tuple[List[str], List[Any], Any]:
    """("params/Dense_0/kernel", ...), the leaves and the treedef of `tree`."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths, leaves = [], []
    for path, leaf in with_paths:
        parts = [_SAFE_PART.sub("_", _part(k)) or "_" for k in path] or ["_"]
        paths.append("/".join(parts))
        leaves.append(leaf)
    if len(set(paths)) != len(paths):
        raise ValueError("state has two leaves with the same sanitised path: "
                         f"{sorted(p for p in paths if paths.count(p) > 1)[0]}")
    return paths, leaves, treedef


def _nest(flat: Mapping[str, Any]) -> Dict[str, Any]:
    """{"a/b": x} -> {"a": {"b": x}} (orbax's tree of the state item)."""
    tree: Dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _unnest(tree: Mapping[str, Any], flat: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _unnest(value, flat, path + "/")
        else:
            flat[path] = value
    return flat


def _host_copy(leaf) -> np.ndarray:
    """A fresh host array holding `leaf` (never a view of a device buffer)."""
    if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise TypeError("PRNG keys are not checkpointed (they are re-derived from the seeds); "
                        "keep them out of the saved state")
    return np.array(leaf, copy=True)


# ----------------------------------------------------------------------------- host <-> json


def _encode(value, arrays: Dict[str, np.ndarray], where: str):
    """JSON for `value`; its non-empty numeric NumPy arrays go to `arrays` as references."""
    if isinstance(value, jax.Array):
        value = np.asarray(value)
    if isinstance(value, np.generic):
        if value.dtype.kind not in _ARRAY_KINDS:
            raise TypeError(f"host state at {where}: cannot save a {value.dtype} scalar")
        return {"__scalar__": value.dtype.str, "value": value.item()}
    if isinstance(value, np.ndarray):
        if value.dtype.kind in _ARRAY_KINDS:
            if value.size == 0:  # orbax stores no zero-size array: the dtype and shape say it
                return {"__empty__": value.dtype.str, "shape": list(value.shape)}
            key = f"a{len(arrays)}"
            arrays[key] = np.array(value, copy=True)
            return {"__ndarray__": key}
        if value.dtype.kind == "U":
            return {"__strarray__": value.dtype.str, "shape": list(value.shape),
                    "values": value.ravel().tolist()}
        raise TypeError(f"host state at {where}: cannot save a {value.dtype} array")
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, arrays, f"{where}/{k}") for k, v in value.items()}
        return {"__dict__": [[_encode(k, arrays, where), _encode(v, arrays, f"{where}/{k}")]
                             for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, arrays, f"{where}/{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, arrays, f"{where}/{i}") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"host state at {where}: cannot save a {type(value).__name__}")


def _decode(value, arrays: Mapping[str, np.ndarray]):
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "__ndarray__" in value:
        return arrays[value["__ndarray__"]]
    if "__scalar__" in value:
        return np.dtype(value["__scalar__"]).type(value["value"])
    if "__empty__" in value:
        return np.zeros(value["shape"], dtype=np.dtype(value["__empty__"]))
    if "__strarray__" in value:
        return np.array(value["values"], dtype=np.dtype(value["__strarray__"])).reshape(
            value["shape"])
    if "__tuple__" in value:
        return tuple(_decode(v, arrays) for v in value["__tuple__"])
    if "__dict__" in value:
        return {_hashable(_decode(k, arrays)): _decode(v, arrays) for k, v in value["__dict__"]}
    return {k: _decode(v, arrays) for k, v in value.items()}


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# ----------------------------------------------------------------------------- fingerprints


def _canonical(value) -> str:
    """The JSON text of `value` as a checkpoint stores it (tuples -> lists, NaN == NaN)."""
    return json.dumps(value, sort_keys=True, default=str)


def fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """The names of the settings whose values differ between two fingerprints (sorted).

    Values are compared as the checkpoint stores them (JSON: a tuple equals the list of its
    items, NaN equals NaN); a setting present on one side only differs. Nested dicts are
    compared key by key and named "outer.inner".
    """
    saved = json.loads(_canonical(dict(saved)))
    current = json.loads(_canonical(dict(current)))
    names: List[str] = []

    def walk(a, b, prefix):
        for key in sorted(set(a) | set(b)):
            name = f"{prefix}{key}"
            if key in a and key in b and isinstance(a[key], dict) and isinstance(b[key], dict):
                walk(a[key], b[key], name + ".")
            elif key not in a or key not in b or _canonical(a[key]) != _canonical(b[key]):
                names.append(name)

    walk(saved, current, "")
    return names


# ----------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """The checkpoints of one run, in `directory` (``<output_dir>/checkpoints``).

    Args:
      directory: the checkpoint directory (created on the first save).
      keep: how many of the newest checkpoints to keep (default 2).
      async_save: write in a background thread after copying the state to the host (see the
        module docstring); False writes before :meth:`save` returns.
    """

    def __init__(self, directory: str, keep: int = DEFAULT_KEEP, async_save: bool = True):
        import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

        self._ocp = ocp
        self.directory = os.path.abspath(directory)
        self.keep = int(keep)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, enable_async_checkpointing=async_save, create=False,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.last_save_s: Optional[float] = None  # blocking seconds of the last save

    # -- saving

    def save(self, round: int, state, host: Mapping[str, Any],
             fingerprint: Mapping[str, Any]) -> None:
        """Save checkpoint `round` (rounds completed).

        state: the ServerState pytree (device or host arrays; copied before this returns, so
          the caller may donate its buffers at once).
        host: a JSON-able dict whose leaves may also be NumPy arrays, NumPy scalars and tuples.
        fingerprint: JSON-able dict of the settings and data hash that a resume must match.

        A checkpoint already saved for `round` is kept as it is; any for later rounds (left
        from an earlier life of this directory) are deleted first, so the newest checkpoint
        is always this run's.
        """
        start = time.perf_counter()
        round = int(round)
        saved_round = getattr(state, "round", None)
        if saved_round is not None and np.ndim(saved_round) == 0 and int(saved_round) != round:
            raise ValueError(f"checkpoint for round {round} of a state at round "
                             f"{int(saved_round)}")
        with _quiet():
            self._manager.wait_until_finished()  # the previous save (and its error, if any)
            self._manager.reload()
            steps = self._manager.all_steps()
        if round in steps:
            return
        paths, leaves, _ = _leaf_paths(state)
        copies = {p: _host_copy(leaf) for p, leaf in zip(paths, leaves)}
        host_arrays: Dict[str, np.ndarray] = {}
        host_json = _encode(dict(host), host_arrays, "host")
        meta = {
            "format": FORMAT,
            "round": round,
            "fingerprint": json.loads(_canonical(dict(fingerprint))),
            "jax_version": jax.__version__,
            "orbax_version": getattr(self._ocp, "__version__", "?"),
            "state": {p: _describe(a) for p, a in copies.items()},
            "host_arrays": {k: _describe(a) for k, a in host_arrays.items()},
        }
        stored_state = {p: a for p, a in copies.items() if a.size}
        with _quiet():
            for step in steps:
                if step > round:
                    self._manager.delete(step)
        ocp = self._ocp
        items = {"meta": ocp.args.JsonSave(meta), "host": ocp.args.JsonSave(host_json)}
        if stored_state:
            items["state"] = ocp.args.StandardSave(_nest(stored_state))
        if host_arrays:
            items["host_arrays"] = ocp.args.StandardSave(host_arrays)
        os.makedirs(self.directory, exist_ok=True)
        with _quiet():
            self._manager.save(round, args=ocp.args.Composite(**items), force=True)
        self.last_save_s = time.perf_counter() - start

    def wait(self) -> None:
        """Wait until the last save is written (and re-raise its error, if any)."""
        with _quiet():
            self._manager.wait_until_finished()

    def close(self) -> None:
        with _quiet():
            self._manager.wait_until_finished()
            self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading

    def rounds(self) -> List[int]:
        """The rounds of the complete (finalised) checkpoints, oldest first; not verified."""
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_round(self) -> Optional[int]:
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def clear(self) -> None:
        """Delete every checkpoint (a fresh start, e.g. ``--overwrite``)."""
        self.wait()
        with _quiet():
            for step in self.rounds():
                self._manager.delete(step)

    def _restore_items(self, step: int, items: Dict[str, Any]):
        with _quiet():
            return self._manager.restore(step, args=self._ocp.args.Composite(**items))

    def _read_meta(self, step: int) -> Dict[str, Any]:
        meta = self._restore_items(step, {"meta": self._ocp.args.JsonRestore()})["meta"]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"unknown format {meta.get('format') if isinstance(meta, dict) else meta!r}")
        return meta

    def read_fingerprint(self) -> Optional[Tuple[int, Dict[str, Any]]]:
        """(round, fingerprint) of the newest checkpoint whose metadata reads, without reading
        its arrays (a quick configuration check before building anything); None if none."""
        for step in reversed(self.rounds()):
            try:
                meta = self._read_meta(step)
            except Exception:  # pylint: disable=broad-except
                continue
            return int(meta["round"]), meta["fingerprint"]
        return None

    def restore(self, template_state) -> Optional[Restored]:
        """The newest complete, intact checkpoint, or None when there is none.

        template_state: a ServerState of this run (arrays or jax.ShapeDtypeStruct leaves): its
          structure, shapes and dtypes must match the saved state, else CheckpointMismatch.
          Each restored leaf is placed like the template's leaf (its sharding), or stays a
          NumPy array when the template's leaf is one.

        A checkpoint that cannot be read or fails its sha256 check is reported in one warning
        line, deleted, and the previous one is tried.
        """
        self.wait()
        rounds = self.rounds()
        damaged: List[int] = []
        result = None
        for i, step in enumerate(reversed(rounds)):
            try:
                result = self._restore_step(step, template_state)
                break
            except CheckpointMismatch:
                raise
            except Exception as err:  # pylint: disable=broad-except
                _muffle_read_failure_noise()
                older = rounds[len(rounds) - 2 - i] if i + 1 < len(rounds) else None
                reason = " ".join(f"{type(err).__name__}: {err}".split())
                reason = reason if len(reason) <= 120 else reason[:119] + "…"
                then = (f"falling back to round {older}" if older is not None
                        else "no older checkpoint")
                _warn(f"checkpoint of round {step} in {self.directory} is damaged "
                      f"({reason}); deleting it, {then}")
                damaged.append(step)
        for step in damaged:
            try:
                with _quiet():
                    self._manager.delete(step)
            except Exception:  # pylint: disable=broad-except
                shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)
        return result

    def _restore_step(self, step: int, template_state) -> Restored:
        ocp = self._ocp
        meta = self._read_meta(step)
        paths, leaves, treedef = _leaf_paths(template_state)
        saved = meta["state"]
        missing = [p for p in paths if p not in saved]
        extra = [p for p in saved if p not in paths]
        if missing or extra:
            raise CheckpointMismatch(
                f"the checkpoint of round {step} holds other state leaves than this run "
                f"(missing: {missing[:3]}, unexpected: {extra[:3]})")
        for path, leaf in zip(paths, leaves):
            want = (np.dtype(leaf.dtype).str, list(np.shape(leaf)))
            have = (saved[path]["dtype"], list(saved[path]["shape"]))
            if want != have:
                raise CheckpointMismatch(
                    f"the checkpoint of round {step} holds state leaf {path} as "
                    f"{have[0]}{tuple(have[1])}; this run's is {want[0]}{tuple(want[1])}")

        def empty(info):
            return np.empty(info["shape"], dtype=np.dtype(info["dtype"]))

        stored = {p: empty(info) for p, info in saved.items() if int(np.prod(info["shape"]))}
        host_info = meta["host_arrays"]
        items = {"host": ocp.args.JsonRestore()}
        if stored:
            items["state"] = ocp.args.StandardRestore(_nest(stored))
        if host_info:
            items["host_arrays"] = ocp.args.StandardRestore(
                {k: empty(info) for k, info in host_info.items()})
        restored = self._restore_items(step, items)

        def check(name: str, array, info) -> np.ndarray:
            array = np.asarray(array)
            if (array.dtype.str, list(array.shape)) != (info["dtype"], list(info["shape"])):
                raise CheckpointError(f"{name} reads back as {array.dtype}{array.shape}")
            if _sha256(array) != info["sha256"]:
                raise CheckpointError(f"{name} fails its sha256 check")
            return array

        flat = _unnest(restored["state"], {}) if stored else {}
        state_leaves = []
        for path, leaf in zip(paths, leaves):
            info = saved[path]
            array = check(path, flat[path], info) if path in stored else empty(info)
            state_leaves.append(_place(array, leaf))
        host_arrays = {k: check(f"host array {k}", restored["host_arrays"][k], info)
                       for k, info in host_info.items()}
        host = _decode(restored["host"], host_arrays)
        return Restored(round=int(meta["round"]),
                        state=jax.tree_util.tree_unflatten(treedef, state_leaves),
                        host=host, fingerprint=meta["fingerprint"],
                        jax_version=str(meta["jax_version"]))


def _place(array: np.ndarray, like):
    """`array` placed like the template leaf `like`: NumPy stays NumPy; a jax.Array or a
    ShapeDtypeStruct with a sharding gets that sharding; anything else the default device."""
    if isinstance(like, np.ndarray):
        return array
    sharding = getattr(like, "sharding", None)
    if sharding is not None:
        return jax.device_put(array, sharding)
    return jax.device_put(array)


# ----------------------------------------------------------------------------- the callback


class CheckpointCallback(Callback):
    """Saves `run.state` with the host histories and the fingerprint during a run.

    A checkpoint is saved after round r when any of these holds:
      - `every` > 0 and r is a multiple of `every`;
      - `every_s` > 0 and at least `every_s` seconds have passed since the last save ended
        (or since the run started);
      - a stop is requested (``run.stop_requested``: SIGTERM/SIGINT, divergence): the save is
        then waited for, so the process may exit right after the round;
      - at the end of the run (:meth:`on_run_end`), when the last round is not saved yet.

    Args:
      checkpointer: where to save.
      host_state: returns the host-side histories to save (the loop's recorder), as they are
        after round r (including the evaluation of round r, see `evaluated`).
      fingerprint: the settings and data hash a resume must match.
      every: rounds between checkpoints (0: not by rounds).
      every_s: seconds between checkpoints (0: not by time). Recommended default 120 s (see
        :data:`DEFAULT_CHECKPOINT_EVERY_S`).
      evaluated: `evaluated(r)` is True when the loop evaluates after round r and calls
        on_evaluation AFTER on_round_end(r); the save of such a round then waits for
        on_evaluation so the checkpoint holds its evaluation. None: the loop calls
        on_evaluation before on_round_end (or host_state() already has it).
    """

    def __init__(self, checkpointer: Checkpointer, host_state: Callable[[], Mapping[str, Any]],
                 fingerprint: Mapping[str, Any], every: int = DEFAULT_CHECKPOINT_EVERY,
                 every_s: float = DEFAULT_CHECKPOINT_EVERY_S,
                 evaluated: Optional[Callable[[int], bool]] = None):
        self.checkpointer = checkpointer
        self.host_state = host_state
        self.fingerprint = dict(fingerprint)
        self.every = int(every or 0)
        self.every_s = float(every_s or 0.0)
        self.evaluated = evaluated
        self.saved_round: Optional[int] = None
        self._last_round: Optional[int] = None
        self._pending: Optional[int] = None
        self._since = time.monotonic()

    def on_run_start(self, run: RunContext) -> None:
        self._since = time.monotonic()
        self.saved_round = run.start_round if run.start_round else None
        self._last_round = run.start_round or None

    def _due(self, run: RunContext, round: int) -> bool:
        return bool(run.stop_requested
                    or (self.every and round % self.every == 0)
                    or (self.every_s and time.monotonic() - self._since >= self.every_s))

    def _save(self, run: RunContext, round: int) -> None:
        self.checkpointer.save(round, run.state, self.host_state(), self.fingerprint)
        if run.stop_requested:
            self.checkpointer.wait()
        self.saved_round = round
        self._since = time.monotonic()

    def on_round_end(self, run: RunContext, round: int, metrics) -> None:
        self._last_round = round
        if not self._due(run, round):
            return
        if self.evaluated is not None and self.evaluated(round):
            self._pending = round
        else:
            self._save(run, round)

    def on_evaluation(self, run: RunContext, evaluation) -> None:
        if self._pending is not None and self._pending == evaluation.round:
            self._pending = None
            self._save(run, evaluation.round)

    def on_run_end(self, run: RunContext, result) -> None:
        last = self._last_round
        if last is not None and self.saved_round != last and run.state is not None:
            self._pending = None
            self.checkpointer.save(last, run.state, self.host_state(), self.fingerprint)
            self.saved_round = last
        self.checkpointer.wait()
