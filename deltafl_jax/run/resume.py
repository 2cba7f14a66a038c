"""Resuming a run: what must match (the fingerprint), and picking up from the newest checkpoint.

Rerunning the command of a run whose ``<output_dir>/checkpoints/`` holds a checkpoint of the
same configuration continues it from there: the state comes from the checkpoint
(:mod:`deltafl_jax.run.checkpoint`), the recorder's histories from the output files that already
hold them (``rounds.npz``, ``clients_history.npz``, ``metrics.jsonl``; the runner writes the first
two before every checkpoint, so they are never behind it), cut back to the checkpoint's round.
The sampling and the shuffles are pure functions of (seed, round, client) and the PRNG keys are
re-derived from the seeds, so the resumed run ends with the same outputs, bit for bit, as one
that was never interrupted. A configuration that differs is refused, naming the flags that
differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Dict, List, Mapping, Optional

import jax
import numpy as np

from deltafl_jax import outputs
from deltafl_jax.algorithms import registry
from deltafl_jax.errors import ConfigError
from deltafl_jax.run import checkpoint as ckpt

# Settings that may change between the run and its resume (they change no result).
FREE_FIELDS = ("output_dir", "overwrite", "verbose", "tensorboard", "checkpoint_every",
               "checkpoint_every_s", "save_models", "devices", "client_data")


def data_digest(data) -> str:
    """sha256 of every array of the dataset's two splits."""
    h = hashlib.sha256()
    for split in (data.train, data.test):
        split.digest(h)
    return h.hexdigest()


def _canonical(value) -> str:
    """The JSON text of `value` as a checkpoint stores it (tuples -> lists, NaN == NaN)."""
    return json.dumps(value, sort_keys=True, default=str)


def fingerprint(config, data) -> Dict[str, Any]:
    """The settings (flag name -> value) and the data that a resume must match, as JSON reads
    them back. The data settings and the algorithm's options (with their defaults filled in)
    are flattened, so that a difference names the flag (``--filter``)."""
    out = {k: v for k, v in dataclasses.asdict(config).items() if k not in FREE_FIELDS}
    out.update(out.pop("data"))
    del out["options"]
    out.update(dataclasses.asdict(registry.get(config.algorithm).options_for(config)))
    out["data_sha256"] = data_digest(data)
    out["jax_version"] = jax.__version__
    if config.dp_clip is not None:   # a calibrated z and the epsilon depend on the accountant
        from deltafl_jax.privacy import library_version
        out["dp_accounting_version"] = library_version()
    return json.loads(_canonical(out))


def fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """The names of the settings whose values differ between two fingerprints (sorted).

    Values are compared as the checkpoint stores them (JSON: a tuple equals the list of its
    items, NaN equals NaN); a setting present on one side only differs. Nested dicts are
    compared key by key and named "outer.inner".
    """
    names: List[str] = []

    def walk(a, b, prefix):
        for key in sorted(set(a) | set(b)):
            name = f"{prefix}{key}"
            if key in a and key in b and isinstance(a[key], dict) and isinstance(b[key], dict):
                walk(a[key], b[key], name + ".")
            elif key not in a or key not in b or _canonical(a[key]) != _canonical(b[key]):
                names.append(name)

    walk(json.loads(_canonical(dict(saved))), json.loads(_canonical(dict(current))), "")
    return names


@dataclasses.dataclass
class Resume:
    """Where a resumed run picks up: the newest usable checkpoint and the histories up to it.

    round: rounds completed. state: the ServerState (placed like the run's).
    per_round: metric -> [round, R] host arrays of every round (rounds.npz).
    client_history: "rounds" [E] and the per-client arrays [E, R, N] of the evaluations up to
      `round` (clients_history.npz). records: the metrics.jsonl records up to `round`.
    """

    round: int
    state: Any
    per_round: Dict[str, np.ndarray]
    client_history: Dict[str, np.ndarray]
    records: List[Dict[str, Any]]


def check_config(checkpointer: ckpt.Checkpointer, current: Mapping[str, Any]) -> None:
    """ConfigError naming the flags that differ from the newest checkpoint's."""
    try:
        saved = checkpointer.read_fingerprint()
    except ckpt.CheckpointMismatch as e:
        raise ConfigError(f"cannot resume from {checkpointer.directory}: {e}; pass "
                          f"--overwrite to start afresh") from None
    diff = fingerprint_diff(saved[1], current) if saved is not None else []
    if diff:
        names = ", ".join(f"--{d}" for d in diff)
        raise ConfigError(f"the checkpoint in {checkpointer.directory} was made with other "
                          f"settings ({names} differ); rerun with those, or pass --overwrite "
                          f"to start afresh")


def histories(output_dir: str, round: int):
    """(per_round, client_history, records) of the output files, cut back to `round`; a file
    that is missing or unreadable is a ConfigError (one line)."""
    reader = outputs.RunReader(output_dir)
    try:
        per_round = {k: v[:round] for k, v in reader.rounds().items() if k != "replica_keys"}
        clients = reader.clients_history()
        records = [r for r in (reader.records() if reader.has(outputs.METRICS) else [])
                   if int(r.get("round", 0)) <= round]   # none before the first evaluation
    except outputs.RunFormatError as e:
        raise ConfigError(f"cannot resume {output_dir} from its checkpoint of round {round}: "
                          f"{e.reason}; pass --overwrite to start afresh") from None
    kept = int(np.sum(np.asarray(clients.get("rounds", []), np.int64) <= round))
    client_history = {k: v[:kept] for k, v in clients.items()}
    client_history["rounds"] = np.asarray(clients.get("rounds", [])[:kept], np.int64)
    short = [k for k, v in per_round.items() if len(v) != round]
    if short:
        raise ConfigError(f"cannot resume {output_dir}: {outputs.ROUNDS} holds fewer than "
                          f"{round} rounds of {short[0]}; pass --overwrite to start afresh")
    return per_round, client_history, records


def load(checkpointer: ckpt.Checkpointer, current: Mapping[str, Any], template_state,
         output_dir: str) -> Optional[Resume]:
    """The run's :class:`Resume` from its newest intact checkpoint (a damaged newest one falls
    back to the previous, with a warning) and `output_dir`'s files, or None when there is no
    checkpoint. ConfigError when the checkpoint was made with other settings."""
    check_config(checkpointer, current)
    try:
        found = checkpointer.restore(template_state)
    except ckpt.CheckpointMismatch as e:
        raise ConfigError(f"cannot resume from {checkpointer.directory}: {e}") from None
    if found is None:
        return None
    round, state = found
    return Resume(round, state, *histories(output_dir, round))
