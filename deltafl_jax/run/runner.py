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
from deltafl_jax.run.loop import run_rounds
from deltafl_jax.run.preemption import Preemption
from deltafl_jax.run.progress import Progress
from deltafl_jax.run.recorder import Recorder, RunResult
from deltafl_jax.run.writer import OutputFiles


def _print(line: str) -> None:
    print(line, flush=True)


def check_output_dir(out: Optional[str], overwrite: bool) -> None:
    """ConfigError for a directory that holds a finished run, or results without a checkpoint
    to resume from, unless overwrite."""
    if out and os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--output_dir={out} exists and is not a directory")
    if not out or overwrite or not outputs.has_results(out):
        return
    finished = os.path.exists(os.path.join(out, outputs.SUMMARY))
    if finished or not os.path.isdir(ckpt.checkpoint_dir(out)):
        outputs.prepare_dir(out, overwrite=False)   # raises the one-line error


def _checkpointer(out: Optional[str], overwrite: bool) -> Optional[ckpt.Checkpointer]:
    """The run's checkpoints (None without an output dir, and on runs of several processes,
    which do not checkpoint yet); overwrite starts afresh. The directory was checked by
    :func:`check_output_dir` already."""
    if not out:
        return None
    if overwrite or not os.path.isdir(ckpt.checkpoint_dir(out)):
        outputs.prepare_dir(out, overwrite)
    if jax.process_count() > 1:
        return None
    return ckpt.Checkpointer(ckpt.checkpoint_dir(out))


def standard_callbacks(config, exp, log, recorder, checkpointer, fp) -> List[Callback]:
    """The run's callbacks after the recorder (``--estimate`` times them too). Every process
    runs the same computations; only the primary one prints and writes."""
    out = config.output_dir if distributed.is_primary() else None
    cbs: List[Callback] = []
    if config.stop_on_divergence:
        cbs.append(StopOnDivergence())   # before the writers: it adds to the summary
    if config.verbose and distributed.is_primary():
        cbs.append(Progress(log))
    if out:
        cbs.append(OutputFiles(out, config.save_models))
        if config.tensorboard or (config.tensorboard is None and tensorboard.available()):
            cbs.append(tensorboard.TensorBoard(out))
    if checkpointer is not None:
        T, every = config.num_rounds, config.eval_every
        cbs.append(ckpt.CheckpointCallback(
            checkpointer, recorder.host_state, fp, every=config.checkpoint_every,
            every_s=config.checkpoint_every_s, evaluated=lambda r: r % every == 0 or r == T))
        cbs.append(Preemption())
    return cbs


def _resume(exp: Experiment, checkpointer, fp, recorder: Recorder, log):
    """(start round, state): from the newest checkpoint of the same configuration, or fresh."""
    state = exp.initial_state()
    if checkpointer is None or checkpointer.latest_round() is None:
        return 0, state
    resume.check_config(checkpointer, fp)
    found = resume.restore(checkpointer, state)
    if found is None:
        return 0, state
    recorder.load_host_state(found.host)
    outputs.RunWriter(exp.config.output_dir).truncate_metrics(after_round=found.round)
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
    fp = resume.fingerprint(config, exp.data)
    distributed.check_same_plan(exp, fp)
    checkpointer = _checkpointer(out, config.overwrite)
    try:
        recorder = Recorder()
        start, state = _resume(exp, checkpointer, fp, recorder, log)
        recorder.build_s = time.perf_counter() - t0
        cbs = standard_callbacks(config, exp, log, recorder, checkpointer, fp)
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
