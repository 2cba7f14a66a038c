"""The replica grid a run's configuration asks of an algorithm: its swept values x the values of
its crossed sweeps x the --server_lr values x the DP values x the seeds, as the
:class:`~deltafl_jax.replicas.ReplicaGrid` that :mod:`deltafl_jax.replicas` builds.

`spec` is the algorithm's :class:`~deltafl_jax.algorithms.spec.AlgorithmSpec` (its active sweep,
its values, its labels and hyper-parameters); `config` the run's
:class:`~deltafl_jax.config.ExperimentConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, Tuple

from deltafl_jax.replicas import GridPoint, ReplicaGrid


def grid_for(spec, config, dp_noise: Sequence[float] = (0.0,)) -> ReplicaGrid:
    """The sweep values (x the grid's `cross` values x the --server_lr values x the DP values,
    whose noise multipliers `dp_noise` are) x seeds, with the config's schedule and
    per-value L2."""
    sweep = spec.active_sweep(config)
    values = spec.sweep_values(config)
    l2s = config.l2_for(len(values))
    points = tuple(
        GridPoint(label=dataclasses.replace(spec.label(v, sweep), extra=extra + more),
                  hyper=spec.hyper_for(v, sweep, **overrides), l2=l2,
                  learning_rate=config.training.learning_rate, lr_decay=config.training.lr_decay,
                  lr_decay_every=config.training.lr_decay_every, server_lr=eta, dp_noise=z)
        for v, l2 in zip(values, l2s) for overrides, extra in crossed(spec, config)
        for eta, z, more in platform_values(config, dp_noise))
    return ReplicaGrid(points=points, seeds=tuple(config.training.seeds))


def crossed(spec, config) -> Tuple[Tuple[Mapping[str, float], Tuple], ...]:
    """(hyper overrides, extra label coordinates) for each combination of the values of the
    spec's `grid.cross` sweeps (one empty combination when there are none)."""
    combos: Tuple[Tuple[Mapping[str, float], Tuple], ...] = (({}, ()),)
    for c in spec.grid.cross:
        values = c.check(config.sweep(c.flag)) or c.default
        combos = tuple(({**o, c.field: v}, e + ((c.flag, v),))
                       for o, e in combos for v in values)
    return combos


def platform_values(config, dp_noise: Sequence[float] = (0.0,)
                    ) -> Tuple[Tuple[float, float, Tuple], ...]:
    """(eta, z, extra label coordinates) for each --server_lr value x each DP value
    (`dp_noise`: the noise multiplier of each value of the config's DP sweep, calibrated
    already); the label names the server learning rate and the DP value only when
    several are trained."""
    lrs = tuple(config.server.learning_rates)
    (flag, given), = config.privacy.swept
    if len(given) != len(dp_noise):
        raise ValueError(f"{len(dp_noise)} noise multipliers for {len(given)} --{flag} values")
    return tuple((eta, z, ((("server_lr", eta),) if len(lrs) > 1 else ())
                  + (((flag, g),) if len(given) > 1 else ()))
                 for eta in lrs for g, z in zip(given, dp_noise))
