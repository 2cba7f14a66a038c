"""The registry: every algorithm's spec, by name. It collects specs and validates names; what an
algorithm is lives in its own module (see README, "Adding an algorithm").

Replicas of the theta-swept algorithms (deltafl, fedavg, fedavg_sub) are labelled by theta;
the other baselines by their swept flag (``param_name`` = the flag, ``param_value`` = the
value, e.g. ``load_model(out, qffl_q=1.0, seed=1)``).
"""

from __future__ import annotations

from typing import Dict, Tuple

from deltafl_jax.algorithms import afl, afl_qffl, deltafl, fedavg, fedavg_sub, fedprox, qffl, term
from deltafl_jax.algorithms import deltafl_alt, scaffold
from deltafl_jax.algorithms.spec import AlgorithmSpec, Sweep
from deltafl_jax.errors import ConfigError

SPECS: Dict[str, AlgorithmSpec] = {spec.name: spec for spec in (
    deltafl.SPEC,
    fedavg.SPEC,
    fedavg_sub.SPEC,
    fedprox.SPEC,
    qffl.SPEC,
    afl_qffl.SPEC,
    afl.SPEC,
    term.SPEC,
    deltafl_alt.SPEC,
    scaffold.SPEC,
)}


def names() -> Tuple[str, ...]:
    return tuple(sorted(SPECS))


def get(name: str) -> AlgorithmSpec:
    """The spec called `name`; ConfigError naming the choices otherwise."""
    if name not in SPECS:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(names())}")
    return SPECS[name]


def sweeps() -> Tuple[Sweep, ...]:
    """Every swept flag of every spec, once each (the command line declares them)."""
    seen: Dict[str, Sweep] = {}
    for spec in SPECS.values():
        for sweep in spec.sweeps():
            seen.setdefault(sweep.flag, sweep)
    return tuple(seen.values())
