"""Every file of an output directory: what a run writes (:class:`RunWriter`) and how to read
it back (:class:`RunReader`). No other module opens these files; serving a saved model
(:func:`deltafl_jax.outputs.serving.load_model`) reads them through :class:`RunReader`.

- ``metrics.jsonl``: one JSON object per evaluation and per replica (theta or swept value,
  seed): the round, the alpha-weighted train-loss mean and percentiles, the unweighted
  test-error mean and percentiles, the test-loss mean, the clients kept (num_selected) and
  the rejected (NaN/Inf) updates of that round. Append-only.
- ``rounds.npz``: per-round arrays [num_rounds, R] (num_selected, num_rejected,
  sampled_loss_mean, learning_rate, ...) and the replica keys.
- ``clients.npz``: the final per-client arrays [R, N] (train loss, train error, test loss,
  test error) with the clients' sizes and ids, for re-plotting.
- ``clients_history.npz``: the same per-client arrays at every evaluation, float32
  [E, R, N], with ``rounds`` [E], so that any percentile convention can be recomputed.
- ``summary.json``: the output format's ``schema_version``, the configuration, the dataset's
  Table 1 row, the timings, the replicas' labels and the final metrics of every replica. It is
  written last: a directory without it holds a run in progress (or stopped).
- ``models/``: the final model of every replica and what is needed to rebuild the network;
  ``deltafl_jax.load_model(output_dir, theta=0.5, seed=1)`` serves w_theta (the paper's
  Figure 1: a user picks a conformity level and gets its model).
- ``partition.npz`` (:data:`PARTITION`): only when ``--partition`` split the data into clients:
  each train and test client's example indices in its source split, the partitioner's
  settings and, for labelled data, each client's examples per class
  (``train_label_histogram``, ``test_label_histogram`` [K, C]; :mod:`deltafl_jax.datasets.partition`).
- ``deltafl_run.json`` (:data:`MARKER`): written first, when the run starts: this package's
  mark (``written_by``, the output format) and the run's settings (the configuration without
  the settings that change no result), so that a stopped run is recognised as one of the same
  configuration before anything is loaded.

- ``deltafl.lock`` (:data:`LOCK`): the lock of the process writing the directory
  (:mod:`deltafl_jax.run.lock`); removed when it ends, left (unlocked, harmless) by one that
  was killed.

What a run directory is (:func:`inspect_dir`). A directory is **a run of this package** when
every entry in it is one that a run writes (the names above, ``tb/``, ``checkpoints/``, and
their ``NAME.tmp`` leftovers) and this package wrote it: it carries the marker (``written_by``
``deltafl_jax``), or, for a run written before the marker existed (:func:`pre_marker_run`), one
of this package's own files: a checkpoint (``checkpoints/<round>/meta/metadata``, JSON with the
checkpoint's ``format`` and the configuration's ``fingerprint``), a summary.json with the run's
``config`` (naming ``num_rounds``), ``replicas`` and ``final`` metrics, or a metrics.jsonl whose
first record holds ``round``, ``num_selected``, ``num_rejected`` and ``elapsed_s``. A folder
holding a summary.json or a metrics.jsonl of someone else's is not a run. Anything else that is
not empty (a source folder, the parent of runs, a folder holding other files) is not, and the
runner never writes into it, ``--overwrite`` or not (:func:`deltafl_jax.run.check_output_dir`).
It is decided from the directory's own entries (and, without the marker, the first line of those
files), never by walking below them. A folder inside a run (:func:`enclosing_run`) is no
command's output folder either: the run could no longer be continued there. The other
commands' output folders (a report's, a leaderboard's) follow the same rule with a marker of
their own (:func:`command_dir_state`, :func:`mark_command_dir`).

Every file but ``metrics.jsonl`` is written atomically (to ``NAME.tmp`` in the same directory,
then renamed), so a reader sees either the whole file or none. Replicas are named by
:class:`deltafl_jax.replicas.labels.ReplicaLabel`: ``key()`` in file names and npz ``replica_keys``,
``to_json()`` in ``metrics.jsonl``, ``summary.json`` and ``models/index.json``.

Output format versions (``schema_version`` in summary.json): 0 (no field) and 1 read alike;
a newer version raises :class:`RunFormatError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import zipfile
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.data import FederatedDataset
from deltafl_jax.errors import ConfigError, RunFormatError
from deltafl_jax.replicas.labels import ReplicaLabel

if TYPE_CHECKING:
    from deltafl_jax.models import Model, ModelOptions

# JAX and Flax are imported where models are saved or read, so that reading a run's metrics
# (the report, a command that checks a folder) does not import them.

SCHEMA_VERSION = 1

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
ROUNDS = "rounds.npz"
CLIENTS = "clients.npz"
CLIENTS_HISTORY = "clients_history.npz"
MODELS = "models"
MARKER = "deltafl_run.json"
PARTITION = "partition.npz"   # a partitioned dataset's clients (datasets.partition.Partition)
WRITTEN_BY = "deltafl_jax"
# Everything a run may leave in its directory (files and folders); --overwrite removes these.
RESULT_FILES = (METRICS, SUMMARY, ROUNDS, CLIENTS, CLIENTS_HISTORY, MODELS, "tb", "checkpoints",
                MARKER, PARTITION)
TMP_SUFFIX = ".tmp"
# The lock of the process writing the folder (deltafl_jax.run.lock); present only while it runs
# (or left by one that was killed), never a result: inspect_dir and --overwrite pass it by.
LOCK = "deltafl.lock"
# A run written before the marker existed is recognised by one of these (pre_marker_run).
LEGACY_EVIDENCE = (SUMMARY, METRICS, "checkpoints")
# The first record of a run's metrics.jsonl holds these (every version of this package).
_METRICS_FIELDS = ("round", "num_selected", "num_rejected", "elapsed_s")


# --------------------------------------------------------------------------------------------
# Writing


def _jsonable(value):
    if isinstance(value, ReplicaLabel):
        return value.to_json()
    if isinstance(value, (np.floating, float)):
        return float(value)
    if isinstance(value, (np.integer, int)):
        return int(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def metrics_records(t: int, labels: Sequence[Mapping[str, Any]],
                    summary: Mapping[str, np.ndarray], metrics: Mapping[str, np.ndarray],
                    elapsed: float) -> List[Dict[str, Any]]:
    """The metrics.jsonl records of the evaluation after round `t`, one per replica: the round,
    the replica's label (`labels`: each replica's as written, :meth:`ReplicaLabel.to_json`),
    its summary metrics, the clients kept and the updates rejected in the round (`metrics`'
    ``num_selected`` and ``num_rejected`` [R]) and the seconds elapsed."""
    records = []
    for r, label in enumerate(labels):
        rec = {"round": t, **label}
        rec.update({k: float(v[r]) for k, v in summary.items()})
        rec["num_selected"] = int(metrics["num_selected"][r])
        rec["num_rejected"] = int(metrics["num_rejected"][r])
        rec["elapsed_s"] = round(elapsed, 3)
        records.append(rec)
    return records


def _json_line(record: Mapping[str, Any]) -> str:
    return json.dumps(_jsonable(record)) + "\n"


@contextlib.contextmanager
def _atomic(path: str, mode: str = "w"):
    """Open ``path + '.tmp'`` for writing; on success it replaces `path` in one rename."""
    tmp = path + TMP_SUFFIX
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _write_json(path: str, obj) -> None:
    with _atomic(path) as f:
        json.dump(_jsonable(obj), f, indent=2, sort_keys=False)
        f.write("\n")


def _write_npz(path: str, arrays: Mapping[str, Any]) -> None:
    with _atomic(path, "wb") as f:
        np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})


def _label_json(label) -> Dict[str, Any]:
    return label.to_json() if isinstance(label, ReplicaLabel) else dict(label)


def _label_keys(labels) -> np.ndarray:
    return np.asarray([replica_key(lab) for lab in labels])


def has_results(output_dir: str) -> bool:
    """True when `output_dir` holds any file or folder that a run writes."""
    return os.path.isdir(output_dir) and any(
        os.path.lexists(os.path.join(output_dir, f)) for f in RESULT_FILES)


@dataclasses.dataclass(frozen=True)
class DirState:
    """What a would-be output directory holds (:func:`inspect_dir`).

    kind: "absent", "empty", "run" (a run of this package) or "other"; for a command's own
    folder (:func:`command_dir_state`), "mine" instead of "run".
    foreign: the entries a run does not write, sorted (folders end with "/"); for a folder of
    a run's file names that this package did not write (`unmarked`), all its entries.
    runs: the entries that are runs themselves (an "other" directory that holds runs).
    unmarked: every entry bears a name a run writes, but neither the marker nor a pre-marker
    run's own files say this package wrote them (:func:`pre_marker_run`).
    """

    kind: str
    foreign: Tuple[str, ...] = ()
    runs: Tuple[str, ...] = ()
    unmarked: bool = False


def _is_run_entry(name: str) -> bool:
    base = name[:-len(TMP_SUFFIX)] if name.endswith(TMP_SUFFIX) else name
    return base in RESULT_FILES


def _holds_marker(folder: str) -> bool:
    """Whether `folder` carries a run's marker (one stat; nothing below it is read)."""
    return os.path.isfile(os.path.join(folder, MARKER))


def _first_json(path: str, first_line: bool = False) -> Any:
    """The JSON of the file `path` (of its first line only, with `first_line`), or None when
    it is absent or does not parse; at most 1 MiB of a first line is read."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.loads(f.readline(1 << 20) if first_line else f.read())
    except (OSError, ValueError):
        return None


def _has_fields(value: Any, *fields: str) -> bool:
    return isinstance(value, dict) and all(k in value for k in fields)


def _checkpoint_of_ours(folder: str) -> bool:
    """Whether `folder`/checkpoints holds a checkpoint this package saved: a round's folder
    whose ``meta/metadata`` is JSON with the checkpoint's format and the configuration's
    fingerprint (:mod:`deltafl_jax.run.checkpoint`); one listing, one small file read."""
    try:
        steps = sorted((n for n in os.listdir(os.path.join(folder, "checkpoints"))
                        if n.isdigit()), key=int, reverse=True)
    except OSError:
        return False
    return bool(steps) and _has_fields(
        _first_json(os.path.join(folder, "checkpoints", steps[0], "meta", "metadata")),
        "format", "fingerprint")


def pre_marker_run(folder: str) -> bool:
    """Whether `folder`, which carries no marker, holds a run this package wrote before the
    marker existed (2026-11-25): its newest checkpoint is one of ours
    (``checkpoints/<round>/meta/metadata`` with ``format`` and ``fingerprint``), or its
    summary.json is a JSON object with the run's ``config`` (naming ``num_rounds``), its
    ``replicas`` and its ``final`` metrics, or the first record of its metrics.jsonl holds
    ``round``, ``num_selected``, ``num_rejected`` and ``elapsed_s`` (what every version of
    this package has written there). A user's own summary.json or metrics.jsonl is none of
    these. Reads at most one small file of each."""
    if _checkpoint_of_ours(folder):
        return True
    summary = _first_json(os.path.join(folder, SUMMARY))
    if _has_fields(summary, "config", "replicas", "final") and \
            _has_fields(summary["config"], "num_rounds"):
        return True
    return _has_fields(_first_json(os.path.join(folder, METRICS), first_line=True),
                       *_METRICS_FIELDS)


def written_by_us(folder: str) -> bool:
    """Whether this package wrote the run in `folder`: its marker is ours
    (``written_by``), or, without a marker, :func:`pre_marker_run`. Other entries beside the
    run's are not looked at (see :func:`inspect_dir`)."""
    if os.path.lexists(os.path.join(folder, MARKER)):
        return _marked_by(folder, MARKER)
    return any(os.path.lexists(os.path.join(folder, n)) for n in LEGACY_EVIDENCE) and \
        pre_marker_run(folder)


def inspect_dir(path: str) -> DirState:
    """Whether `path` is absent, empty, a run of this package, or something else (see the
    module docstring: every entry one a run writes, and written by this package: its marker,
    or a pre-marker run's own files, :func:`written_by_us`).

    Decided from the top level alone: one listing of `path`, one stat per entry (its
    subfolders' markers name the runs it holds) and, for a folder without the marker, the
    first line of its summary.json / metrics.jsonl / newest checkpoint's metadata, never a
    walk, so a large folder (``/usr``, ``/``) is answered at once. :data:`LOCK` is passed
    by."""
    if not os.path.lexists(path):
        return DirState("absent")
    if not os.path.isdir(path):
        return DirState("other", (os.path.basename(path),))
    with os.scandir(path) as it:
        entries = sorted((e for e in it if e.name != LOCK), key=lambda e: e.name)
    if not entries:
        return DirState("empty")
    names = [e.name for e in entries]
    foreign = tuple(e.name + ("/" if _is_dir(e) else "") for e in entries
                    if not _is_run_entry(e.name))
    if not foreign:
        if written_by_us(path):
            return DirState("run")
        shown = tuple(e.name + ("/" if _is_dir(e) else "") for e in entries)
        return DirState("other", shown, unmarked=True)
    runs = tuple(e.name + "/" for e in entries if not _is_run_entry(e.name)
                 and e.is_dir(follow_symlinks=False) and _holds_marker(e.path))
    return DirState("other", foreign, runs)


def enclosing_run(path: str) -> Optional[str]:
    """The run of this package (:func:`written_by_us`) that `path` is, or lies inside, the
    nearest first; None when neither `path` nor any folder above it is one. Symbolic links
    are resolved first; other entries beside a run's do not make it less of one (a folder
    already written into a run is still inside it)."""
    here = os.path.realpath(path)
    while True:
        if os.path.isdir(here) and written_by_us(here):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _marked_by(folder: str, marker: str) -> bool:
    """Whether `folder`/`marker` is this package's mark (JSON with ``written_by``)."""
    try:
        with open(os.path.join(folder, marker)) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("written_by") == WRITTEN_BY


def command_dir_state(path: str, marker: str,
                      legacy: Optional[Callable[[str, List[str]], bool]] = None) -> DirState:
    """Whether `path`, the output folder of a command other than a run (``experiments.report``
    --out, ``experiments.leaderboard`` --out), may be written by it: kind "absent", "empty",
    "mine" (it carries the command's `marker`, written by :func:`mark_command_dir`, or
    `legacy`(path, names) says the command wrote it before markers existed) or "other" (with
    its entries in ``foreign``). From the top level alone, as :func:`inspect_dir`."""
    if not os.path.lexists(path):
        return DirState("absent")
    if not os.path.isdir(path):
        return DirState("other", (os.path.basename(path),))
    names = sorted(n for n in os.listdir(path) if n != LOCK)
    if not names:
        return DirState("empty")
    if marker in names and _marked_by(path, marker):
        return DirState("mine")
    if legacy is not None and legacy(path, names):
        return DirState("mine")
    return DirState("other", tuple(n + ("/" if os.path.isdir(os.path.join(path, n)) else "")
                                   for n in names))


def mark_command_dir(path: str, marker: str, command: str) -> None:
    """Write `marker` (``{"written_by": "deltafl_jax", "command": command}``) into `path`,
    made if needed: the folder is the command's from now on (:func:`command_dir_state`)."""
    os.makedirs(path, exist_ok=True)
    with _atomic(os.path.join(path, marker)) as f:
        json.dump({"written_by": WRITTEN_BY, "command": command}, f, indent=2)
        f.write("\n")


def prepare_dir(path: str, overwrite: bool) -> None:
    """Make `path` ready for a new run.

    Raises ConfigError when it already holds results and `overwrite` is false. With
    `overwrite`, removes the result files and folders of :data:`RESULT_FILES` (and their
    leftover ``.tmp`` files), never anything else; then creates the directory.
    """
    if has_results(path) and not overwrite:
        raise ConfigError(f"--output_dir={path} already holds results; pass --overwrite or "
                          f"choose another directory")
    if os.path.isdir(path):
        for name in RESULT_FILES:
            for target in (os.path.join(path, name), os.path.join(path, name + TMP_SUFFIX)):
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                elif os.path.lexists(target):
                    os.remove(target)
    os.makedirs(path, exist_ok=True)


class RunWriter:
    """Writes the files of one output directory (see the module docstring).

    The run loop calls :meth:`append_metrics` at every evaluation and the other ``write_*``
    methods once at the end, :meth:`write_summary` last. Call :func:`prepare_dir` first.
    """

    def __init__(self, output_dir: str):
        self.output_dir = output_dir

    def path(self, name: str) -> str:
        return os.path.join(self.output_dir, name)

    def append_metrics(self, records: Sequence[Mapping[str, Any]]) -> None:
        """One JSON line per record, appended to metrics.jsonl and flushed."""
        with open(self.path(METRICS), "a") as f:
            f.write("".join(_json_line(r) for r in records))
            f.flush()

    def truncate_metrics(self, after_round: int) -> None:
        """Keep only the metrics.jsonl records with ``round <= after_round`` (resuming from a
        checkpoint of that round); a torn last line is dropped. Kept lines are unchanged."""
        path = self.path(METRICS)
        if not os.path.exists(path):
            return
        kept = [line for line, rec in _parse_jsonl(path, self.output_dir)
                if int(rec.get("round", 0)) <= after_round]
        with _atomic(path) as f:
            f.write("".join(line + "\n" for line in kept))

    def write_rounds(self, per_round: Mapping[str, np.ndarray],
                     labels: Sequence[ReplicaLabel]) -> None:
        """rounds.npz: the per-round arrays [T, R] and ``replica_keys`` [R]."""
        _write_npz(self.path(ROUNDS), {**per_round, "replica_keys": _label_keys(labels)})

    def write_clients(self, per_client: Mapping[str, np.ndarray], data: FederatedDataset,
                      labels: Sequence[ReplicaLabel]) -> None:
        """clients.npz: the final per-client arrays [R, N], the clients' sizes and ids (as
        strings) of both splits, and ``replica_keys`` [R]."""
        _write_npz(self.path(CLIENTS), {
            **per_client, "train_sizes": data.train.sizes, "test_sizes": data.test.sizes,
            "train_client_ids": np.asarray(data.train.client_ids).astype(str),
            "test_client_ids": np.asarray(data.test.client_ids).astype(str),
            "replica_keys": _label_keys(labels)})

    def write_partition(self, data: FederatedDataset) -> None:
        """partition.npz, when the data were partitioned: every train and test client's example
        indices in its source split and the partitioner's settings (``Partition.arrays``)."""
        if data.partition is not None:
            _write_npz(self.path(PARTITION), data.partition.arrays())

    def write_clients_history(self, history: Mapping[str, Any]) -> None:
        """clients_history.npz: ``rounds`` [E] and the per-client arrays [E, R, N]."""
        _write_npz(self.path(CLIENTS_HISTORY), history)

    def write_marker(self, settings: Mapping[str, Any]) -> None:
        """deltafl_run.json: this package's mark on the directory, the output format and the
        run's settings (written when the run starts, and again when it resumes)."""
        with _atomic(self.path(MARKER)) as f:   # plain JSON: booleans stay booleans
            json.dump({"written_by": WRITTEN_BY, "schema_version": SCHEMA_VERSION,
                       "settings": dict(settings)}, f, indent=2)
            f.write("\n")

    def remove_final_outputs(self) -> None:
        """Remove summary.json, clients.npz and models/: a finished run that is continued
        is a run in progress again until it writes them anew."""
        for name in (SUMMARY, CLIENTS, MODELS):
            target = self.path(name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            elif os.path.lexists(target):
                os.remove(target)

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """summary.json, with ``schema_version`` first; written last by a run."""
        _write_json(self.path(SUMMARY), {"schema_version": SCHEMA_VERSION, **summary})

    def save_models(self, params, labels: Sequence[ReplicaLabel], model: Model,
                    options: ModelOptions, data: FederatedDataset, personal=None) -> None:
        """models/: one msgpack file per replica (params [R, ...] on the leading axis), plus
        index.json, the model spec that :func:`deltafl_jax.outputs.serving.load_model` rebuilds the
        network from; with `personal` ([R, N, ...]: every training client's personal model),
        ``<key>.personal.msgpack`` per replica too ([N, ...])."""
        import flax.serialization
        import jax
        mdir = self.path(MODELS)
        os.makedirs(mdir, exist_ok=True)
        host = jax.device_get(params)
        index = []
        for r, lab in enumerate(labels):
            one = jax.tree.map(lambda a: np.asarray(a[r]), host)
            name = replica_key(lab) + ".msgpack"
            with _atomic(os.path.join(mdir, name), "wb") as f:
                f.write(flax.serialization.to_bytes(one))
            entry = {"file": name, **_label_json(lab)}
            if hasattr(model, "export"):   # --model=llama: the adapters in peft's format too
                model.export(os.path.join(mdir, replica_key(lab) + ".peft"), one)
            if personal is not None:
                entry["personal_file"] = replica_key(lab) + ".personal.msgpack"
                own = jax.tree.map(lambda a: np.asarray(a[r]), personal)
                with _atomic(os.path.join(mdir, entry["personal_file"]), "wb") as f:
                    f.write(flax.serialization.to_bytes(own))
            index.append(entry)
        arrays = {k: v for k, v in data.metadata.items() if isinstance(v, np.ndarray)}
        if arrays:
            _write_npz(os.path.join(mdir, "metadata_arrays.npz"), arrays)
        _write_json(os.path.join(mdir, "index.json"), _model_spec(model, options, data, index))


def _model_spec(model: Model, options: ModelOptions, data: FederatedDataset,
                index: List[dict]) -> Dict[str, Any]:
    plain = {k: v for k, v in data.metadata.items() if not isinstance(v, np.ndarray)}
    return {
        "model": model.name,
        "options": dataclasses.asdict(options),
        "dataset": data.name,
        "num_classes": data.num_classes,
        "feature_shape": list(data.feature_shape),
        "x_dtype": str(data.train.x_dtype),
        "x_scale": data.x_scale,
        "metadata": plain,
        "replicas": index,
    }


def replica_key(label) -> str:
    """File-name key of a replica: ``ReplicaLabel.key()``; a key (a string) itself; for a
    label dict (an older run's) its "key" field when it has one, else the same format from its
    fields."""
    if isinstance(label, ReplicaLabel):
        return label.key()
    if isinstance(label, str):   # a key already (ReplicaNames.keys)
        return label
    if "key" in label:
        return str(label["key"])
    return ReplicaLabel.from_json(label).key()


# --------------------------------------------------------------------------------------------
# Reading


def _parse_jsonl(path: str, output_dir: str) -> List[Tuple[str, Dict[str, Any]]]:
    """(line, record) per line of a JSON-lines file; a last line that does not parse (a run
    cut off while writing it) is dropped, any other raises RunFormatError."""
    with open(path) as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise RunFormatError(output_dir, f"{os.path.basename(path)} line {i + 1} is not "
                                             f"JSON") from None
        out.append((line, rec))
    return out


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class RunReader:
    """Reads the files of one output directory (see the module docstring).

    Every method raises :class:`RunFormatError` (one line) when its file is missing or cannot
    be read; summary.json of a newer output format than :data:`SCHEMA_VERSION` too.
    """

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self._summary: Optional[Dict[str, Any]] = None

    def path(self, name: str) -> str:
        return os.path.join(self.output_dir, name)

    def has(self, name: str) -> bool:
        """Whether the directory holds `name` (e.g. "summary.json", "models")."""
        return os.path.exists(self.path(name))

    def is_complete(self) -> bool:
        """A finished run: summary.json and clients.npz are there."""
        return self.has(SUMMARY) and self.has(CLIENTS)

    def in_progress(self) -> bool:
        """metrics.jsonl but no summary.json: a run still going (or stopped)."""
        return self.has(METRICS) and not self.has(SUMMARY)

    def _require(self, name: str) -> str:
        if not self.has(name):
            raise RunFormatError(self.output_dir, f"no {name}")
        return self.path(name)

    def summary(self) -> Dict[str, Any]:
        """summary.json (read once). Older runs have no "schema_version" (version 0)."""
        if self._summary is None:
            path = self._require(SUMMARY)
            try:
                with open(path) as f:
                    summary = json.load(f)
            except (OSError, ValueError) as e:
                raise RunFormatError(self.output_dir,
                                     f"{SUMMARY} cannot be read ({_one_line(e)})") from None
            if not isinstance(summary, dict):
                raise RunFormatError(self.output_dir, f"{SUMMARY} is not a JSON object")
            version = summary.get("schema_version", 0)
            if not isinstance(version, int) or version > SCHEMA_VERSION:
                raise RunFormatError(
                    self.output_dir, f"{SUMMARY} has output format version {version!r}; this "
                    f"deltafl_jax reads versions up to {SCHEMA_VERSION} (upgrade it)")
            self._summary = summary
        return self._summary

    def marker(self) -> Optional[Dict[str, Any]]:
        """deltafl_run.json, or None when the directory has none (a run written before the
        marker existed) or it is not this package's."""
        if not self.has(MARKER):
            return None
        try:
            with open(self.path(MARKER)) as f:
                mark = json.load(f)
        except (OSError, ValueError):
            return None
        return mark if isinstance(mark, dict) and mark.get("written_by") == WRITTEN_BY \
            else None

    def schema_version(self) -> int:
        return int(self.summary().get("schema_version", 0))

    def label_dicts(self) -> List[Dict[str, Any]]:
        """The replicas' labels as summary.json holds them (dicts)."""
        raw = self.summary().get("replicas")
        if not isinstance(raw, list) or not all(isinstance(d, dict) for d in raw):
            raise RunFormatError(self.output_dir, f"{SUMMARY} has no list of replicas")
        return raw

    def labels(self) -> Tuple[ReplicaLabel, ...]:
        """The replicas' labels, in replica order."""
        raw = self.label_dicts()
        try:
            return tuple(ReplicaLabel.from_json(d) for d in raw)
        except (KeyError, TypeError, ValueError) as e:
            raise RunFormatError(self.output_dir,
                                 f"{SUMMARY} has a bad replica label ({_one_line(e)})") from None

    def keys(self) -> Tuple[str, ...]:
        """The replicas' file keys (npz ``replica_keys``, model files, summary "final"); older
        runs whose labels carry their own "key" keep it."""
        return tuple(str(d["key"]) if "key" in d else lab.key()
                     for d, lab in zip(self.label_dicts(), self.labels()))

    def records(self) -> List[Dict[str, Any]]:
        """The records of metrics.jsonl, in order; a torn last line is skipped."""
        return [rec for _, rec in _parse_jsonl(self._require(METRICS), self.output_dir)]

    def record_replicas(self, records: Sequence[Mapping[str, Any]]) -> List[Optional[int]]:
        """The replica index of each record (matched on every label field), None if none."""
        by_fields: Dict[Tuple[str, ...], Dict[Tuple, int]] = {}
        for r, d in enumerate(self.label_dicts()):
            by_fields.setdefault(tuple(d), {})[tuple(d.values())] = r
        out = []
        for rec in records:
            found = None
            for fields, index in by_fields.items():
                found = index.get(tuple(rec.get(k) for k in fields))
                if found is not None:
                    break
            out.append(found)
        return out

    def _npz(self, name: str) -> Dict[str, np.ndarray]:
        path = self._require(name)
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise RunFormatError(self.output_dir,
                                 f"{name} cannot be read ({_one_line(e)})") from None

    def rounds(self) -> Dict[str, np.ndarray]:
        """rounds.npz: per-round arrays [T, R] and ``replica_keys``."""
        return self._npz(ROUNDS)

    def clients(self) -> Dict[str, np.ndarray]:
        """clients.npz: final per-client arrays [R, N], sizes, ids and ``replica_keys``."""
        return self._npz(CLIENTS)

    def partition(self) -> Optional[Dict[str, np.ndarray]]:
        """partition.npz (the clients' example indices, the partitioner's settings and, for
        labelled data, ``<split>_label_histogram`` [K, C]), or None when the run partitioned
        nothing."""
        return self._npz(PARTITION) if self.has(PARTITION) else None

    def clients_history(self) -> Dict[str, np.ndarray]:
        """clients_history.npz: ``rounds`` [E] and per-client arrays [E, R, N]."""
        return self._npz(CLIENTS_HISTORY)

    def model_index(self) -> Dict[str, Any]:
        """models/index.json: the model spec and one entry per saved replica."""
        if not self.has(os.path.join(MODELS, "index.json")):
            raise RunFormatError(self.output_dir, "no saved models (missing models/index.json)")
        try:
            with open(self.path(os.path.join(MODELS, "index.json"))) as f:
                spec = json.load(f)
        except (OSError, ValueError) as e:
            raise RunFormatError(self.output_dir, f"models/index.json cannot be read "
                                                  f"({_one_line(e)})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("replicas"), list):
            raise RunFormatError(self.output_dir, "models/index.json has no list of replicas")
        return spec

    def read_model_params(self, template, file: str):
        """The parameters saved in models/`file`, restored into `template`'s structure (a
        freshly initialised model of the run's spec)."""
        import flax.serialization
        try:
            with open(self.path(os.path.join(MODELS, file)), "rb") as f:
                return flax.serialization.from_bytes(template, f.read())
        except (OSError, ValueError) as e:
            raise RunFormatError(self.output_dir,
                                 f"models/{file} cannot be read ({_one_line(e)})") from None
