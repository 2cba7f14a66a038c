"""From a configuration to an algorithm and the hyper-parameter values its replicas sweep.

``--algorithm=deltafl`` sweeps theta (``--thetas``, the paper's 1.0, 0.8, 0.5, 0.1 by default);
``--algorithm=fedavg`` is the same round at theta = 1 (bit-identical to
``--algorithm=deltafl --thetas=1.0``, and stored under theta = 1).

The baselines (:mod:`deltafl_jax.algorithms.baselines`) each sweep their own flag, every value
x seed in one compiled program, and name their replicas by it (``param_name`` = the flag,
``param_value`` = the value, e.g. ``load_model(out, qffl_q=1.0, seed=1)``):

=============  ==========================  ==============================================
algorithm      swept flag (hyper key)      default values
=============  ==========================  ==============================================
fedavg_sub     --thetas (theta), or        the theta < 1 of --thetas, else 0.8, 0.5, 0.1:
               --fedavg_sub_clients        as many clients as Delta-FL keeps at theta
fedprox        --fedprox_mu (mu)           0.001, 0.01, 0.1, 1 (the FedProx paper's grid)
qffl           --qffl_q (q)                0.001, 0.01, 0.1, 1, 10 (CISS 2021, Sec. V)
afl_qffl       q = 10 (q)                  q-FFL with q = 10, the papers' proxy for AFL
afl            --afl_lambda_lr             0.01; all N training clients every round, one
               (afl_lambda_lr)             local step
term           --term_t (t)                0.1, 1, 10
=============  ==========================  ==============================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from deltafl_jax.algorithms import baselines
from deltafl_jax.algorithms.base import FederatedAlgorithm
from deltafl_jax.algorithms.deltafl import FILTERS, deltafl

DEFAULT_SUB_THETAS = (0.8, 0.5, 0.1)
DEFAULT_FEDPROX_MU = (0.001, 0.01, 0.1, 1.0)
DEFAULT_QFFL_Q = (0.001, 0.01, 0.1, 1.0, 10.0)
AFL_QFFL_Q = 10.0
DEFAULT_AFL_LAMBDA_LR = (0.01,)
DEFAULT_TERM_T = (0.1, 1.0, 10.0)


@dataclasses.dataclass(frozen=True)
class AlgorithmSetup:
    """An algorithm, the hyper key and values of its swept hyper-parameter, fixed
    hyper-parameters, forced local steps and forced clients per round (None: the run's
    choice), and the name its replicas' labels give the swept value (default: the key)."""

    algorithm: FederatedAlgorithm
    sweep_name: str
    sweep_values: Tuple[float, ...]
    fixed: Dict[str, float] = dataclasses.field(default_factory=dict)
    local_steps: Optional[int] = None
    name: str = ""
    param_name: str = ""
    clients_per_round: Optional[int] = None

    def label(self, value: float, seed: int) -> Dict[str, Any]:
        """How a replica is named in metrics.jsonl, summary.json and load_model."""
        lab = {"algorithm": self.name or self.algorithm.name}
        if self.sweep_name == "theta":
            lab["theta"] = float(value)
        else:
            lab["theta"] = float(self.fixed.get("theta", 1.0))
            lab["param_name"] = self.param_name or self.sweep_name
            lab["param_value"] = float(value)
        lab["seed"] = int(seed)
        return lab


def _config_error(msg):
    from deltafl_jax.config import ConfigError
    return ConfigError(msg)


def _deltafl(config, data) -> AlgorithmSetup:
    from deltafl_jax.config import PAPER_THETAS
    thetas = tuple(config.thetas) or PAPER_THETAS
    return AlgorithmSetup(deltafl(config.filter), "theta", thetas, name="deltafl")


def _fedavg(config, data) -> AlgorithmSetup:
    if config.thetas and tuple(config.thetas) != (1.0,):
        raise _config_error(
            f"--algorithm=fedavg is Delta-FL at theta=1; got --thetas={list(config.thetas)} "
            "(use --algorithm=deltafl to sweep theta)")
    return AlgorithmSetup(deltafl(config.filter), "theta", (1.0,), name="fedavg")


def _fedavg_sub(config, data) -> AlgorithmSetup:
    if config.fedavg_sub_clients:
        return AlgorithmSetup(baselines.fedavg_sub("count", config.filter),
                              "fedavg_sub_clients",
                              tuple(float(k) for k in config.fedavg_sub_clients),
                              name="fedavg_sub")
    thetas = tuple(t for t in config.thetas if t < 1.0) or DEFAULT_SUB_THETAS
    return AlgorithmSetup(baselines.fedavg_sub("theta", config.filter), "theta", thetas,
                          name="fedavg_sub")


def _fedprox(config, data) -> AlgorithmSetup:
    return AlgorithmSetup(baselines.fedprox(config.filter), "mu",
                          tuple(config.fedprox_mu) or DEFAULT_FEDPROX_MU, fixed={"theta": 1.0},
                          name="fedprox", param_name="fedprox_mu")


def _qffl(config, data) -> AlgorithmSetup:
    return AlgorithmSetup(baselines.qffl(), "q", tuple(config.qffl_q) or DEFAULT_QFFL_Q,
                          name="qffl", param_name="qffl_q")


def _afl_qffl(config, data) -> AlgorithmSetup:
    return AlgorithmSetup(baselines.qffl(), "q", (AFL_QFFL_Q,), name="afl_qffl",
                          param_name="qffl_q")


def _afl(config, data) -> AlgorithmSetup:
    if data is None:
        raise _config_error("--algorithm=afl needs the dataset (lambda over its training "
                            "clients)")
    return AlgorithmSetup(baselines.afl(data.train.sizes), "afl_lambda_lr",
                          tuple(config.afl_lambda_lr) or DEFAULT_AFL_LAMBDA_LR, local_steps=1,
                          name="afl", clients_per_round=int(data.train.num_clients))


def _term(config, data) -> AlgorithmSetup:
    return AlgorithmSetup(baselines.term(), "t", tuple(config.term_t) or DEFAULT_TERM_T,
                          name="term", param_name="term_t")


BUILDERS: Dict[str, Callable[[Any, Any], AlgorithmSetup]] = {
    "deltafl": _deltafl,
    "fedavg": _fedavg,
    "fedavg_sub": _fedavg_sub,
    "fedprox": _fedprox,
    "qffl": _qffl,
    "afl_qffl": _afl_qffl,
    "afl": _afl,
    "term": _term,
}


def algorithm_names():
    return sorted(BUILDERS)


def check(config) -> None:
    """The checks that need no data: a known algorithm and filter."""
    if config.algorithm not in BUILDERS:
        raise _config_error(f"unknown algorithm {config.algorithm!r}; choose one of "
                            f"{', '.join(algorithm_names())}")
    if config.filter not in FILTERS:
        raise _config_error(f"unknown --filter={config.filter!r}; choose one of "
                            f"{', '.join(FILTERS)}")


def build(config, data=None) -> AlgorithmSetup:
    """The setup of `config.algorithm`. `data` (the FederatedDataset) is needed by the
    algorithms that keep state per training client (afl)."""
    check(config)
    return BUILDERS[config.algorithm](config, data)
