"""The registry: every algorithm's spec, by name. It collects specs and validates names; what an
algorithm is lives in its own module (see docs/guides/add-algorithm.md).

Replicas of the theta-swept algorithms (deltafl, fedavg, fedavg_sub) are labelled by theta;
the other baselines by their swept flag (``param_name`` = the flag, ``param_value`` = the
value, e.g. ``load_model(out, qffl_q=1.0, seed=1)``).
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

from deltafl_jax.algorithms import afl, afl_qffl, deltafl, fedavg, fedavg_sub, fedprox, qffl, term
from deltafl_jax.algorithms import (apfl, deltafl_alt, ditto, drfa, feddyn, fedmgda, gifair,
                                    propfair, scaffold)
from deltafl_jax.algorithms import buffered, fedau, fednova, fedvarp, mifa
from deltafl_jax.algorithms.options import Sweep, option_flags
from deltafl_jax.algorithms.spec import AlgorithmSpec
from deltafl_jax.declared import Flag, unique
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
    ditto.SPEC,
    feddyn.SPEC,
    apfl.SPEC,
    gifair.SPEC,
    fedmgda.SPEC,
    drfa.SPEC,
    propfair.SPEC,
    fedau.SPEC,
    fedau.KNOWN_PROB,
    mifa.SPEC,
    fedvarp.SPEC,
    fednova.SPEC,
    *buffered.SPECS,   # the buffered asynchronous rules, found in their package
)}

# Layers over any algorithm, named after '+' in a method name (``deltafl+ditto``): a
# personalisation layer turns a spec into the spec of the layered method.
LAYERS = {ditto.LAYER: ditto.personalized}
# The swept flags each layer adds to the method it goes over.
LAYER_SWEEPS = {ditto.LAYER: (ditto.LAMBDA_SWEEP,)}


def names() -> Tuple[str, ...]:
    return tuple(sorted(SPECS))


def layers() -> Tuple[str, ...]:
    return tuple(sorted(LAYERS))


def _layered(name: str) -> Optional[AlgorithmSpec]:
    """The spec of `name`: a registered one, or BASE+LAYER (a layer over a registered one)."""
    if name in SPECS:
        return SPECS[name]
    base, plus, layer = name.partition("+")
    if plus and base in SPECS and layer in LAYERS and not _clash(base, layer) and \
            SPECS[base].asynchronous is None:
        if name not in _COMPOSED:
            _COMPOSED[name] = LAYERS[layer](SPECS[base])
        return _COMPOSED[name]
    return None


_COMPOSED: Dict[str, AlgorithmSpec] = {}


def _clash(base: str, layer: str) -> Tuple[str, ...]:
    """The swept flags that `layer` adds and `base` sweeps already (the layer over a method that
    is that layer already: ditto+ditto); () when the layer can go over it."""
    own = {s.flag for s in SPECS[base].sweeps()}
    return tuple(s.flag for s in LAYER_SWEEPS[layer] if s.flag in own)


def get(name: str) -> AlgorithmSpec:
    """The spec called `name` (or BASE+LAYER); ConfigError naming the choices otherwise."""
    spec = _layered(name)
    base, plus, layer = name.partition("+")
    if spec is None and plus and base in SPECS and layer in LAYERS and \
            SPECS[base].asynchronous is not None:
        raise ConfigError(f"{name!r} puts the {layer} layer over {base}, which is "
                          f"asynchronous; a layer goes over an algorithm of synchronous rounds")
    if spec is None and plus and base in SPECS and layer in LAYERS:
        flags = ", ".join(f"--{f}" for f in _clash(base, layer))
        raise ConfigError(f"{name!r} puts the {layer} layer over {base}, which sweeps {flags} "
                          f"already; run {base} alone, or +{layer} over another algorithm "
                          f"(e.g. deltafl+{layer})")
    if spec is None:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(names())}, "
                          f"optionally +{' / +'.join(layers())}")
    return spec


def find(name: str) -> Optional[AlgorithmSpec]:
    """The spec called `name` (or BASE+LAYER), or None (e.g. an older run's algorithm that is
    gone)."""
    return _layered(name)


def sweeps() -> Tuple[Sweep, ...]:
    """Every swept flag of every spec, once each (the command line declares them)."""
    seen: Dict[str, Sweep] = {}
    for spec in SPECS.values():
        for sweep in spec.sweeps():
            seen.setdefault(sweep.flag, sweep)
    return tuple(seen.values())


def collect_options(specs: Iterable[AlgorithmSpec]) -> Tuple[Tuple[str, Flag], ...]:
    """(flag, declaration) of every option of the specs, once per flag, in order. TypeError
    (:func:`deltafl_jax.declared.unique`, the one check of flag declarations) when two specs
    declare one flag differently (they must share one :class:`Option`) or an option's flag is
    a swept flag."""
    specs = tuple(specs)
    options = [(f"{spec.name}'s options", flag) for spec in specs
               for flag in option_flags(spec.options_type)]
    swept = [(f"{spec.name}'s --{sweep.flag} sweep", sweep.declaration()) for spec in specs
             for sweep in spec.sweeps()]
    names = {flag.name for _, flag in options}
    return tuple((flag.name, flag) for _, flag in unique(options + swept) if flag.name in names)


OPTIONS = collect_options(SPECS.values())


def options() -> Tuple[Tuple[str, Flag], ...]:
    """Every option of every spec, once per flag, with its declaration (the command line
    declares them)."""
    return OPTIONS
