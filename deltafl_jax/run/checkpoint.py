"""Checkpoints of a run's state, with orbax-checkpoint.

A checkpoint is one orbax step directory ``<output_dir>/checkpoints/<round>/`` with two items,
saved by one :class:`orbax.checkpoint.CheckpointManager` composite save:

- ``state``: the :class:`deltafl_jax.rounds.ServerState` pytree as it is (params, algorithm
  state, round, active flags, the server optimizer's state, the per-client state), its leaves
  copied to host NumPy arrays; orbax's standard (PyTree/OCDBT) handler. Zero-size leaves are
  saved as None (orbax stores no zero-size array) and rebuilt from the template.
- ``meta``: JSON: the round, the configuration fingerprint, the jax and orbax versions, and the
  dtype, shape and sha256 of every state leaf (so a restore is checked bit for bit);
- ``host`` (when the run gives one): the host's own state after the round, a nested dict of
  NumPy arrays: the participation counts and a stateful availability model's state
  (:class:`deltafl_jax.run.planning.Participation`), its leaves listed in ``meta``
  (``host``) as the state's are; zero-size leaves are not stored and are rebuilt from there.

The recorder's histories are not in the checkpoint: the output files hold them
(:mod:`deltafl_jax.run.resume` reads them back). PRNG keys are not saved: the run re-derives
them from its seeds.

Atomicity. orbax writes a step into ``<round>.orbax-checkpoint-tmp-<time>/`` and renames it to
``<round>/`` once every item is written; such tmp steps are never listed, so a save killed
midway (even SIGKILL) is never loaded, and the manager deletes them when it saves next. Old
steps are deleted only after the new one is finalised; ``keep`` (2) steps are kept.

Corruption. :meth:`Checkpointer.restore` reads the newest step; if it cannot be read, or a leaf
differs from its recorded sha256, it says so in one line on stderr, moves it aside to
``checkpoints/damaged-<round>/`` (never listed as a step, kept for a post-mortem; removed with
the rest by ``--overwrite``) and falls back to the previous one. orbax's own log lines about the
damaged files are silenced while steps are listed and read, so that the one line is all the
user sees.

Layout independence. Leaves are saved as host NumPy arrays (a replicated global array of a
multi-process run: this process's copy), so no device or sharding is recorded; a restore places
each leaf like the template's (its sharding, for any device or process count).

Several processes. Every process calls save and restore (orbax's collective protocol: process 0
writes the replicated arrays and finalises the step, the others wait at its barriers); the
directory must be one that every process sees (the same path on a shared filesystem).

Asynchronous saving, and donated buffers. :meth:`Checkpointer.save` copies every state leaf into
a fresh NumPy array (``np.array(leaf, copy=True)``), hashes it, and hands the copies to orbax,
which writes them in a background thread: nothing orbax holds refers to a device buffer, so the
next round may donate the state's buffers at once (orbax's own transfer keeps a zero-copy view
on CPU, which makes JAX decline the donation). The blocking part of a save is the copy and the
sha256 (about 1.4 GB/s here). ``async_save=False`` writes synchronously. A save waits for the
previous one; :meth:`Checkpointer.wait` waits for the last.

Preemption (:class:`Preemption`): SIGTERM and SIGINT end a run cleanly after the current
round, with a checkpoint.

    with Preemption() as preemption:
        result = run_rounds(..., callbacks=[preemption, recorder, checkpoints, ...])
    if preemption.signum is not None:
        print(preemption.resume_hint(command, checkpoint_directory), file=sys.stderr)
        sys.exit(preemption.exit_code)

While installed, the handlers only set ``run.stop_requested = True`` and ``run.stop_reason``
("SIGTERM" / "SIGINT") on the :class:`~deltafl_jax.run.callbacks.RunContext`, and write one line
on stderr. The loop finishes the round it is in, the checkpoint callback saves (and waits for
the write), and the caller prints how to resume and exits non-zero (128 + the signal number:
143 for SIGTERM, 130 for SIGINT). A second SIGINT while stopping raises KeyboardInterrupt (a
user who insists); a second SIGTERM is ignored. A signal that arrives before the run starts is
kept and applied at :meth:`on_run_start`. The previous handlers are restored on exit (and at
:meth:`on_run_end` when used only as a callback). Signal handlers can only be installed from the
main thread; elsewhere this does nothing.

``defer=True`` (runs of several processes, which must all stop after the same round): the
handler only records the signal, and :meth:`on_round_end` requests the stop, at a point of the
round where the checkpoint callback (after this one) makes every process agree on it.

The handler runs in the main thread between two bytecodes, possibly in the middle of a round's
host code; it touches nothing but two attributes and writes its line with ``os.write``, which
is safe there (``print`` could re-enter a stream that is being written).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from deltafl_jax.errors import CheckpointError, CheckpointMismatch
from deltafl_jax.run.callbacks import Callback, RunContext

CHECKPOINT_DIR = "checkpoints"
FORMAT = 2   # 1: the state with the recorder's histories JSON-encoded beside it
DEFAULT_KEEP = 2
# Recommended defaults of the run's checkpoint flags; see CheckpointCallback.
DEFAULT_CHECKPOINT_EVERY = 0
DEFAULT_CHECKPOINT_EVERY_S = 120.0
FIRST_CHECKPOINT_S = 10.0   # the first timed checkpoint comes this early (a short run killed)


def checkpoint_dir(output_dir: str) -> str:
    """Where a run's checkpoints live: ``<output_dir>/checkpoints``."""
    return os.path.join(output_dir, CHECKPOINT_DIR)


DAMAGED_PREFIX = "damaged-"   # a damaged step is moved aside to checkpoints/damaged-<round>


@contextlib.contextmanager
def _quiet(level: int = logging.ERROR):
    """orbax logs through absl at WARNING level ("Waiting for previous save to complete took
    ..."), which would reach the command line's stderr; keep only its errors (`level`: keep
    only what is at least this; :func:`_silent` for reads)."""
    logger = logging.getLogger("absl")
    before = logger.level
    logger.setLevel(max(before, level))
    try:
        yield
    finally:
        logger.setLevel(before)


def _silent():
    """orbax's logging silenced while steps are listed and read: a damaged step makes it log
    errors ("Failed to read Metadata file ...", one per thread) that restore reports itself in
    one line."""
    return _quiet(logging.CRITICAL + 1)


def _muffle_read_failure_noise() -> None:
    """After a damaged checkpoint's read fails, tensorstore completes the other reads of that
    restore on a closed asyncio loop: each prints "RuntimeError: Event loop is closed" (an
    unraisable exception) and asyncio logs "Task exception was never retrieved", long after our
    one warning line. Drop exactly those messages, from now on (they may come late)."""
    if getattr(_muffle_read_failure_noise, "done", False):
        return
    _muffle_read_failure_noise.done = True
    previous = sys.unraisablehook

    def hook(unraisable):
        exc = unraisable.exc_value
        if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
            previous(unraisable)

    def keep(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage().startswith("Task exception was never retrieved")
                    and isinstance(exc, ValueError)
                    and any(w in str(exc) for w in ("OCDBT", "zarr", "tensorstore")))

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(keep)


def _warn(message: str) -> None:
    print(f"deltafl_jax: warning: {message}", file=sys.stderr, flush=True)


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).data).hexdigest()


def leaf_paths(tree) -> List[str]:
    """"params/Dense_0/kernel", ... : the names of `tree`'s leaves, in leaf order."""
    def part(key) -> str:
        return str(next((getattr(key, a) for a in ("key", "name", "idx") if hasattr(key, a)),
                        key))
    return ["/".join(part(k) for k in path) or "_"
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _host_copy(leaf) -> np.ndarray:
    """A fresh host array holding `leaf` (never a view of a device buffer); a replicated
    global array of several processes gives this process's copy."""
    if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise TypeError("PRNG keys are not checkpointed (they are re-derived from the seeds); "
                        "keep them out of the saved state")
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        leaf = leaf.addressable_data(0)
    return np.array(leaf, copy=True)


def _place(array: np.ndarray, like):
    """`array` placed like the template leaf `like`: NumPy stays NumPy; a jax.Array or a
    ShapeDtypeStruct with a sharding gets that sharding (any process count); anything else
    the default device."""
    if isinstance(like, np.ndarray):
        return array
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jax.device_put(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


class Checkpointer:
    """The checkpoints of one run, in `directory` (``<output_dir>/checkpoints``).

    Args:
      directory: the checkpoint directory (created on the first save); with several
        processes, one directory that every process sees.
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
        with _silent():   # it lists the steps, reading their metadata
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.last_save_s: Optional[float] = None  # blocking seconds of the last save

    # -- saving

    def save(self, round: int, state, fingerprint: Mapping[str, Any],
             host: Optional[Mapping[str, Any]] = None) -> None:
        """Save checkpoint `round` (rounds completed) of `state`, the ServerState pytree
        (device or host arrays; copied before this returns, so the caller may donate its
        buffers at once), with `fingerprint`, the JSON-able settings a resume must match, and
        `host`, the host's state after the round (a nested dict of arrays; None: none).

        A checkpoint already saved for `round` is kept as it is; any for later rounds (left
        from an earlier life of this directory) are deleted first, so the newest checkpoint
        is always this run's.
        """
        start, round = time.perf_counter(), int(round)
        saved_round = getattr(state, "round", None)
        if saved_round is not None and np.ndim(saved_round) == 0 and int(
                _host_copy(saved_round)) != round:
            raise ValueError(f"checkpoint for round {round} of a state at round "
                             f"{int(_host_copy(saved_round))}")
        with _quiet():
            self._manager.wait_until_finished()  # the previous save (and its error, if any)
        with _silent():
            self._manager.reload()
            steps = self._manager.all_steps()
            if round in steps:
                return
            for step in steps:
                if step > round:
                    self._manager.delete(step)
        copies = jax.tree.map(_host_copy, state)
        leaves = jax.tree.leaves(copies)
        meta = {"format": FORMAT, "round": round, "fingerprint": dict(fingerprint),
                "jax_version": jax.__version__,
                "orbax_version": getattr(self._ocp, "__version__", "?"),
                "state": {p: {"dtype": a.dtype.str, "shape": list(a.shape), "sha256": _sha256(a)}
                          for p, a in zip(leaf_paths(copies), leaves)}}
        stored = jax.tree.map(lambda a: a if a.size else None, copies)
        items = {}
        if jax.tree.leaves(stored):
            items["state"] = self._ocp.args.StandardSave(stored)
        if host is not None:
            host_copies = jax.tree.map(lambda a: np.array(a, copy=True), dict(host))
            meta["host"] = {p: {"dtype": a.dtype.str, "shape": list(a.shape),
                                "sha256": _sha256(a)}
                            for p, a in zip(leaf_paths(host_copies),
                                            jax.tree.leaves(host_copies))}
            host_stored = jax.tree.map(lambda a: a if a.size else None, host_copies)
            if jax.tree.leaves(host_stored):
                items["host"] = self._ocp.args.StandardSave(host_stored)
        items["meta"] = self._ocp.args.JsonSave(meta)
        os.makedirs(self.directory, exist_ok=True)
        with _quiet():
            self._manager.save(round, args=self._ocp.args.Composite(**items), force=True)
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
        with _silent():
            self._manager.reload()
            return sorted(int(s) for s in self._manager.all_steps())

    def latest_round(self) -> Optional[int]:
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def _restore_items(self, step: int, items: Dict[str, Any]):
        with _silent():
            return self._manager.restore(step, args=self._ocp.args.Composite(**items))

    def _read_meta(self, step: int) -> Dict[str, Any]:
        meta = self._restore_items(step, {"meta": self._ocp.args.JsonRestore()})["meta"]
        if not isinstance(meta, dict) or "format" not in meta:
            raise CheckpointError(f"its metadata is not a checkpoint's: {str(meta)[:60]}")
        if meta["format"] != FORMAT:
            raise CheckpointMismatch(
                f"the checkpoint of round {step} has format {meta['format']} (this deltafl_jax "
                f"reads format {FORMAT})")
        return meta

    def read_fingerprint(self) -> Optional[Tuple[int, Dict[str, Any]]]:
        """(round, fingerprint) of the newest checkpoint whose metadata reads, without reading
        its arrays (a quick configuration check before building anything); None if none."""
        for step in reversed(self.rounds()):
            try:
                meta = self._read_meta(step)
            except CheckpointMismatch:
                raise
            except Exception:  # pylint: disable=broad-except
                continue
            return int(meta["round"]), meta["fingerprint"]
        return None

    def restore_host(self, step: int) -> Optional[Dict[str, Any]]:
        """The host state saved with checkpoint `step` (a nested dict of NumPy arrays), or None
        when it has none. CheckpointError when a leaf fails its sha256 check."""
        saved = self._read_meta(step).get("host")
        if saved is None:
            return None
        host: Dict[str, Any] = {}
        if any(int(np.prod(v["shape"])) for v in saved.values()):
            host = self._restore_items(step, {"host": self._ocp.args.StandardRestore()})["host"]
        out: Dict[str, Any] = {}
        for path, want in saved.items():
            node, parts = host, path.split("/")
            for part in parts:
                node = node.get(part) if isinstance(node, dict) else None
            array = (np.asarray(node) if node is not None else
                     np.empty(want["shape"], np.dtype(want["dtype"])))
            if (array.dtype.str, list(array.shape)) != (want["dtype"], want["shape"]) or \
                    _sha256(array) != want["sha256"]:
                raise CheckpointError(f"host state {path} fails its check")
            where = out
            for part in parts[:-1]:
                where = where.setdefault(part, {})
            where[parts[-1]] = array
        return out

    def restore(self, template_state) -> Optional[Tuple[int, Any]]:
        """(round, state) of the newest complete, intact checkpoint, or None when there is none.

        template_state: a ServerState of this run (arrays or jax.ShapeDtypeStruct leaves): its
          leaves, shapes and dtypes must match the saved state, else CheckpointMismatch. Each
          restored leaf is placed like the template's leaf (its sharding), or stays a NumPy
          array when the template's leaf is one.

        A checkpoint that cannot be read or fails its sha256 check is reported in one warning
        line, moved aside (``damaged-<round>``, the line says where), and the previous one is
        tried.
        """
        self.wait()
        rounds = self.rounds()
        for i, step in enumerate(reversed(rounds)):
            try:
                return step, self._restore_step(step, template_state)
            except CheckpointMismatch:
                raise
            except Exception as err:  # pylint: disable=broad-except
                _muffle_read_failure_noise()
                older = rounds[-2 - i] if i + 1 < len(rounds) else None
                reason = " ".join(f"{type(err).__name__}: {err}".split())
                reason = reason if len(reason) <= 120 else reason[:119] + "…"
                then = (f"falling back to round {older}" if older is not None
                        else "no older checkpoint")
                aside = self._set_aside(step)
                where = f"moved to {aside}" if aside else "it could not be moved aside"
                _warn(f"checkpoint of round {step} in {self.directory} is damaged "
                      f"({reason}); {where}, {then}")
        return None

    def _set_aside(self, step: int) -> Optional[str]:
        """Move the damaged step to ``damaged-<step>`` (``-2``, ``-3``, ... when taken) beside
        the steps, where orbax lists no step; the new path, or None when it cannot be moved
        (another process of the run moved it first, or the folder is read-only)."""
        source = os.path.join(self.directory, str(step))
        for n in range(1, 1000):
            target = os.path.join(self.directory,
                                  f"{DAMAGED_PREFIX}{step}" + (f"-{n}" if n > 1 else ""))
            if os.path.lexists(target):
                continue
            try:
                os.rename(source, target)
            except OSError:
                return None
            with _silent():
                self._manager.reload()
            return target
        return None

    def _restore_step(self, step: int, template_state):
        meta = self._read_meta(step)
        paths, treedef = leaf_paths(template_state), jax.tree.structure(template_state)
        leaves, saved = jax.tree.leaves(template_state), meta["state"]
        if set(saved) != set(paths):
            missing = [p for p in paths if p not in saved]
            extra = [p for p in saved if p not in paths]
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
        template = [np.empty(np.shape(x), np.dtype(x.dtype)) for x in leaves]
        stored = jax.tree.unflatten(treedef, [a if a.size else None for a in template])
        arrays = template
        if jax.tree.leaves(stored):
            restored = self._restore_items(
                step, {"state": self._ocp.args.StandardRestore(stored)})["state"]
            arrays = [r if a.size else a for a, r in
                      zip(template, treedef.flatten_up_to(restored))]
        for path, array in zip(paths, arrays):
            array = np.asarray(array)
            if (array.dtype.str, list(array.shape)) != (saved[path]["dtype"],
                                                        saved[path]["shape"]):
                raise CheckpointError(f"{path} reads back as {array.dtype}{array.shape}")
            if _sha256(array) != saved[path]["sha256"]:
                raise CheckpointError(f"{path} fails its sha256 check")
        return jax.tree.unflatten(treedef, [_place(np.asarray(a), leaf)
                                            for a, leaf in zip(arrays, leaves)])


class CheckpointCallback(Callback):
    """Saves `run.state` with the fingerprint during a run.

    A checkpoint is saved after round r when any of these holds:
      - `every` > 0 and r is a multiple of `every`;
      - `every_s` > 0 and at least `every_s` seconds have passed since the last save ended;
        the first one min(`every_s`, :data:`FIRST_CHECKPOINT_S`) after the first round (which
        includes the compilation) ended, so that a run killed early can resume too;
      - a stop is requested (``run.stop_requested``: SIGTERM/SIGINT, divergence): the save is
        then waited for, so the process may exit right after the round;
      - at the end of the run (:meth:`on_run_end`), when the last round is not saved yet.

    Args:
      checkpointer: where to save.
      fingerprint: the settings and data hash a resume must match.
      every: rounds between checkpoints (0: not by rounds).
      every_s: seconds between checkpoints (0: not by time).
      evaluated: `evaluated(r)` is True when the loop evaluates after round r and calls
        on_evaluation AFTER on_round_end(r); the save of such a round then waits for
        on_evaluation. None: the loop calls on_evaluation before on_round_end.
      before_save: `before_save(r)` runs before each save of round r (the runner writes the
        histories to the output files there, so that they are never behind a checkpoint).
      agree: `agree([due, stop])` gives the flags every process agrees on (any of them) in a
        run of several processes, whose saves are collective; None: one process.
      host: `host()` gives the host's state to save with the round's (the participation
        record, :meth:`Checkpointer.save`); None: none.
    """

    def __init__(self, checkpointer: Checkpointer, fingerprint: Mapping[str, Any],
                 every: int = DEFAULT_CHECKPOINT_EVERY,
                 every_s: float = DEFAULT_CHECKPOINT_EVERY_S,
                 evaluated: Optional[Callable[[int], bool]] = None,
                 before_save: Optional[Callable[[int], None]] = None,
                 agree: Optional[Callable[[List[bool]], List[bool]]] = None,
                 host: Optional[Callable[[], Mapping[str, Any]]] = None):
        self.host = host
        self.checkpointer = checkpointer
        self.fingerprint = dict(fingerprint)
        self.every = int(every or 0)
        self.every_s = float(every_s or 0.0)
        self.evaluated = evaluated
        self.before_save = before_save
        self.agree = agree
        self.saved_round: Optional[int] = None
        self._last_round: Optional[int] = None
        self._pending: Optional[int] = None
        self._since = time.monotonic()
        self._interval = min(self.every_s, FIRST_CHECKPOINT_S)

    def on_run_start(self, run: RunContext) -> None:
        self._since = None   # set when the first round ends
        self.saved_round = run.start_round if run.start_round else None
        self._last_round = run.start_round or None

    def _due(self, run: RunContext, round: int) -> bool:
        now = time.monotonic()
        self._since = now if self._since is None else self._since
        due = bool((self.every and round % self.every == 0)
                   or (self.every_s and now - self._since >= self._interval))
        if self.agree is not None:   # the same decision on every process
            due, stop = self.agree([due, run.stop_requested])
            if stop and not run.stop_requested:
                run.stop_requested, run.stop_reason = True, "a stop on another process"
        return due or run.stop_requested

    def _save(self, run: RunContext, round: int) -> None:
        if self.before_save is not None:
            self.before_save(round)
        self.checkpointer.save(round, run.state, self.fingerprint,
                               host=self.host() if self.host is not None else None)
        if run.stop_requested:
            self.checkpointer.wait()
        self.saved_round = round
        self._since = time.monotonic()
        self._interval = self.every_s

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
            self._save(run, last)
        self.checkpointer.wait()


# --------------------------------------------------------------------------------------------
# Preemption

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption(Callback):
    """Turns SIGTERM/SIGINT into ``run.stop_requested``; a context manager and a Callback.

    Attributes:
      signum: the first signal received (None: none).
      run: the RunContext it stops (set by :meth:`on_run_start`, or given).
    """

    def __init__(self, run: Optional[RunContext] = None, signals: Sequence[int] = SIGNALS,
                 defer: bool = False):
        self.run = run
        self.signals = tuple(signals)
        self.defer = defer
        self.signum: Optional[int] = None
        self._previous = {}
        self._installed = False

    # -- installing

    def install(self) -> "Preemption":
        if self._installed or threading.current_thread() is not threading.main_thread():
            return self
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._installed = True
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        self._installed = False

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- the handler

    @property
    def reason(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal number (the shell's convention), 0 when no signal came."""
        return 128 + int(self.signum) if self.signum is not None else 0

    def _handle(self, signum, frame) -> None:
        del frame
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if not self.defer:
            self._request(self.run)
        name = signal.Signals(signum).name
        more = " (Ctrl-C again to abort at once)" if signal.SIGINT in self.signals else ""
        line = (f"deltafl_jax: {name} received: finishing this round, saving a checkpoint, "
                f"then stopping{more}\n")
        try:
            os.write(2, line.encode("utf-8", "replace"))
        except OSError:
            pass

    def _request(self, run: Optional[RunContext]) -> None:
        if run is not None and self.signum is not None:
            run.stop_requested = True
            run.stop_reason = self.reason

    # -- the callback

    def on_run_start(self, run: RunContext) -> None:
        self.run = run
        self.install()
        self._request(run)

    def on_round_end(self, run: RunContext, round: int, metrics) -> None:
        self._request(run)

    def on_run_end(self, run: RunContext, result) -> None:
        self.uninstall()

    # -- what to tell the user

    def resume_hint(self, command: Sequence[str], checkpoint_directory: str,
                    round: Optional[int] = None) -> str:
        """One line: why the run stopped, where its checkpoint is, and the command to resume."""
        after = f" after round {round}" if round is not None else ""
        return (f"deltafl_jax: stopped by {self.reason or 'request'}{after}; checkpoint in "
                f"{checkpoint_directory}; resume with: {shlex.join(list(command))}")
