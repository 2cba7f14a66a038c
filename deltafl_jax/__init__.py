"""deltafl_jax: a fast simulator of tail-robust federated learning (Delta-FL) in JAX.

Delta-FL (Laguel, Pillutla, Malick, Harchaoui) trains, for a conformity level theta in (0, 1],
the model that minimises the superquantile (CVaR) of the per-client losses: each round only the
sampled clients whose loss is above the alpha-weighted (1 - theta)-quantile train, and the
server averages their models. theta = 1 is FedAvg.

Public entry points:

- :func:`weighted_quantile`, :func:`superquantile`, :func:`tail_weights`: the primitives;
- :func:`run_experiment` / :class:`ExperimentConfig`: train every theta x seed in one program
  (:func:`build_experiment` and :func:`run_rounds` with callbacks for finer control);
- :func:`load_model`: serve the model w_theta of a finished run;
- :func:`register_model` / :class:`Model`: train a model of your own (a Flax module with its
  per-example loss and error) under ``--model=NAME``.

Importing the package is cheap: each public name is imported from its module on first use
(PEP 562's module ``__getattr__``), so that a command that only parses its flags, or a tool
that reads a run's files, does not start JAX, Flax or optax. ``deltafl_jax.superquantile``
is the function (``from deltafl_jax import superquantile``), also once the module of that name
is imported.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

from deltafl_jax.lazy_exports import lazy_attributes

if TYPE_CHECKING:
    from deltafl_jax.data import ClientData, FederatedDataset
    from deltafl_jax.datasets import DataConfig, load_dataset
    from deltafl_jax.errors import ConfigError, DataError
    from deltafl_jax.models import Model, ModelOptions, register_model
    from deltafl_jax.outputs.serving import LoadedModel, load_model
    from deltafl_jax.replicas.labels import ReplicaLabel
    from deltafl_jax.run import Callback, RunResult, build_experiment, run_experiment, run_rounds
    from deltafl_jax.run.config import ExperimentConfig
    from deltafl_jax.superquantile import (superquantile, superquantile_dual, tail_weights,
                                           threshold_weights, weighted_quantile)

__version__ = "0.1.0"

__all__ = [
    "weighted_quantile", "superquantile", "superquantile_dual", "tail_weights",
    "threshold_weights", "load_model", "LoadedModel", "ConfigError", "ExperimentConfig",
    "ClientData", "DataError", "FederatedDataset", "DataConfig", "load_dataset",
    "build_experiment", "run_experiment", "run_rounds", "Callback", "RunResult", "ReplicaLabel",
    "Model", "ModelOptions", "register_model",
]

# Each public name -> the module that defines it.
_EXPORTS = {
    **dict.fromkeys(["ClientData", "FederatedDataset"], "deltafl_jax.data"),
    **dict.fromkeys(["DataConfig", "load_dataset"], "deltafl_jax.datasets"),
    **dict.fromkeys(["ConfigError", "DataError"], "deltafl_jax.errors"),
    **dict.fromkeys(["Model", "ModelOptions", "register_model"], "deltafl_jax.models"),
    **dict.fromkeys(["LoadedModel", "load_model"], "deltafl_jax.outputs.serving"),
    "ReplicaLabel": "deltafl_jax.replicas.labels",
    **dict.fromkeys(["Callback", "RunResult", "build_experiment", "run_experiment",
                     "run_rounds"], "deltafl_jax.run"),
    "ExperimentConfig": "deltafl_jax.run.config",
    **dict.fromkeys(["superquantile", "superquantile_dual", "tail_weights",
                     "threshold_weights", "weighted_quantile"], "deltafl_jax.superquantile"),
}


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, __all__)


class _Package(types.ModuleType):
    """The package's module type: importing a module whose name is also a public function
    (``deltafl_jax.superquantile``) leaves the package's attribute the function."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


_PACKAGE = sys.modules[__name__]
_PACKAGE.__class__ = _Package
