"""Federated algorithms, each a factory returning a :class:`FederatedAlgorithm`."""

from deltafl_jax.algorithms.base import ClientFeedback, FederatedAlgorithm, average_update
from deltafl_jax.algorithms.deltafl import FILTERS, deltafl
from deltafl_jax.algorithms import registry

__all__ = ["ClientFeedback", "FederatedAlgorithm", "average_update", "deltafl", "FILTERS", "registry"]
