"""Running experiments: build (:mod:`.experiment`), the loop with hooks and the recorder
(:mod:`.loop`, :mod:`.callbacks`), and the standard callbacks (progress, output files)."""

from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext
from deltafl_jax.run.experiment import Experiment, build_experiment
from deltafl_jax.run.loop import Recorder, RunResult, run_rounds
from deltafl_jax.run.runner import check_output_dir, check_output_parents, run_experiment

__all__ = ["Callback", "Evaluation", "RunContext", "Experiment", "build_experiment",
           "run_rounds", "Recorder", "RunResult", "run_experiment", "check_output_dir",
           "check_output_parents"]
