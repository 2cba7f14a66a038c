"""Run an experiment end to end: build it, run its rounds with the standard callbacks, and
return the result. ``python -m experiments.run`` is a thin front end to :func:`run_experiment`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from deltafl_jax import outputs
from deltafl_jax.config import ExperimentConfig
from deltafl_jax.data import FederatedDataset
from deltafl_jax.replicas import Replicas
from deltafl_jax.run import tensorboard
from deltafl_jax.run.callbacks import Callback
from deltafl_jax.run.experiment import build_experiment
from deltafl_jax.run.loop import run_rounds
from deltafl_jax.run.progress import Progress
from deltafl_jax.run.recorder import Recorder, RunResult
from deltafl_jax.run.writer import OutputWriter


def _print(line: str) -> None:
    print(line, flush=True)


def run_experiment(config: ExperimentConfig, data: Optional[FederatedDataset] = None,
                   log: Optional[Callable[[str], None]] = None,
                   replicas: Optional[Replicas] = None,
                   callbacks: Sequence[Callback] = ()) -> RunResult:
    """Train every replica of `config` in one program, evaluate every ``eval_every`` rounds,
    write the outputs (when ``config.output_dir`` is set) and return the :class:`RunResult`.

    `replicas` replaces the algorithm's sweep x seeds (the tuner's grids); `callbacks` are
    added after the standard ones (progress, output files). Raises ConfigError / DataError
    before anything is written.
    """
    out = config.output_dir
    if out and outputs.has_results(out) and not config.overwrite:
        outputs.prepare_dir(out, overwrite=False)   # raises the one-line error
    t0 = time.perf_counter()
    exp = build_experiment(config, data, replicas)
    recorder = Recorder()
    recorder.build_s = time.perf_counter() - t0
    standard = []
    if config.verbose:
        standard.append(Progress(log or _print))
    if out:
        outputs.prepare_dir(out, config.overwrite)
        standard.append(OutputWriter(out, config.save_models))
        if config.tensorboard or (config.tensorboard is None and tensorboard.available()):
            standard.append(tensorboard.TensorBoard(out))
    return run_rounds(exp, exp.initial_state(), [*standard, *callbacks], output_dir=out,
                      recorder=recorder)
