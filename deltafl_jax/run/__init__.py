"""Running experiments: build (:mod:`.experiment`), the loop with hooks and the recorder
(:mod:`.loop`, :mod:`.callbacks`), and the standard callbacks (progress, output files).

The public names are imported from their modules on first use (PEP 562's module
``__getattr__``), so that a module of the package that needs no JAX (:mod:`.lock`, the lock of
an output folder) is imported without the rest."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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


def __getattr__(name: str):
    """A public name, imported from its module on first use; else a module of the package
    (``deltafl_jax.run.experiment``), imported on first use."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
