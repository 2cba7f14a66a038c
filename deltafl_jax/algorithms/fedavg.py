"""FedAvg (McMahan et al., 2017) as the theta = 1 case of Delta-FL (Algorithm 2): every sampled
client trains and the server averages with weights alpha_k proportional to n_k. It is the same
round as ``--algorithm=deltafl --thetas=1.0``, bit for bit, labelled ``fedavg``.
``--weighting=unweighted`` averages uniformly; Delta-FL's --smoothing and --quantile are not
used (at theta = 1 smoothing gives the same average, and the strict filter F_k > eta of
--quantile=secagg_mm would drop the client with the lowest loss)."""

from __future__ import annotations

from deltafl_jax.algorithms.deltafl import (THETA_SWEEP, DeltaFLHyper, RoundOptions,
                                            check_thetas, deltafl)
from deltafl_jax.algorithms.spec import AlgorithmSpec
from deltafl_jax.errors import ConfigError


def _theta_one(config, given):
    if given and tuple(given) != (1.0,):
        raise ConfigError(
            f"--algorithm=fedavg is Delta-FL at theta=1; got --thetas={list(given)} "
            "(use --algorithm=deltafl to sweep theta)")
    return (1.0,)


SPEC = AlgorithmSpec(
    name="fedavg", help="FedAvg: Delta-FL at theta = 1, bit for bit",
    make=lambda config, data: deltafl(config.filter, thetas=(1.0,), options=RoundOptions(
        weighting=config.weighting)), hyper=DeltaFLHyper, sweep=THETA_SWEEP,
    values=_theta_one, validate=check_thetas)
