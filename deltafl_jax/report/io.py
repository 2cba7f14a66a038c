"""Reading run directories for reports.

Runs are read only through :class:`deltafl_jax.outputs.directory.RunReader`. :func:`read_run` gives a
:class:`Run` or raises :class:`RunError` (one line); :func:`load` reads many and skips, with a
one-line reason, the runs that are missing, in progress or unreadable. The tidy rows, CSV files
and DataFrames made from runs are in :mod:`deltafl_jax.report.rows`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from deltafl_jax.errors import RunError
from deltafl_jax.outputs.directory import (CLIENTS, CLIENTS_HISTORY, METRICS, ROUNDS, SUMMARY,
                                           RunFormatError, RunReader)
from deltafl_jax.replicas.labels import ReplicaLabel

# Reading runs imports NumPy only; the metrics (JAX), the models (Flax) and the run's settings
# are imported where the tables and curves are computed, so that a report refused for its
# command line, its runs or its folder answers before those imports.

# `target_accuracy` left at its default: the simulator's default target
# (deltafl_jax.evaluation.metrics.DEFAULT_TARGET_ACCURACY), read when it is used.
DEFAULT_TARGET = "default"

KINDS = ("final", "curves", "clients", "kept")
CLIENT_ARRAYS = ("train_loss", "train_error", "test_loss", "test_error", "train_sizes",
                 "test_sizes", "replica_keys")


@dataclasses.dataclass(eq=False)
class Run:
    """One run directory, read back.

    labels[r] names replica r (a :class:`ReplicaLabel`) and keys[r] is its file key;
    ``clients`` holds the final per-client arrays [R, N]; ``history`` the same at every
    evaluation [E, R, N] (None for runs older than clients_history.npz); ``rounds`` the
    per-round arrays [T, R] (None if rounds.npz is missing); ``records`` the lines of
    metrics.jsonl and ``record_replicas`` the replica of each; ``notes`` what is missing but
    not needed for the tables.
    """

    path: str
    name: str
    summary: Dict[str, Any]
    labels: List[ReplicaLabel]
    keys: List[str]
    clients: Dict[str, np.ndarray]
    history: Optional[Dict[str, np.ndarray]]
    rounds: Optional[Dict[str, np.ndarray]]
    records: List[Dict[str, Any]]
    record_replicas: List[Optional[int]]
    notes: List[str]
    _cache: Dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def config(self) -> Dict[str, Any]:
        return self.summary.get("config", {})

    @property
    def dataset(self) -> str:
        return str(self.summary.get("dataset", {}).get("name", "?"))

    @property
    def model(self) -> str:
        return str(self.summary.get("model", self.config.get("model", "?")))

    @property
    def target_accuracy(self) -> Optional[float]:
        """The target of ``test_share_below_target`` (the run's --target_accuracy, the default
        for runs before it), or None for a regression model (no accuracy)."""
        from deltafl_jax.evaluation.metrics import DEFAULT_TARGET_ACCURACY
        from deltafl_jax.models import REGRESSION_MODELS
        if self.model in REGRESSION_MODELS:
            return None
        return float(self.config.get("target_accuracy", DEFAULT_TARGET_ACCURACY))

    @property
    def num_rounds(self) -> int:
        return int(self.config.get("num_rounds", 0))

    def sampled(self, split: str = "train") -> bool:
        """Whether clients.npz holds a sample of `split`'s clients (``--eval_clients``: the
        evaluation drew K clients of each split, :mod:`deltafl_jax.evaluation.sample`)."""
        return f"{split}_clients" in self.clients

    def client_indices(self, split: str) -> np.ndarray:
        """[K] the population index of each client whose final values clients.npz holds for
        `split` ("train" / "test"): every client in order, or the evaluation's sample
        (training: the K draws with probability alpha_k, repeats included)."""
        if self.sampled(split):
            return np.asarray(self.clients[f"{split}_clients"], np.int64)
        return np.arange(len(self.clients[f"{split}_sizes"]), dtype=np.int64)

    def client_sizes(self, split: str) -> np.ndarray:
        """[K] n_k of the clients of :meth:`client_indices` (clients.npz's ``*_sizes`` hold
        the whole population's)."""
        return np.asarray(self.clients[f"{split}_sizes"])[self.client_indices(split)]

    @property
    def resampled_per_seed(self) -> bool:
        """Each seed of the experiment was its own dataset (--resample_writers_per_seed)."""
        return bool(self.config.get("data", {}).get("resample_writers_per_seed", False))

    @property
    def setting_key(self) -> Tuple[str, ...]:
        """Runs share a table row when their data and model are the same; the per-seed programs of
        --resample_writers_per_seed (data drawn from each seed) share one row."""
        data = dict(self.config.get("data", {}))
        stats = self.summary.get("dataset", {})
        if self.resampled_per_seed:
            data.pop("data_seed", None)
            stats = {}
        return (self.dataset, self.model, json.dumps(data, sort_keys=True),
                json.dumps(stats, sort_keys=True))

    @property
    def setting(self) -> str:
        return f"{self.dataset} / {self.model}"

    def final(self, percentile: str = "lower") -> Dict[str, np.ndarray]:
        """Metric name -> [R] for the final models, recomputed from clients.npz."""
        from deltafl_jax.run.personal import summarize_populations
        key = ("final", percentile)
        if key not in self._cache:
            c = self.clients
            self._cache[key] = {
                **summaries(c["train_loss"], c["train_sizes"], c["test_error"],
                            c["test_loss"], percentile, "train_clients" in c,
                            len(c["test_sizes"]), self.target_accuracy),
                **summarize_populations(c, self.config.get("finetune_steps") or (0,),
                                        len(c["train_sizes"]), len(c["test_sizes"]),
                                        percentile)}
        return self._cache[key]

    def curves(self, percentile: str = "lower"):
        """(rounds [E], metric name -> [E, R]) at every evaluation, or None.

        Recomputed from clients_history.npz; a run without it falls back on metrics.jsonl,
        whose percentiles are the lower quantile (so only for ``percentile="lower"``).
        """
        key = ("curves", percentile)
        if key not in self._cache:
            out = None
            if self.history is not None:
                out = curves_from_history(self.history, self.clients["train_sizes"], percentile,
                                          len(self.clients["test_sizes"]),
                                          self.target_accuracy)
            elif percentile == "lower" and self.records:
                out = curves_from_records(self.records, self.record_replicas, len(self.keys))
            self._cache[key] = out
        return self._cache[key]


def summaries(train_loss, train_sizes, test_error, test_loss, percentile: str,
              sampled: bool, num_test: int,
              target_accuracy: Union[float, str, None] = DEFAULT_TARGET
              ) -> Dict[str, np.ndarray]:
    """The metrics of one evaluation: :func:`deltafl_jax.evaluation.metrics.summarize` of every client,
    or, for a sampled evaluation (``--eval_clients``: its per-client arrays hold the sample),
    the estimates and intervals of :func:`deltafl_jax.evaluation.sample.summarize_sample` (whose
    percentiles are the lower quantile of the sample, whatever `percentile` asks).
    `target_accuracy`: None for a regression (no accuracy, errors unbounded above)."""
    from deltafl_jax.evaluation.metrics import DEFAULT_TARGET_ACCURACY, summarize
    from deltafl_jax.evaluation.sample import summarize_sample
    from deltafl_jax.run.config import PERCENTILES
    if isinstance(target_accuracy, str):   # DEFAULT_TARGET
        target_accuracy = DEFAULT_TARGET_ACCURACY
    if sampled:
        return summarize_sample(train_loss, test_error, test_loss, PERCENTILES,
                                num_test=num_test, target_accuracy=target_accuracy,
                                error_bounds=(0.0, np.inf if target_accuracy is None
                                              else 1.0))
    return summarize(train_loss, train_sizes, test_error, test_loss, PERCENTILES, percentile,
                     target_accuracy)


def curves_from_history(history: Dict[str, np.ndarray], train_sizes: np.ndarray,
                        percentile: str, num_test: int = 0,
                        target_accuracy: Union[float, str, None] = DEFAULT_TARGET):
    """(rounds [E], metric -> [E, R]) recomputed from the per-client history."""
    sampled = "train_clients" in history
    per_eval = [summaries(history["train_loss"][e], train_sizes, history["test_error"][e],
                          history["test_loss"][e], percentile, sampled, num_test,
                          target_accuracy)
                for e in range(len(history["rounds"]))]
    return (np.asarray(history["rounds"], np.int64),
            {k: np.stack([p[k] for p in per_eval]) for k in per_eval[0]})


def curves_from_records(records: Sequence[Dict[str, Any]],
                        replicas: Sequence[Optional[int]], num_replicas: int):
    """(rounds [E], metric -> [E, R]) as metrics.jsonl logged them (NaN where missing)."""
    rounds = sorted({int(r["round"]) for r in records})
    names = [k for k in records[0] if k.startswith(("train_loss_", "test_error_", "test_loss_"))]
    out = {n: np.full((len(rounds), num_replicas), np.nan) for n in names}
    row = {t: i for i, t in enumerate(rounds)}
    for rec, r in zip(records, replicas):
        if r is None:
            continue
        for n in names:
            if n in rec:
                out[n][row[int(rec["round"])], r] = float(rec[n])
    return np.asarray(rounds, np.int64), out


# --------------------------------------------------------------------------------------------
# Reading one run


def open_run(path: str) -> RunReader:
    """A reader for a finished run at `path`; RunError when it is missing, not a run, or a
    run in progress (metrics.jsonl but no summary.json yet)."""
    if not os.path.exists(path):
        raise RunError("no such directory")
    if not os.path.isdir(path):
        raise RunError("not a directory")
    reader = RunReader(path)
    if reader.has(SUMMARY):
        return reader
    if not reader.has(METRICS):
        raise RunError("not a run directory (no summary.json, metrics.jsonl or clients.npz)")
    records = reader.records()
    last = max((int(r.get("round", 0)) for r in records), default=0)
    raise RunError(f"in progress (or stopped): no summary.json yet; metrics.jsonl has "
                   f"{len(records)} record(s), the last at round {last}")


def read_clients(reader: RunReader, keys: Sequence[str]) -> Dict[str, np.ndarray]:
    """clients.npz, checked against the run's replicas and client counts."""
    if not reader.has(CLIENTS):
        raise RunError("incomplete run: summary.json but no clients.npz (per-client arrays)")
    clients = reader.clients()
    missing = [k for k in CLIENT_ARRAYS if k not in clients]
    if missing:
        raise RunError(f"clients.npz lacks {', '.join(missing)}")
    if [str(k) for k in clients["replica_keys"]] != list(keys):
        raise RunError("the replicas of summary.json and clients.npz do not match")
    R = len(keys)
    n_train, n_test = len(clients["train_sizes"]), len(clients["test_sizes"])
    if "train_clients" in clients:   # a sampled evaluation: its clients' arrays
        n_train, n_test = len(clients["train_clients"]), len(clients["test_clients"])
    for k, n in (("train_loss", n_train), ("train_error", n_train), ("test_loss", n_test),
                 ("test_error", n_test)):
        if clients[k].shape != (R, n):
            raise RunError(f"clients.npz {k} has shape {clients[k].shape}, expected {(R, n)}")
    if np.any(clients["train_sizes"] <= 0):
        raise RunError("clients.npz has a training client without examples")
    return clients


def read_history(reader: RunReader, shape: Tuple[int, int, int], notes: List[str]):
    """clients_history.npz [E, R, N] checked against (R, N_train, N_test) (a sampled
    evaluation: (R, K_train, K_test), each evaluation's own sample), or None (noted)."""
    if not reader.has(CLIENTS_HISTORY):
        notes.append("no clients_history.npz; curves come from metrics.jsonl (lower "
                     "percentiles only)")
        return None
    R, n_train, n_test = shape
    try:
        history = reader.clients_history()
        E = len(history.get("rounds", []))
        for k, n in (("train_loss", n_train), ("test_loss", n_test), ("test_error", n_test)):
            if k not in history or history[k].shape != (E, R, n):
                raise RunError(f"clients_history.npz {k} does not have shape {(E, R, n)}")
    except (RunError, RunFormatError) as e:
        notes.append(f"{reason(e)}; curves come from metrics.jsonl")
        return None
    return history


def read_rounds(reader: RunReader, num_replicas: int, notes: List[str]):
    """rounds.npz with num_selected [T, R], or None (noted)."""
    if not reader.has(ROUNDS):
        notes.append("no rounds.npz; no kept-clients figure for this run")
        return None
    try:
        rounds = reader.rounds()
        selected = rounds.get("num_selected", np.zeros((0, 0)))
        if selected.ndim != 2 or selected.shape[1] != num_replicas:
            raise RunError("rounds.npz has no num_selected [rounds, replicas]")
    except (RunError, RunFormatError) as e:
        notes.append(f"{reason(e)}; no kept-clients figure for this run")
        return None
    return rounds


def read_records(reader: RunReader, num_rounds: Optional[int], notes: List[str]
                 ) -> List[Dict[str, Any]]:
    """metrics.jsonl's records ([] when it is missing or unreadable, noted)."""
    if not reader.has(METRICS):
        notes.append("no metrics.jsonl")
        return []
    try:
        records = reader.records()
    except RunFormatError as e:
        notes.append(e.reason)
        return []
    last = max((int(r.get("round", 0)) for r in records), default=0)
    total = last if num_rounds is None else int(num_rounds)
    if last != total:
        notes.append(f"metrics.jsonl ends at round {last}, the run had {total} rounds")
    return records


def reason(e: Exception) -> str:
    """The one-line reason of a RunError or RunFormatError (without the directory)."""
    return e.reason if isinstance(e, RunFormatError) else str(e)


def read_run(path: str, name: Optional[str] = None) -> Run:
    """Read one run directory. Raises :class:`RunError` (one line) if it cannot be reported:
    missing, not a run, in progress, incomplete (no summary.json or clients.npz), of a newer
    output format, or inconsistent."""
    try:
        reader = open_run(path)
        summary = reader.summary()
        labels, keys = list(reader.labels()), list(reader.keys())
        clients = read_clients(reader, keys)
    except RunFormatError as e:
        raise RunError(e.reason) from None
    notes: List[str] = []
    shape = (len(keys), *(len(clients[f"{split}_clients"]) if f"{split}_clients" in clients
                          else len(clients[f"{split}_sizes"]) for split in ("train", "test")))
    history = read_history(reader, shape, notes)
    rounds = read_rounds(reader, len(keys), notes)
    ended = summary.get("ended", {}).get("round")   # a run that ended early, complete
    records = read_records(reader, ended if ended is not None else
                           summary.get("config", {}).get("num_rounds"), notes)
    return Run(path=path, name=name or os.path.basename(os.path.normpath(path)),
               summary=summary, labels=labels, keys=keys, clients=clients, history=history,
               rounds=rounds, records=records, record_replicas=reader.record_replicas(records),
               notes=notes)


# --------------------------------------------------------------------------------------------
# Reading many runs


def looks_like_run(path: str) -> bool:
    reader = RunReader(path)
    return any(reader.has(f) for f in (SUMMARY, METRICS, CLIENTS))


def runs_below(path: str, depth: int) -> List[str]:
    """The run directories under `path` (not itself a run), up to `depth` levels down, sorted
    by name (e.g. runs/compare/<algorithm>/seed_<s>/)."""
    out = []
    for d in sorted(os.listdir(path)):
        sub = os.path.join(path, d)
        if not os.path.isdir(sub):
            continue
        if looks_like_run(sub):
            out.append(sub)
        elif depth > 1:
            out.extend(runs_below(sub, depth - 1))
    return out


def find_run_dirs(paths: Iterable[str], depth: int = 3) -> List[str]:
    """The given directories; a directory that is not itself a run but holds run
    directories (e.g. ``runs/``, or a multi-method run with per-seed programs) stands for them."""
    out = []
    for p in paths:
        if os.path.isdir(p) and not looks_like_run(p):
            subs = runs_below(p, depth)
            if subs:
                out.extend(subs)
                continue
        out.append(p)
    return out


def load(paths: Iterable[str], log: Optional[Callable[[str], None]] = None
         ) -> Tuple[List[Run], List[str]]:
    """Read the runs under `paths` (see :func:`find_run_dirs`).

    Returns (runs, skipped): the runs that can be reported, and one line per run that cannot
    ("skipped PATH: reason"). Each skipped line is also passed to `log`.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    dirs = find_run_dirs(paths)
    names = [os.path.basename(os.path.normpath(d)) or d for d in dirs]
    runs, skipped = [], []
    for p in paths:   # a run directory that also holds runs (written by an older version)
        below = runs_below(p, 3) if os.path.isdir(p) and looks_like_run(p) else []
        if below:
            line = (f"skipped {', '.join(below)}: inside the run {p}, which is reported "
                    f"alone (name them to report them)")
            skipped.append(line)
            if log:
                log(line)
    for d, n in zip(dirs, names):
        name = n if names.count(n) == 1 else os.path.normpath(d)
        try:
            runs.append(read_run(d, name))
        except RunError as e:
            line = f"skipped {d}: {e}"
            skipped.append(line)
            if log:
                log(line)
    return runs, skipped
