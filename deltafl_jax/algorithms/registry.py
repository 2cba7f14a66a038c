"""From a configuration to an algorithm and the hyper-parameter values its replicas sweep.

``--algorithm=deltafl`` sweeps theta (``--thetas``, the paper's 1.0, 0.8, 0.5, 0.1 by default);
``--algorithm=fedavg`` is the same round at theta = 1 (bit-identical to
``--algorithm=deltafl --thetas=1.0``, and stored under theta = 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from deltafl_jax.algorithms.base import FederatedAlgorithm
from deltafl_jax.algorithms.deltafl import FILTERS, deltafl


@dataclasses.dataclass(frozen=True)
class AlgorithmSetup:
    """An algorithm, the name and values of its swept hyper-parameter, fixed
    hyper-parameters, and forced local steps (None: the run's choice)."""

    algorithm: FederatedAlgorithm
    sweep_name: str
    sweep_values: Tuple[float, ...]
    fixed: Dict[str, float] = dataclasses.field(default_factory=dict)
    local_steps: Optional[int] = None
    name: str = ""

    def label(self, value: float, seed: int) -> Dict[str, Any]:
        """How a replica is named in metrics.jsonl, summary.json and load_model."""
        lab = {"algorithm": self.name or self.algorithm.name}
        if self.sweep_name == "theta":
            lab["theta"] = float(value)
        else:
            lab["theta"] = float(self.fixed.get("theta", 1.0))
            lab["param_name"] = self.sweep_name
            lab["param_value"] = float(value)
        lab["seed"] = int(seed)
        return lab


def _config_error(msg):
    from deltafl_jax.config import ConfigError
    return ConfigError(msg)


def _deltafl(config) -> AlgorithmSetup:
    from deltafl_jax.config import PAPER_THETAS
    thetas = tuple(config.thetas) or PAPER_THETAS
    return AlgorithmSetup(deltafl(config.filter), "theta", thetas, name="deltafl")


def _fedavg(config) -> AlgorithmSetup:
    if config.thetas and tuple(config.thetas) != (1.0,):
        raise _config_error(
            f"--algorithm=fedavg is Delta-FL at theta=1; got --thetas={list(config.thetas)} "
            "(use --algorithm=deltafl to sweep theta)")
    return AlgorithmSetup(deltafl(config.filter), "theta", (1.0,), name="fedavg")


BUILDERS: Dict[str, Callable[[Any], AlgorithmSetup]] = {
    "deltafl": _deltafl,
    "fedavg": _fedavg,
}


def algorithm_names():
    return sorted(BUILDERS)


def build(config) -> AlgorithmSetup:
    if config.algorithm not in BUILDERS:
        raise _config_error(f"unknown algorithm {config.algorithm!r}; choose one of "
                            f"{', '.join(algorithm_names())}")
    if config.filter not in FILTERS:
        raise _config_error(f"unknown --filter={config.filter!r}; choose one of "
                            f"{', '.join(FILTERS)}")
    return BUILDERS[config.algorithm](config)
