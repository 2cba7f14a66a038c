"""Replicas: the models that one compiled program trains side by side, and their typed labels.

A replica is one model being trained: a point of a grid (a conformity level theta, or a
baseline's swept value such as q-FFL's q, or a tuning grid's learning rate / L2) times a
seed. Replicas are stacked on a leading axis [R] (vmapped, paper Sec. 5: every theta trained at
once), so each carries its own hyper-parameters, its own L2 weight lambda and its own
learning-rate schedule gamma_t = gamma_0 c^-floor(t / t_0) (App. C.2.2).

- :class:`ReplicaLabel` names a replica: ``key()`` for file names, ``display()`` for people,
  ``to_json()`` / ``from_json()`` for ``metrics.jsonl``, ``summary.json`` and ``load_model``.
- :class:`ReplicaNames` is what the run loop and its callbacks get of the labels: the keys, the
  methods' column names and the labels' JSON, strings and indices only.
- :class:`GridPoint` is one point of a grid, :class:`ReplicaGrid` the points x seeds, and
  :meth:`ReplicaGrid.build` gives the :class:`Replicas` that the round function consumes.
- :func:`grid_for` is the grid a run's configuration asks of an algorithm: its swept values x
  the values of its crossed sweeps x the ``--server_lr`` values x the DP values x the seeds
  (`spec` the algorithm's :class:`~deltafl_jax.algorithms.spec.AlgorithmSpec`, `config` the
  run's :class:`~deltafl_jax.run.config.ExperimentConfig`).

Replicas are value-major and seed-minor (theta 1.0 seeds 1..S, then theta 0.8, ...); replicas
that share a seed share the sampled clients and the minibatches (paired comparisons).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np


def learning_rate_schedule(lr: float, decay: float, every: int):
    """gamma_t = gamma_0 * c^-(t // t0) (paper, App. C.2.2, with c the divisor), built from
    optax schedules; constant when c = 1 or t0 = 0."""
    import optax

    if decay == 1.0 or every <= 0:
        return optax.constant_schedule(lr)
    return optax.exponential_decay(init_value=lr, transition_steps=every,
                                   decay_rate=1.0 / decay, staircase=True)


def _fmt(v: float) -> str:
    return f"{v:g}"


@dataclasses.dataclass(frozen=True)
class ReplicaLabel:
    """What a replica is, as written to every output.

    algorithm: the algorithm's registry name.
    theta: its conformity level (1.0 for the baselines that have none).
    seed: its seed.
    param_name / param_value: a baseline's swept flag and value (e.g. "qffl_q", 0.1); None for
      the theta-swept algorithms.
    extra: further grid coordinates in order, e.g. (("learning_rate", 0.1), ("lr_decay", 2.0))
      for the tuner's grids.
    """

    algorithm: str
    theta: float
    seed: int
    param_name: Optional[str] = None
    param_value: Optional[float] = None
    extra: Tuple[Tuple[str, float], ...] = ()

    def swept(self) -> Tuple[str, float]:
        """(name, value) of the swept hyper-parameter: ("theta", 0.5) or ("qffl_q", 0.1)."""
        if self.param_name is not None:
            return self.param_name, float(self.param_value)
        return "theta", float(self.theta)

    def key(self) -> str:
        """File-name key, e.g. 'theta=0.5_seed=1', 'qffl_q=0.1_seed=1' or
        'theta=1_learning_rate=0.1_lr_decay=2_seed=1'."""
        name, value = self.swept()
        parts = [f"{name}={_fmt(value)}"] + [f"{n}={_fmt(v)}" for n, v in self.extra]
        return "_".join(parts + [f"seed={self.seed}"])

    def display(self) -> str:
        """Short text for progress lines and tables, e.g. 'θ=0.5 seed 1'."""
        name, value = self.swept()
        head = "θ" if name == "theta" else name
        parts = [f"{head}={_fmt(value)}"] + [f"{n}={_fmt(v)}" for n, v in self.extra]
        return " ".join(parts + [f"seed {self.seed}"])

    def coordinates(self, theta: str = "θ", names_value: bool = True) -> str:
        """Its coordinates as progress lines show them: 'θ=0.5', 'qffl_q=0.1', 'θ=0.5
        server_lr=0.03'. Without `names_value` (an algorithm that trains one model whatever
        its sweep, whose spec does not name the swept value: FedAvg, SCAFFOLD) only the
        further coordinates ('' when none): its θ = 1 is no choice of the user's. `theta`: how
        θ is written ("theta" in a multi-method run's closing table)."""
        extra = " ".join(f"{n}={v:g}" for n, v in self.extra)
        if not names_value:
            return extra
        name, value = self.swept()
        head = theta if name == "theta" else name
        return " ".join(p for p in (f"{head}={value:g}", extra) if p)

    def column_name(self, display_name: str, names_value: bool = True) -> str:
        """The name of its method's column in progress lines: :meth:`coordinates`, or the
        algorithm's `display_name` before them when its spec does not name the swept value
        ('SCAFFOLD', 'FedAvg server_lr=0.1')."""
        coords = self.coordinates(names_value=names_value)
        if not names_value:
            return " ".join(p for p in (display_name, coords) if p)
        return coords

    def method_key(self) -> Tuple:
        """Everything but the seed (algorithm, swept value, grid coordinates): replicas with
        equal method keys are seeds of one method, one column of the report's tables."""
        return (self.algorithm, self.swept(), self.extra)

    def to_json(self) -> Dict[str, Any]:
        """Ordered dict: algorithm, theta, [param_name, param_value], extra..., seed."""
        out: Dict[str, Any] = {"algorithm": self.algorithm, "theta": float(self.theta)}
        if self.param_name is not None:
            out["param_name"] = self.param_name
            out["param_value"] = float(self.param_value)
        for n, v in self.extra:
            out[n] = float(v)
        out["seed"] = int(self.seed)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ReplicaLabel":
        known = ("algorithm", "theta", "seed", "param_name", "param_value", "key")
        extra = tuple((k, float(v)) for k, v in d.items()
                      if k not in known and isinstance(v, (int, float)) and not isinstance(v, bool))
        return cls(algorithm=str(d.get("algorithm", "deltafl")), theta=float(d.get("theta", 1.0)),
                   seed=int(d["seed"]), param_name=d.get("param_name"),
                   param_value=(None if d.get("param_value") is None
                                else float(d["param_value"])),
                   extra=extra)

    def matches(self, theta: Optional[float] = None, seed: Optional[int] = None,
                **params: float) -> bool:
        """True when every given coordinate equals this label's (floats compared with
        math.isclose); e.g. matches(theta=0.5, seed=1) or matches(qffl_q=0.1)."""
        if theta is not None and not math.isclose(self.theta, theta, rel_tol=1e-6, abs_tol=1e-12):
            return False
        if seed is not None and self.seed != int(seed):
            return False
        coords = dict(self.extra)
        if self.param_name is not None:
            coords[self.param_name] = self.param_value
        for name, value in params.items():
            if name not in coords or not math.isclose(coords[name], value, rel_tol=1e-6,
                                                       abs_tol=1e-12):
                return False
        return True


@dataclasses.dataclass(frozen=True, eq=False)
class Replicas:
    """The R replicas of one program, as the round function consumes them.

    group: [R] int32, the seed index of each replica: its seed's position in the run's seed
      list, which picks the replica's clients and batches in the round plan (the plan is
      drawn once per seed and shared by the replicas of that seed). In this package "group"
      means only this; a method across seeds is a ``method_key``, and one program per seed is
      :mod:`deltafl_jax.replicas.seed_programs`.
    hyper: the algorithm's hyper-parameter pytree (a NamedTuple), leaves float32 [R].
    l2: [R] float32, the L2 weight lambda of each replica.
    schedules: R optax schedules, round -> client learning rate.
    labels: R :class:`ReplicaLabel`.
    server_lr: [R] float32, the server optimizer's learning rate eta of each replica.
    dp_noise: [R] float32, the DP noise multiplier z of each replica (0 without DP).
    """

    group: np.ndarray
    hyper: Any
    l2: np.ndarray
    schedules: Tuple[Callable, ...]
    labels: Tuple[ReplicaLabel, ...]
    server_lr: Optional[np.ndarray] = None
    dp_noise: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.server_lr is None:
            object.__setattr__(self, "server_lr", np.ones(self.group.shape, np.float32))
        if self.dp_noise is None:
            object.__setattr__(self, "dp_noise", np.zeros(self.group.shape, np.float32))

    @property
    def size(self) -> int:
        return int(self.group.size)


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One grid point, trained once per seed.

    label: its label (the seed is filled in per replica).
    hyper: the algorithm's hyper-parameters, a NamedTuple of Python floats.
    l2: lambda. learning_rate, lr_decay, lr_decay_every: its schedule.
    server_lr: the server optimizer's learning rate eta.
    dp_noise: the DP noise multiplier z (0: none).
    """

    label: ReplicaLabel
    hyper: Any
    l2: float
    learning_rate: float
    lr_decay: float = 1.0
    lr_decay_every: int = 0
    server_lr: float = 1.0
    dp_noise: float = 0.0


@dataclasses.dataclass(frozen=True)
class ReplicaGrid:
    """Grid points x seeds, value-major."""

    points: Tuple[GridPoint, ...]
    seeds: Tuple[int, ...]

    def build(self) -> Replicas:
        if not self.points:
            raise ValueError("a replica grid needs at least one point")
        kinds = {type(p.hyper) for p in self.points}
        if len(kinds) != 1:
            raise ValueError(f"grid points mix hyper-parameter types: {sorted(map(str, kinds))}")
        groups, hypers, l2s, schedules, labels, server_lrs, noise = [], [], [], [], [], [], []
        for point in self.points:
            schedule = learning_rate_schedule(point.learning_rate, point.lr_decay,
                                              point.lr_decay_every)
            for g, seed in enumerate(self.seeds):
                groups.append(g)
                hypers.append(point.hyper)
                l2s.append(point.l2)
                schedules.append(schedule)
                server_lrs.append(point.server_lr)
                noise.append(point.dp_noise)
                labels.append(dataclasses.replace(point.label, seed=int(seed)))
        hyper_type = type(self.points[0].hyper)
        hyper = hyper_type(*(np.asarray([h[i] for h in hypers], np.float32)
                             for i in range(len(hyper_type._fields))))
        return Replicas(group=np.asarray(groups, np.int32), hyper=hyper,
                        l2=np.asarray(l2s, np.float32), schedules=tuple(schedules),
                        labels=tuple(labels), server_lr=np.asarray(server_lrs, np.float32),
                        dp_noise=np.asarray(noise, np.float32))


def labels_by_method(labels: Iterable[ReplicaLabel]) -> Dict[Tuple, list]:
    """Replica indices per method key (all seeds of one grid point), in first-seen order."""
    out: Dict[Tuple, list] = {}
    for r, lab in enumerate(labels):
        out.setdefault(lab.method_key(), []).append(r)
    return out


@dataclasses.dataclass(frozen=True)
class ReplicaNames:
    """The replicas as the run loop and its callbacks name them: strings and replica indices,
    so that a callback never reads a hyper-parameter value to name a replica.

    keys: each replica's file key (:meth:`ReplicaLabel.key`), in replica order.
    columns: (name, replica indices: a list, which indexes [R] arrays) of each method, its
      seeds together, in first-seen order: the columns of the progress lines and of the
      closing table.
    records: each replica's label as the output files write it (:meth:`ReplicaLabel.to_json`:
      metrics.jsonl, summary.json's ``replicas``, models/index.json), copied as it is.
    """

    keys: Tuple[str, ...]
    columns: Tuple[Tuple[str, List[int]], ...]
    records: Tuple[Dict[str, Any], ...]

    def __len__(self) -> int:
        return len(self.keys)


def replica_names(labels: Sequence[ReplicaLabel], display_name: str,
                  names_value: bool = True) -> ReplicaNames:
    """The :class:`ReplicaNames` of one algorithm's `labels`; `display_name` and
    `names_value` are its spec's (:meth:`ReplicaLabel.column_name`)."""
    labels = tuple(labels)
    return ReplicaNames(
        keys=tuple(lab.key() for lab in labels),
        columns=tuple((labels[rs[0]].column_name(display_name, names_value), rs)
                      for rs in labels_by_method(labels).values()),
        records=tuple(lab.to_json() for lab in labels))


def aligned(values: Sequence[float], count: int, name: str) -> Tuple[float, ...]:
    """One value per sweep value: a single value is repeated; otherwise the lengths must match."""
    values = tuple(values)
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise ValueError(f"--{name} gives {len(values)} values for {count} swept values")
    return values


# --------------------------------------------------------------------------------------------
# The grid a run's configuration asks of an algorithm


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
