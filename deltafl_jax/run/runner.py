"""Run an experiment end to end: build it, resume it from its newest checkpoint when there is
one, run its rounds with the standard callbacks, and return the result.
``python -m experiments.run`` is a thin front end to :func:`run_experiment`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax

from deltafl_jax.data import FederatedDataset
from deltafl_jax.datasets import load_dataset
from deltafl_jax.errors import ConfigError
from deltafl_jax.outputs import directory as outputs
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.run import checkpoint as ckpt, distributed, lock, resume
from deltafl_jax.run.callbacks import Callback
from deltafl_jax.run.config import ExperimentConfig
from deltafl_jax.run.divergence import StopOnDivergence
from deltafl_jax.run.experiment import Experiment, build_experiment
from deltafl_jax.run.loop import Recorder, RunResult, evaluate, run_rounds
from deltafl_jax.run.progress import Progress
from deltafl_jax.run.writer import OutputFiles, TensorBoard, tensorboard_available


def _print(line: str) -> None:
    print(line, flush=True)


def _primary() -> bool:
    """This process writes the outputs: the run's only process, or process 0 of a
    distributed run."""
    return jax.process_index() == 0


def _several() -> bool:
    """The run spans several processes: only then are :mod:`deltafl_jax.run.distributed`'s
    collectives (the output dir, the plan's check, the barrier) needed."""
    return jax.process_count() > 1


def has_checkpoint(out: str) -> bool:
    """Whether `out` holds a complete checkpoint (an orbax step; not a save killed midway)."""
    folder = ckpt.checkpoint_dir(out)
    return os.path.isdir(folder) and any(n.isdigit() for n in os.listdir(folder))


def _listing(names: Sequence[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_output_dir(out: Optional[str], overwrite: bool, config=None) -> None:
    """ConfigError (one line) unless `out` may receive the run of `config`:

    - absent or empty: a new run;
    - a run of this package (:func:`deltafl_jax.outputs.directory.inspect_dir`): with `overwrite` it is
      replaced; without, a finished run (summary.json) is continued when only ``--num_rounds``
      grows and the run can be continued exactly (:func:`check_continuation`), and a stopped
      run resumes when its settings (its marker's) are `config`'s, ``--num_rounds`` aside;
    - anything else (a folder holding other files, the parent of runs, a folder of a run's
      file names that this package did not write, e.g. someone's own summary.json) is refused,
      with or without `overwrite`, which replaces a run and never someone's files; so is a
      folder inside a run (:func:`deltafl_jax.outputs.directory.enclosing_run`), which the
      run could no longer be continued around;
    - a folder that another process holds (:mod:`deltafl_jax.run.lock`) is refused (checked
      by process 0 of a distributed run only: it alone takes the lock).

    Without `config` a finished run is refused (no continuation) and a stopped one accepted.
    """
    if not out:
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--output_dir={out} exists and is not a directory")
    state = outputs.inspect_dir(out)
    inside = outputs.enclosing_run(os.path.dirname(os.path.abspath(out)))
    if inside is not None:
        raise ConfigError(f"--output_dir={out} lies inside the run {inside}, which could then "
                          f"no longer be continued; choose a directory outside it")
    if state.kind == "other":
        if state.runs:
            raise ConfigError(
                f"--output_dir={out} is not a run but holds runs "
                f"({_listing([r.rstrip('/') for r in state.runs])}); name a directory of its "
                f"own, e.g. {os.path.join(out, 'NAME')} (--overwrite replaces a run, never a "
                f"folder of them)")
        if state.unmarked:
            raise ConfigError(
                f"--output_dir={out} is not a run of deltafl_jax: it holds "
                f"{_listing(list(state.foreign))} but no {outputs.MARKER}, the mark of a run "
                f"this package wrote; choose a new or empty directory (--overwrite replaces a "
                f"run, never other files)")
        raise ConfigError(
            f"--output_dir={out} is not a run of deltafl_jax: it holds "
            f"{_listing(list(state.foreign))} (not files a run writes); choose a new or empty "
            f"directory (--overwrite replaces a run, never other files)")
    if _primary():   # the others of a distributed run never hold its lock
        lock.check_free(out)       # another process writing into it: refused
    if state.kind != "run" or overwrite:
        return
    reader = outputs.RunReader(out)
    if reader.has(outputs.SUMMARY):
        check_continuation(out, reader, config)
    elif config is not None:
        diff = [d for d in _settings_diff(reader, config) if d != resume.EXTENDABLE]
        if diff:
            raise ConfigError(f"--output_dir={out} holds a stopped run with other settings "
                              f"({', '.join(f'--{d}' for d in diff)} differ); rerun with those "
                              f"to resume it, or pass --overwrite to start afresh")


def _settings_diff(reader: outputs.RunReader, config) -> List[str]:
    """The settings of `config` that differ from the run's (its marker's; for a finished run
    written before the marker, its summary.json's configuration); [] when unknown."""
    mark = reader.marker()
    if mark is not None and isinstance(mark.get("settings"), dict):
        return resume.fingerprint_diff(mark["settings"], resume.settings(config))
    if not reader.has(outputs.SUMMARY):
        return []
    try:
        saved = reader.summary().get("config", {})
    except outputs.RunFormatError:   # refused as it is by check_continuation
        return []
    current = json.loads(json.dumps(config.flat(), default=str))
    diff = resume.fingerprint_diff(
        {k: _bools_as_ints(v) for k, v in saved.items() if k not in resume.FREE_FIELDS},
        {k: _bools_as_ints(v) for k, v in current.items() if k not in resume.FREE_FIELDS})
    return [d.split(".", 1)[1] if d.startswith(("data.", "options.", "sweeps.")) else d
            for d in diff]


def _bools_as_ints(value):
    """summary.json stores a configuration's booleans as 0 / 1; compare them so."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, dict):
        return {k: _bools_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_bools_as_ints(v) for v in value]
    return value


def check_continuation(out: str, reader: outputs.RunReader, config) -> None:
    """ConfigError unless the finished run in `out` can be continued by `config`: the same
    settings but a larger ``--num_rounds``, a checkpoint to continue from, and nothing that
    depends on the total (:func:`deltafl_jax.run.resume.continuation_obstacle`)."""
    refuse = (f"--output_dir={out} already holds results; pass --overwrite or choose another "
              f"directory")
    if config is None:
        raise ConfigError(refuse)
    try:
        summary = reader.summary()
    except outputs.RunFormatError:
        raise ConfigError(refuse) from None
    done = int(summary.get("config", {}).get("num_rounds", 0))
    diff = _settings_diff(reader, config)
    other = [d for d in diff if d != resume.EXTENDABLE]
    if other:
        raise ConfigError(f"--output_dir={out} holds a finished run with other settings "
                          f"({', '.join(f'--{d}' for d in other)} differ); pass --overwrite or "
                          f"choose another directory")
    if config.training.num_rounds <= done:
        raise ConfigError(refuse + f" (its {done} rounds are done; a larger --num_rounds "
                                   f"continues it)")
    if not has_checkpoint(out):
        raise ConfigError(f"--output_dir={out} holds a finished run of {done} rounds without a "
                          f"checkpoint to continue it from; pass --overwrite to start afresh")
    why = resume.continuation_obstacle(config, done, summary.get("diverged"))
    if why is not None:
        raise ConfigError(f"cannot continue the run in {out} to --num_rounds="
                          f"{config.training.num_rounds} exactly: {why}; pass --overwrite to start "
                          f"afresh")


def check_output_parents(top: Optional[str], output_dirs: Sequence[Optional[str]]) -> None:
    """ConfigError when `top`, the directory under which a run of several programs writes
    its output directories (``--algorithm`` listing several methods:
    ``<top>/<method>/``; ``--resample_writers_per_seed``: ``<top>/seed_<s>/``), or a folder
    between them, holds anything other than those programs' directories."""
    if not top:
        return
    top = os.path.normpath(top)
    allowed: Dict[str, set] = {}
    for d in output_dirs:
        rel = os.path.relpath(os.path.normpath(d), top) if d else "."
        if rel == "." or rel.startswith(".."):
            continue
        here = top
        for part in rel.split(os.sep):
            allowed.setdefault(here, set()).add(part)
            here = os.path.join(here, part)
    for parent, names in sorted(allowed.items()):
        if not os.path.exists(parent):
            continue
        if not os.path.isdir(parent):
            raise ConfigError(f"--output_dir={parent} exists and is not a directory")
        extra = sorted(set(os.listdir(parent)) - names)
        if extra:
            raise ConfigError(
                f"--output_dir={parent} holds {_listing(extra)}, which this run of "
                f"{len(output_dirs)} programs does not write (only "
                f"{', '.join(n + '/' for n in sorted(names))}); choose a new or empty "
                f"directory")


def _prepare(out: Optional[str], config, log) -> None:
    """Make the primary process's output dir ready: emptied with overwrite, and for a run
    that was stopped before its first checkpoint (nothing to resume from: it starts afresh,
    saying so in one line); a run with a checkpoint is left for the resume. A new run's
    directory gets its marker (:meth:`deltafl_jax.outputs.directory.RunWriter.write_marker`)."""
    if not out:
        return
    overwrite = config.output.overwrite
    check_output_dir(out, overwrite, config)
    if not overwrite and outputs.has_results(out) and not has_checkpoint(out):
        log(f"deltafl_jax: {out} holds a run stopped before its first checkpoint; starting it "
            f"afresh")
        overwrite = True
    if overwrite or not has_checkpoint(out):
        outputs.prepare_dir(out, overwrite)
        outputs.RunWriter(out).write_marker(resume.settings(config))


def _checkpointer(config) -> Optional[ckpt.Checkpointer]:
    """The run's checkpoints, in the primary process's ``<output_dir>/checkpoints`` (every
    process of a multi-process run uses that one directory: it must be on a filesystem they
    all see); None without an output dir."""
    out = config.output.output_dir
    out = distributed.primary_output_dir(out) if _several() else out
    return ckpt.Checkpointer(ckpt.checkpoint_dir(out)) if out else None


def standard_callbacks(config, exp, log, recorder, checkpointer, fingerprint) -> List[Callback]:
    """The run's callbacks after the recorder (``--estimate`` times them too). Every process
    runs the same computations; only the primary one prints and writes."""
    out = config.output.output_dir if _primary() else None
    cbs: List[Callback] = []
    if config.training.stop_on_divergence:
        # before the writers: it adds to the summary
        cbs.append(StopOnDivergence(history=recorder.history, per_round=recorder.per_round))
    if config.output.verbose and _primary():
        cbs.append(Progress(log))
    if out:
        cbs.append(OutputFiles(out, exp.model, exp.model_options, exp.data,
                               config.output.save_models))
        board = config.output.tensorboard
        if board or (board is None and tensorboard_available()):
            cbs.append(TensorBoard(out))
    if checkpointer is not None:
        several = _several()
        T, every = config.training.num_rounds, config.evaluation.eval_every
        cbs.append(ckpt.Preemption(defer=several))   # before the checkpoints: see its docstring
        cbs.append(ckpt.CheckpointCallback(
            checkpointer, fingerprint, every=config.output.checkpoint_every,
            every_s=config.output.checkpoint_every_s, evaluated=lambda r: r % every == 0 or r == T,
            before_save=(lambda r: _write_histories(out, recorder, exp)) if out else None,
            agree=distributed.any_process if several else None,
            host=exp.host_state))
    return cbs


def _write_histories(out: str, recorder: Recorder, exp: Experiment) -> None:
    """rounds.npz and clients_history.npz of the rounds recorded so far: written before each
    checkpoint, so that a resume reads the histories back from them
    (:mod:`deltafl_jax.run.resume`)."""
    writer = outputs.RunWriter(out)
    writer.write_rounds(recorder.per_round_arrays(), exp.replicas.labels)
    writer.write_clients_history(recorder.client_history_arrays())


def _resume(exp: Experiment, checkpointer, fingerprint, recorder: Recorder, log):
    """(start round, state): from the newest checkpoint of the same configuration (or of a
    run it continues to more rounds), or fresh."""
    config = exp.config
    state = exp.initial_state()
    out = config.output.output_dir
    out = distributed.primary_output_dir(out) if _several() else out
    found = (resume.load(checkpointer, fingerprint, state, out, config)
             if checkpointer is not None and checkpointer.latest_round() is not None else None)
    finished = bool(out) and os.path.exists(os.path.join(out, outputs.SUMMARY))
    if finished and found is None:   # the folder's check found a checkpoint; none can be read
        raise ConfigError(f"cannot continue the run in {out}: no checkpoint of it can be read; "
                          f"pass --overwrite to start afresh")
    if _primary() and out:
        writer = outputs.RunWriter(out)
        if finished:   # continued: a run in progress until it writes its results anew
            writer.remove_final_outputs()
        writer.truncate_metrics(after_round=found.round if found else 0)   # no duplicates
        writer.write_marker(resume.settings(config))
    if found is None:
        return 0, state
    if found.host is not None:
        exp.restore_host(found.host)
    resume.backfill_participation(exp, found)
    recorder.resume(found)
    if found.round == config.training.num_rounds:   # killed after its last checkpoint
        metrics = {k: v[-1] for k, v in found.per_round.items()}
        recorder.last = evaluate(exp, found.state, found.round, metrics, 0.0)
    if finished:
        log(f"deltafl_jax: continuing {config.output.output_dir} from its checkpoint after round "
            f"{found.round}, to round {config.training.num_rounds}")
    else:
        log(f"deltafl_jax: resuming {config.output.output_dir} from its checkpoint after round "
            f"{found.round} of {config.training.num_rounds}")
    return found.round, found.state


def run_experiment(config: ExperimentConfig, data: Optional[FederatedDataset] = None,
                   log: Optional[Callable[[str], None]] = None,
                   replicas: Optional[Replicas] = None,
                   callbacks: Sequence[Callback] = ()) -> RunResult:
    """Train every replica of `config` in one program, evaluate every ``eval_every`` rounds,
    write the outputs (when ``config.output_dir`` is set) and return the :class:`RunResult`.

    With an output dir, checkpoints go to ``<output_dir>/checkpoints/`` and a rerun of the same
    configuration resumes from the newest one; SIGTERM / SIGINT end the run after the current
    round with a checkpoint (``result.stopped``). `replicas` replaces the algorithm's sweep x
    seeds (the tuner's grids); `callbacks` are added after the standard ones. Raises
    ConfigError / DataError before anything is written.

    The output folder is locked for the whole run (:mod:`deltafl_jax.run.lock`): a second
    process into it is refused (ConfigError) while this one runs, and the folder is free again
    when this one ends, however it ends.
    """
    log = log or _print
    out = config.output.output_dir if _primary() else None
    check_output_dir(out, config.output.overwrite, config)
    # Only the process that writes the folder locks it (process 0 of a distributed run).
    with lock.locked(out, log=log):
        check_output_dir(out, config.output.overwrite, config)   # as it is now that it is ours
        return _run_locked(config, data, log, replicas, callbacks, out)


def _run_locked(config: ExperimentConfig, data: Optional[FederatedDataset], log,
                replicas: Optional[Replicas], callbacks: Sequence[Callback],
                out: Optional[str]) -> RunResult:
    """:func:`run_experiment` once its output folder is locked."""
    t0 = time.perf_counter()
    data = data if data is not None else load_dataset(config.data)
    exp = build_experiment(config, data, replicas)
    if _primary():   # settings past a stability bound of the algorithm's
        for line in exp.spec.warnings(config, exp.replicas):
            log(f"warning: {line}")
    fingerprint = resume.fingerprint(config, exp.data)
    if _several():
        distributed.check_same_plan(exp, fingerprint)
    _prepare(out, config, log)
    if _several():
        distributed.barrier("prepared")   # the others read what the primary keeps of its dir
    checkpointer = _checkpointer(config)
    try:
        recorder = Recorder()
        start, state = _resume(exp, checkpointer, fingerprint, recorder, log)
        recorder.build_s = time.perf_counter() - t0
        cbs = standard_callbacks(config, exp, log, recorder, checkpointer, fingerprint)
        result = run_rounds(exp, state, [*cbs, *callbacks], start_round=start,
                            output_dir=out, recorder=recorder)
    finally:
        if checkpointer is not None:
            checkpointer.close()
    if result.stopped and checkpointer is not None:
        log(f"deltafl_jax: stopped by {result.stop_reason or 'request'} after round "
            f"{result.rounds_done}; checkpoint in {checkpointer.directory}; run the same "
            f"command again to resume")
    return result
