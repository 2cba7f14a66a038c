"""Resuming a run: what must match (the fingerprint), and picking up from the newest checkpoint.

Rerunning the command of a run whose ``<output_dir>/checkpoints/`` holds a checkpoint of the
same configuration continues it from there: the state comes from the checkpoint
(:mod:`deltafl_jax.run.checkpoint`), the recorder's histories from the output files that already
hold them (``rounds.npz``, ``clients_history.npz``, ``metrics.jsonl``; the runner writes the first
two before every checkpoint, so they are never behind it), cut back to the checkpoint's round.
The sampling and the shuffles are pure functions of (seed, round, client), the PRNG keys are
re-derived from the seeds, and the host's participation record and a stateful availability
model's state come back from the checkpoint (its ``host`` item), so the resumed run ends with
the same outputs, bit for bit, as one that was never interrupted. A configuration that differs is refused, naming the flags that
differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional

import jax
import numpy as np

from deltafl_jax.algorithms import registry
from deltafl_jax.declared import flat_values
from deltafl_jax.errors import ConfigError
from deltafl_jax.outputs import directory as outputs
from deltafl_jax.run import checkpoint as ckpt

# Settings that may change between the run and its resume: they change no training.
# --target_accuracy only sets the share of clients below it that an evaluation reports (the
# records written before a resume keep the share at the target they were written with;
# summary.json and the report use the resumed run's).
FREE_FIELDS = ("output_dir", "overwrite", "verbose", "tensorboard", "checkpoint_every",
               "checkpoint_every_s", "save_models", "devices", "client_data", "target_accuracy")


def data_digest(data) -> str:
    """sha256 of every array of the dataset's two splits."""
    h = hashlib.sha256()
    for split in (data.train, data.test):
        split.digest(h)
    return h.hexdigest()


def _canonical(value) -> str:
    """The JSON text of `value` as a checkpoint stores it (tuples -> lists, NaN == NaN)."""
    return json.dumps(value, sort_keys=True, default=str)


def settings(config) -> Dict[str, Any]:
    """The settings (flag name -> value) that a resume must match, as JSON reads them back:
    the configuration without :data:`FREE_FIELDS`, the data settings and the algorithm's
    options (with their defaults filled in) flattened, so that a difference names the flag
    (``--filter``). The output directory's marker holds them (``deltafl_run.json``)."""
    out = {k: v for k, v in config.flat().items() if k not in FREE_FIELDS}
    out.update(out.pop("data"))
    del out["options"]
    out.update(flat_values(registry.get(config.algorithm).options_for(config)))
    return json.loads(_canonical(out))


def fingerprint(config, data) -> Dict[str, Any]:
    """:func:`settings` and the data (its sha256) that a resume must match, with the versions
    that change results (jax; dp-accounting for a private run)."""
    out = settings(config)
    out["data_sha256"] = data_digest(data)
    out["jax_version"] = jax.__version__
    if config.privacy.clip is not None:   # a calibrated z and the epsilon depend on the accountant
        from deltafl_jax.privacy.dp import library_version
        out["dp_accounting_version"] = library_version()
    return json.loads(_canonical(out))


def fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """The names of the settings whose values differ between two fingerprints (sorted).

    Values are compared as the checkpoint stores them (JSON: a tuple equals the list of its
    items, NaN equals NaN); a setting present on one side only differs, except a setting of
    the configuration's groups that the saved side lacks and the current side holds at its
    default (a fingerprint saved before the setting existed resumes). Nested dicts are
    compared key by key and named "outer.inner". The :data:`FREE_FIELDS` are left out on
    both sides (a fingerprint saved when one of them was still part of it resumes).
    """
    names: List[str] = []
    defaults = _group_defaults()

    def walk(a, b, prefix):
        for key in sorted(set(a) | set(b)):
            name = f"{prefix}{key}"
            if key in a and key in b and isinstance(a[key], dict) and isinstance(b[key], dict):
                walk(a[key], b[key], name + ".")
            elif not prefix and key not in a and key in defaults and \
                    _canonical(b[key]) == defaults[key]:
                continue
            elif key not in a or key not in b or _canonical(a[key]) != _canonical(b[key]):
                names.append(name)

    walk(*(json.loads(_canonical({k: v for k, v in dict(side).items() if k not in FREE_FIELDS}))
           for side in (saved, current)), "")
    return names


def _group_defaults() -> Dict[str, str]:
    """flag -> the canonical JSON of its default, for every setting of the configuration's
    groups, of the data settings and of the algorithms' options."""
    from deltafl_jax.run.config import GROUPS
    from deltafl_jax.datasets import DataConfig
    out: Dict[str, str] = {}
    for _, cls in GROUPS:
        out.update({k: _canonical(v) for k, v in
                    json.loads(_canonical(flat_values(cls()))).items()})
    data = json.loads(_canonical(flat_values(DataConfig(dataset=""))))
    out.update({k: _canonical(v) for k, v in data.items() if k != "dataset"})
    for spec in registry.SPECS.values():
        out.update({k: _canonical(v) for k, v in flat_values(spec.options_type()).items()})
    return out


def backfill_participation(exp, found: "Resume") -> None:
    """A checkpoint saved without the host's state (before participation was recorded): its
    rounds are counted again from their draws (every sampler is a function of (seed, round,
    online set), the availability models of (seed, round)), and the output files' histories
    get the per-round ``num_online`` and each evaluation's participation arrays they lack.
    Nothing for an algorithm that samples from its state (its cohorts cannot be drawn
    again)."""
    if exp.participation is None or found.host is not None or exp.algorithm.sampling:
        return
    history = found.client_history
    evals = {int(t): i for i, t in enumerate(history.get("rounds", []))}
    online, snapshots = [], {}
    for t in range(found.round):
        exp.cohorts(t)
        online.append(exp.count_round(t)["num_online"])
        if t + 1 in evals:
            clients = history["train_clients"][evals[t + 1]] if "train_clients" in history \
                else None
            snapshots[evals[t + 1]] = exp.participation_arrays(clients)
    if online and "num_online" not in found.per_round:
        found.per_round["num_online"] = np.stack(online)
    if evals and len(snapshots) == len(evals):
        for name in snapshots[0]:
            history.setdefault(name, np.stack([snapshots[i][name] for i in range(len(evals))]))


@dataclasses.dataclass
class Resume:
    """Where a resumed run picks up: the newest usable checkpoint and the histories up to it.

    round: rounds completed. state: the ServerState (placed like the run's).
    per_round: metric -> [round, R] host arrays of every round (rounds.npz).
    client_history: "rounds" [E] and the per-client arrays [E, R, N] of the evaluations up to
      `round` (clients_history.npz). records: the metrics.jsonl records up to `round`.
    host: the host's state saved with the checkpoint (the participation record and a stateful
      availability model's state, :class:`deltafl_jax.run.planning.Participation`),
      or None for a checkpoint without one.
    """

    round: int
    state: Any
    per_round: Dict[str, np.ndarray]
    client_history: Dict[str, np.ndarray]
    records: List[Dict[str, Any]]
    host: Optional[Dict[str, Any]] = None


# The one setting a run may change and still continue exactly (see continuation_obstacle).
EXTENDABLE = "num_rounds"


def continuation_obstacle(config, done: int, diverged: Optional[Mapping[str, int]] = None
                          ) -> Optional[str]:
    """Why a run of `config`'s settings, planned for another number of rounds and `done`
    rounds in, cannot go on to ``config.num_rounds`` and end as an uninterrupted run of that
    length would (None when it can).

    Nothing of a round depends on the planned total: the sampling, the shuffles and the PRNG
    keys are functions of (seed, round), the learning rate gamma_0 c^-floor(t / t_0) of the
    round alone, the evaluations fall every ``eval_every`` rounds, the checkpoints change no
    result, and epsilon is accounted round by round. Except:

    - a noise multiplier calibrated to ``--dp_target_epsilon`` over the planned rounds (a
      finite target): another total gives another z;
    - ``--stop_on_divergence``, when a replica was stopped at the evaluation a finished run
      made after its last round off the ``eval_every`` schedule (`diverged`: replica key ->
      round, summary.json's): the longer run would not have stopped it there;
    - rounds already done past the new total.
    """
    if done > config.training.num_rounds:
        return f"it has done {done} rounds, more than --num_rounds={config.training.num_rounds}"
    targets = [e for e in config.privacy.target_epsilons if math.isfinite(e)]
    if config.privacy.clip is not None and targets:
        return (f"its noise multiplier was calibrated to --dp_target_epsilon="
                f"{','.join(f'{e:g}' for e in targets)} over its planned rounds, and another "
                f"--num_rounds gives another one (give --dp_noise_multiplier to plan a run that "
                f"can grow)")
    stopped = sorted(k for k, r in (diverged or {}).items() if int(r) == done)
    if config.training.stop_on_divergence and done % config.evaluation.eval_every and stopped:
        return (f"--stop_on_divergence stopped {', '.join(stopped)} at its last evaluation "
                f"(round {done}), which a run of {config.training.num_rounds} rounds evaluating "
                f"every {config.evaluation.eval_every} does not make")
    return None


def check_config(checkpointer: ckpt.Checkpointer, current: Mapping[str, Any],
                 config=None) -> None:
    """ConfigError naming the flags that differ from the newest checkpoint's; only
    ``--num_rounds`` may differ, when the run can continue to it exactly
    (:func:`continuation_obstacle`; `config` is the current configuration)."""
    try:
        saved = checkpointer.read_fingerprint()
    except ckpt.CheckpointMismatch as e:
        raise ConfigError(f"cannot resume from {checkpointer.directory}: {e}; pass "
                          f"--overwrite to start afresh") from None
    diff = fingerprint_diff(saved[1], current) if saved is not None else []
    if diff == [EXTENDABLE] and config is not None:
        why = continuation_obstacle(config, saved[0])
        if why is None:
            return
        raise ConfigError(f"cannot continue the run in {os.path.dirname(checkpointer.directory)}"
                          f" to --num_rounds={config.training.num_rounds} exactly: {why}; pass "
                          f"--overwrite to start afresh")
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
         output_dir: str, config=None) -> Optional[Resume]:
    """The run's :class:`Resume` from its newest intact checkpoint (a damaged newest one falls
    back to the previous, with a warning) and `output_dir`'s files, or None when there is no
    checkpoint. ConfigError when the checkpoint was made with other settings (other than a
    ``--num_rounds`` that `config` can continue to, :func:`check_config`)."""
    check_config(checkpointer, current, config)
    try:
        found = checkpointer.restore(template_state)
    except ckpt.CheckpointMismatch as e:
        raise ConfigError(f"cannot resume from {checkpointer.directory}: {e}") from None
    if found is None:
        return None
    round, state = found
    try:
        host = checkpointer.restore_host(round)
    except Exception as e:  # pylint: disable=broad-except
        raise ConfigError(f"cannot resume from {checkpointer.directory}: the host state of its "
                          f"checkpoint of round {round} does not read ({e})") from None
    return Resume(round, state, *histories(output_dir, round), host=host)
