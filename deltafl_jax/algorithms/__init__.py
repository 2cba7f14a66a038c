"""Federated algorithms: one module per algorithm, each exporting one :class:`AlgorithmSpec`
(:mod:`deltafl_jax.algorithms.spec`), collected by :mod:`deltafl_jax.algorithms.registry`."""

from deltafl_jax.algorithms.options import Sweep
from deltafl_jax.algorithms.protocol import ClientFeedback, FederatedAlgorithm, average_delta
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Grid, Reporting
from deltafl_jax.algorithms import registry

__all__ = ["AlgorithmSpec", "ClientFeedback", "Clients", "FederatedAlgorithm", "Grid", "Reporting",
           "Sweep", "average_delta", "registry"]
