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
"""

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
