"""Run an experiment end to end: build it, resume it from its newest checkpoint when there is
one, run its rounds with the standard callbacks, and return the result.
``python -m experiments.run`` is a thin front end to :func:`run_experiment`.
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Sequence

import jax

from deltafl_jax import outputs
from deltafl_jax.config import ExperimentConfig
from deltafl_jax.data import FederatedDataset
from deltafl_jax.datasets import load_dataset
from deltafl_jax.errors import ConfigError
from deltafl_jax.replicas import Replicas
from deltafl_jax.run import checkpoint as ckpt, distributed, resume, tensorboard
from deltafl_jax.run.callbacks import Callback
from deltafl_jax.run.divergence import StopOnDivergence
from deltafl_jax.run.experiment import Experiment, build_experiment
from deltafl_jax.run.loop import evaluate, run_rounds
from deltafl_jax.run.preemption import Preemption
from deltafl_jax.run.progress import Progress
from deltafl_jax.run.recorder import Recorder, RunResult
from deltafl_jax.run.writer import OutputFiles


def _print(line: str) -> None:
    print(line, flush=True)


def has_checkpoint(out: str) -> bool:
    """Whether `out` holds a complete checkpoint (an orbax step; not a save killed midway)."""
    folder = ckpt.checkpoint_dir(out)
    return os.path.isdir(folder) and any(n.isdigit() for n in os.listdir(folder))


def check_output_dir(out: Optional[str], overwrite: bool) -> None:
    """ConfigError for a directory that holds a finished run (summary.json), unless
    overwrite. (A stopped run resumes from its checkpoint, or starts afresh when it has none:
    see :func:`_prepare`.)"""
    if out and os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--output_dir={out} exists and is not a directory")
    if out and not overwrite and os.path.exists(os.path.join(out, outputs.SUMMARY)):
        outputs.prepare_dir(out, overwrite=False)   # raises the one-line error


def _prepare(out: Optional[str], overwrite: bool, log) -> None:
    """Make the primary process's output dir ready: emptied with overwrite, and for a run
    that was stopped before its first checkpoint (nothing to resume from: it starts afresh,
    saying so in one line); a run with a checkpoint is left for the resume."""
    if not out:
        return
    check_output_dir(out, overwrite)
    if not overwrite and outputs.has_results(out) and not has_checkpoint(out):
        log(f"deltafl_jax: {out} holds a run stopped before its first checkpoint; starting it "
            f"afresh")
        overwrite = True
    if overwrite or not has_checkpoint(out):
        outputs.prepare_dir(out, overwrite)


def _checkpointer(config) -> Optional[ckpt.Checkpointer]:
    """The run's checkpoints, in the primary process's ``<output_dir>/checkpoints`` (every
    process of a multi-process run uses that one directory: it must be on a filesystem they
    all see); None without an output dir."""
    out = distributed.primary_output_dir(config.output_dir)
    return ckpt.Checkpointer(ckpt.checkpoint_dir(out)) if out else None


def standard_callbacks(config, exp, log, recorder, checkpointer, fingerprint) -> List[Callback]:
    """The run's callbacks after the recorder (``--estimate`` times them too). Every process
    runs the same computations; only the primary one prints and writes."""
    out = config.output_dir if distributed.is_primary() else None
    cbs: List[Callback] = []
    if config.stop_on_divergence:
        cbs.append(StopOnDivergence())   # before the writers: it adds to the summary
    if config.verbose and distributed.is_primary():
        cbs.append(Progress(log))
    if out:
        cbs.append(OutputFiles(out, exp.model, exp.model_options, exp.data, config.save_models))
        if config.tensorboard or (config.tensorboard is None and tensorboard.available()):
            cbs.append(tensorboard.TensorBoard(out))
    if checkpointer is not None:
        several = jax.process_count() > 1
        T, every = config.num_rounds, config.eval_every
        cbs.append(Preemption(defer=several))   # before the checkpoints: see its docstring
        cbs.append(ckpt.CheckpointCallback(
            checkpointer, fingerprint, every=config.checkpoint_every,
            every_s=config.checkpoint_every_s, evaluated=lambda r: r % every == 0 or r == T,
            before_save=(lambda r: _write_histories(out, recorder, exp)) if out else None,
            agree=distributed.any_process if several else None))
    return cbs


def _write_histories(out: str, recorder: Recorder, exp: Experiment) -> None:
    """rounds.npz and clients_history.npz as they are now: written before each checkpoint,
    so that a resume reads the histories back from them (:mod:`deltafl_jax.run.resume`)."""
    writer = outputs.RunWriter(out)
    writer.write_rounds(recorder.per_round_arrays(), exp.replicas.labels)
    writer.write_clients_history(recorder.client_history_arrays())


def _resume(exp: Experiment, checkpointer, fingerprint, recorder: Recorder, log):
    """(start round, state): from the newest checkpoint of the same configuration, or fresh."""
    state = exp.initial_state()
    out = distributed.primary_output_dir(exp.config.output_dir)
    found = (resume.load(checkpointer, fingerprint, state, out)
             if checkpointer is not None and checkpointer.latest_round() is not None else None)
    if distributed.is_primary() and out:   # no duplicate or torn lines
        outputs.RunWriter(out).truncate_metrics(after_round=found.round if found else 0)
    if found is None:
        return 0, state
    recorder.resume(found)
    if found.round == exp.config.num_rounds:   # killed after its last checkpoint
        metrics = {k: v[-1] for k, v in found.per_round.items()}
        recorder.last = evaluate(exp, found.state, found.round, metrics, 0.0)
    log(f"deltafl_jax: resuming {exp.config.output_dir} from its checkpoint after round "
        f"{found.round} of {exp.config.num_rounds}")
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
    """
    log = log or _print
    out = config.output_dir if distributed.is_primary() else None
    check_output_dir(out, config.overwrite)
    t0 = time.perf_counter()
    data = data if data is not None else load_dataset(config.data)
    exp = build_experiment(config, data, replicas)
    fingerprint = resume.fingerprint(config, exp.data)
    distributed.check_same_plan(exp, fingerprint)
    _prepare(out, config.overwrite, log)
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
