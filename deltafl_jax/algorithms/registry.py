"""The registry: every algorithm's spec, by name. It collects specs and validates names; what an
algorithm is lives in its own module (see README, "Adding an algorithm").

Replicas of the theta-swept algorithms (deltafl, fedavg, fedavg_sub) are labelled by theta;
the other baselines by their swept flag (``param_name`` = the flag, ``param_value`` = the
value, e.g. ``load_model(out, qffl_q=1.0, seed=1)``).
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

from deltafl_jax.algorithms import afl, afl_qffl, deltafl, fedavg, fedavg_sub, fedprox, qffl, term
from deltafl_jax.algorithms import deltafl_alt, fedmgda, gifair, scaffold
from deltafl_jax.algorithms.spec import AlgorithmSpec, Option, Sweep, declared_options
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
    gifair.SPEC,
    fedmgda.SPEC,
)}


def names() -> Tuple[str, ...]:
    return tuple(sorted(SPECS))


def get(name: str) -> AlgorithmSpec:
    """The spec called `name`; ConfigError naming the choices otherwise."""
    if name not in SPECS:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(names())}")
    return SPECS[name]


def find(name: str) -> Optional[AlgorithmSpec]:
    """The spec called `name`, or None (e.g. an older run's algorithm that is gone)."""
    return SPECS.get(name)


def sweeps() -> Tuple[Sweep, ...]:
    """Every swept flag of every spec, once each (the command line declares them)."""
    seen: Dict[str, Sweep] = {}
    for spec in SPECS.values():
        for sweep in spec.sweeps():
            seen.setdefault(sweep.flag, sweep)
    return tuple(seen.values())


def collect_options(specs: Iterable[AlgorithmSpec]) -> Tuple[Tuple[str, Option], ...]:
    """(flag, Option) of every option of the specs, once per flag, in order. TypeError when two
    specs declare one flag with different Options (they must share one definition) or an
    option's flag is a swept flag."""
    specs = tuple(specs)
    swept = {s.flag for spec in specs for s in spec.sweeps()}
    seen: Dict[str, Option] = {}
    for spec in specs:
        for flag, option in declared_options(spec.options_type):
            if flag in swept:
                raise TypeError(f"spec {spec.name}: option --{flag} is also a swept flag")
            if seen.setdefault(flag, option) != option:
                raise TypeError(f"spec {spec.name} declares the option --{flag} differently "
                                f"from another spec ({option} against {seen[flag]}); share "
                                "one Option")
    return tuple(seen.items())


OPTIONS = collect_options(SPECS.values())


def options() -> Tuple[Tuple[str, Option], ...]:
    """Every option of every spec, once per flag (the command line declares them)."""
    return OPTIONS
