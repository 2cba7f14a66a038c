"""Running experiments: build (:mod:`.experiment`), the loop with hooks and the recorder
(:mod:`.loop`, :mod:`.callbacks`), and the standard callbacks (progress, output files).

The public names are imported from their modules on first use (PEP 562's module
``__getattr__``), so that a module of the package that needs no JAX (:mod:`.lock`, the lock of
an output folder) is imported without the rest."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltafl_jax.lazy_exports import lazy_attributes

if TYPE_CHECKING:
    from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext
    from deltafl_jax.run.experiment import Experiment, build_experiment
    from deltafl_jax.run.loop import Recorder, RunResult, run_rounds
    from deltafl_jax.run.runner import check_output_dir, check_output_parents, run_experiment

__all__ = ["Callback", "Evaluation", "RunContext", "Experiment", "build_experiment",
           "run_rounds", "Recorder", "RunResult", "run_experiment", "check_output_dir",
           "check_output_parents"]

# Each public name -> the module that defines it.
_EXPORTS = {
    **dict.fromkeys(["Callback", "Evaluation", "RunContext"], "deltafl_jax.run.callbacks"),
    **dict.fromkeys(["Experiment", "build_experiment"], "deltafl_jax.run.experiment"),
    **dict.fromkeys(["Recorder", "RunResult", "run_rounds"], "deltafl_jax.run.loop"),
    **dict.fromkeys(["check_output_dir", "check_output_parents", "run_experiment"],
                    "deltafl_jax.run.runner"),
}


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, __all__)
