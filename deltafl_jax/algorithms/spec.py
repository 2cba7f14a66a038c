"""What an algorithm is to the rest of the package: its :class:`AlgorithmSpec`.

An algorithm module exports one :class:`AlgorithmSpec`: its name and display name, its factory
of the round's pure functions (:class:`~deltafl_jax.algorithms.protocol.FederatedAlgorithm`),
its hyper NamedTuple, its swept hyper-parameter
(:class:`~deltafl_jax.algorithms.options.Sweep`: flag, default grid, symbol, how replicas are
labelled), its options (a settings group of :mod:`deltafl_jax.declared`: a frozen dataclass of
``setting(...)`` fields, one scalar flag each, the same for every replica), and three small
records, each with defaults that fit most algorithms: its :class:`Grid` (fixed hyper fields,
crossed sweeps, the values it trains), its :class:`Clients` (full participation, a cohort of
varying size, forced local steps) and its :class:`Reporting` (the report's column names, the
tail leaderboard). The registry only collects specs.

Where the rest lives: the round's protocol in :mod:`deltafl_jax.algorithms.protocol`, options
and sweeps in :mod:`deltafl_jax.algorithms.options`, the report's column names in
:mod:`deltafl_jax.algorithms.naming`, the replica grid of a run in
:func:`deltafl_jax.replicas.labels.grid_for`. The names an algorithm module needs (``FederatedAlgorithm``,
``Sweep``, ``Option``, ``setting``, ``Bounds``, ``average_delta``, ...) can also be imported
from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Tuple

# Beside its own imports, the names an algorithm module needs, from their homes.
from deltafl_jax.algorithms.options import (NoOptions, Option, Sweep, build_options,
                                            check_options, option_flags, stored_options)
from deltafl_jax.algorithms.protocol import (ClientFeedback, FederatedAlgorithm,
                                             PrivateAggregate, apply_delta, average_delta,
                                             no_state, scaled_delta)
from deltafl_jax.declared import Bounds, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.replicas.labels import ReplicaLabel


@dataclasses.dataclass(frozen=True)
class Grid:
    """The replicas a run of the algorithm trains beyond its one swept hyper-parameter.

    fixed: values of the other hyper fields, the same for every replica (the hyper fields
      that the active sweep and `cross` do not set take their value from here).
    values: optional (config, swept values from the flag) -> values to train, for specs whose
      grid depends on other settings (FedAvg is theta = 1; FedAvg-Sub reads --thetas).
    alt_sweep: optional second sweep, used instead of the spec's `sweep` when its flag lists
      values (FedAvg-Sub: fixed client counts instead of the counts Delta-FL keeps at theta).
    cross: further sweeps crossed with the active one (deltafl_alt: theta x T_eta); each of
      their values becomes an extra coordinate of the replica labels (``extra``, as the
      tuner's grids), e.g. ``theta=0.5_eta_every=5_seed=1``.
    fixed_sweep: the spec trains one value of its sweep whatever the flag lists (FedAvg:
      theta = 1); beside other methods in one run it does not read that flag's values, which
      are the others' grid.
    tunes_l2: the tuner's lambda step applies: the spec's replicas are Delta-FL at the
      theta of its sweep (FedAvg: 1), and the lambda grid trains Delta-FL at each of them.
    """

    fixed: Mapping[str, float] = dataclasses.field(default_factory=dict)
    values: Optional[Callable[[Any, Tuple[float, ...]], Tuple[float, ...]]] = None
    alt_sweep: Optional[Sweep] = None
    cross: Tuple[Sweep, ...] = ()
    fixed_sweep: bool = False
    tunes_l2: bool = False


@dataclasses.dataclass(frozen=True)
class Clients:
    """How the clients take part in a round and what their local work is.

    full_participation: every training client takes part in every round (m = N).
    variable_cohort: its round takes a cohort of varying size (--client_sampling=poisson):
      empty slots (size 0) get weight 0 and count in none of its sums or normalisations.
    takes_probabilities: its factory takes ``probabilities=`` [N], each training client's
      probability of taking part in a round under the run's availability and sampler
      (:func:`deltafl_jax.run.resolve.participation_probabilities`), passed by
      :meth:`AlgorithmSpec.make`.
    local_steps: force this many local steps (None: the run's --local_epochs/--local_steps).
    local_work: the cost of one local minibatch step of a client relative to FedAvg's (one
      model's gradient step): 2 for a client that steps a personal model beside the global
      one (Ditto, APFL). A hint for projected estimates
      (:meth:`AlgorithmSpec.expected_work`), never used by the round itself.
    """

    full_participation: bool = False
    variable_cohort: bool = False
    takes_probabilities: bool = False
    local_steps: Optional[int] = None
    local_work: float = 1.0

    @property
    def fixed_cohort(self) -> bool:
        """Its round needs a cohort of fixed size (m clients, or all N with
        `full_participation`): a sampler or an availability model that varies it is refused."""
        return self.full_participation or not self.variable_cohort


@dataclasses.dataclass(frozen=True)
class Reporting:
    """How the report and the tail leaderboard name and run the algorithm.

    column_name: optional (label, options, name) -> the report's name of a column, given the
      default name ('display_name, symbol = value') and the run's options (Delta-FL at
      theta = 1 is "FedAvg"; its reference filter is named).
    names_value: a report column names the swept value ('q-FFL, q = 10'); False: the spec
      trains one model, named by its display name alone (FedAvg, SCAFFOLD: theta = 1).
    leaderboard: how the tail leaderboard runs it
      (:class:`~deltafl_jax.algorithms.leaderboard.Board`); None: not on it.
    """

    column_name: Optional[Callable[[ReplicaLabel, Any, str], str]] = None
    names_value: bool = True
    leaderboard: Any = None


_RECORDS = (("grid", Grid), ("clients", Clients), ("reporting", Reporting))


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """Everything the rest of the package needs to know about one algorithm.

    name: registry name (``--algorithm``).
    display_name: how reports name it ("Δ-FL", "q-FFL").
    help: one line for ``--help`` and the README.
    factory: (config, data, options) -> :class:`FederatedAlgorithm`; data is the
      FederatedDataset (AFL keeps lambda over its training clients), options the spec's
      typed options (:meth:`options_for`). :meth:`make` calls it.
    hyper: the NamedTuple type of the per-replica hyper-parameters.
    sweep: the swept hyper-parameter.
    options_type: its options, a settings group (a frozen dataclass of
      :func:`~deltafl_jax.declared.setting` fields, or a shared :class:`Option`'s
      ``field()``: the flag, default, help, choices and bounds written on the field, e.g.
      ``--filter``), built from ``config.options``; :class:`NoOptions` for none. An options
      class may define ``check()`` for checks across its fields (ConfigError naming the
      flag).
    validate: optional (config) -> None, raising ConfigError, for checks beyond :meth:`Sweep.check`.
    cautions: optional (config, replicas) -> lines, one per setting of the run past a
      stability bound that the algorithm knows (Ditto's proximal step: eta (lambda + l2)
      >= 2 with SGD); the runner prints each as a warning before the first round
      (:meth:`warnings`). `replicas`: the run's :class:`~deltafl_jax.replicas.labels.Replicas`.
    own_server_step: why the server step is the algorithm's own (non-empty: it refuses a
      server optimizer other than the default w + Delta); empty: the round's server optimizer
      applies to its Delta. A list of --server_lr values is crossed like the grid's `cross`,
      after it (``theta=0.5_server_lr=0.03_seed=1``).
    dp_requires: for an algorithm with a private version (--dp_clip), what its options must
      be for it (the one line of the refusal otherwise); empty: it has none.
    asynchronous: the server step of buffered asynchronous aggregation
      (:class:`deltafl_jax.asynchronous.rule.AsyncStep`: FedBuff, FedAsync, ...); the run then
      steps the server whenever K updates have arrived (:mod:`deltafl_jax.run.buffered`)
      instead of running synchronous rounds; None: synchronous rounds (`factory`'s).
    grid: the replicas beyond the sweep (:class:`Grid`: fixed hyper fields, crossed sweeps,
      the values it trains).
    clients: how clients take part (:class:`Clients`: full participation, a cohort of
      varying size, forced local steps).
    reporting: how reports name it (:class:`Reporting`: column names, the leaderboard).
    """

    name: str
    display_name: str
    help: str
    factory: Callable[..., FederatedAlgorithm]   # (config, data, options[, probabilities=])
    hyper: Any                                   # a NamedTuple class
    sweep: Sweep
    options_type: type = NoOptions
    validate: Optional[Callable[[Any], None]] = None
    cautions: Optional[Callable[[Any, Any], Tuple[str, ...]]] = None
    own_server_step: str = ""
    dp_requires: str = ""
    asynchronous: Any = None
    grid: Grid = dataclasses.field(default_factory=Grid)
    clients: Clients = dataclasses.field(default_factory=Clients)
    reporting: Reporting = dataclasses.field(default_factory=Reporting)

    def __post_init__(self):
        option_flags(self.options_type)   # TypeError unless a group of declared settings
        for field, record in _RECORDS:
            if not isinstance(getattr(self, field), record):
                raise TypeError(f"spec {self.name}: {field} must be a {record.__name__}, got "
                                f"{type(getattr(self, field)).__name__}")
        fields = set(self.hyper._fields)
        fixed = self.grid.fixed
        crossed = {c.field for c in self.grid.cross}
        for sweep in self.primary_sweeps():
            missing = fields - {sweep.field} - set(fixed) - crossed
            if sweep.field not in fields or missing or not crossed <= fields:
                raise TypeError(f"spec {self.name}: hyper fields {sorted(fields)} must be the "
                                f"swept field {sweep.field!r} and the fixed ones "
                                f"{sorted(fixed)}")

    def primary_sweeps(self) -> Tuple[Sweep, ...]:
        """The sweep and the alternative one: the sweeps that name the replicas."""
        alt = self.grid.alt_sweep
        return (self.sweep,) + ((alt,) if alt is not None else ())

    def sweeps(self) -> Tuple[Sweep, ...]:
        """Every sweep whose flag this spec reads (for the command line)."""
        return self.primary_sweeps() + tuple(self.grid.cross)

    def active_sweep(self, config) -> Sweep:
        alt = self.grid.alt_sweep
        return alt if alt is not None and config.sweep(alt.flag) else self.sweep

    def sweep_values(self, config) -> Tuple[float, ...]:
        sweep = self.active_sweep(config)
        given = sweep.check(config.sweep(sweep.flag))
        if self.grid.values is not None and sweep is self.sweep:
            return tuple(self.grid.values(config, given))
        return given or sweep.default

    def reads(self) -> Tuple[str, ...]:
        """Every flag of its own: its sweeps' and its options'."""
        return tuple(s.flag for s in self.sweeps()) + self.option_flags()

    def option_flags(self) -> Tuple[str, ...]:
        """The flags of its options, in order."""
        return tuple(flag.name for flag in option_flags(self.options_type))

    def options_for(self, config):
        """Its typed options from ``config.options`` (defaults for the flags not given),
        checked: ConfigError naming the flag at fault."""
        return build_options(self.options_type, config.options)

    def stored_options(self, run_config: Optional[Mapping[str, Any]]):
        """Its typed options as a finished run's configuration holds them (summary.json's
        ``config``: ``options``; runs written before options had their own mapping hold them
        at the top level), unchecked."""
        return stored_options(self.options_type, run_config)

    def make(self, config, data, probabilities=None) -> FederatedAlgorithm:
        """The algorithm of a run: the factory with the config's typed options, and with
        `probabilities` [N] (each client's probability of taking part in a round) when it
        takes them (`clients.takes_probabilities`) and they are given."""
        if self.clients.takes_probabilities and probabilities is not None:
            return self.factory(config, data, self.options_for(config),
                                probabilities=probabilities)
        return self.factory(config, data, self.options_for(config))

    def sweep_of(self, label: ReplicaLabel) -> Optional[Sweep]:
        """The primary sweep whose value names the label (None: a label it does not make)."""
        name, _ = label.swept()
        return next((s for s in self.primary_sweeps() if s.coordinate == name), None)

    def warnings(self, config, replicas) -> Tuple[str, ...]:
        """The lines of its `cautions` for a run of `config` training `replicas`; () when it
        declares none."""
        return tuple(self.cautions(config, replicas)) if self.cautions is not None else ()

    def expected_work(self, label: ReplicaLabel) -> float:
        """The expected local work of a replica's sampled clients in a round relative to
        FedAvg's (every sampled client taking its steps of one model): `clients.local_work` x the
        label's theta, the share of the sampled clients' weight that trains (Delta-FL's
        filter keeps the mass theta; theta = 1 for a method that trains every sampled
        client). With weights proportional to n_k, and n_k independent of the losses, that
        is also the expected share of their local steps."""
        return float(self.clients.local_work) * min(max(float(label.theta), 0.0), 1.0)

    def check(self, config) -> None:
        self.sweep_values(config)
        self.options_for(config)
        if self.own_server_step and not config.server.is_default:
            raise ConfigError(f"--algorithm={self.name} takes no --server_optimizer or "
                              f"--server_lr: {self.own_server_step}")
        if self.validate is not None:
            self.validate(config)

    def label(self, value: float, sweep: Optional[Sweep] = None) -> ReplicaLabel:
        sweep = sweep or self.sweep
        if sweep.labelled_by_theta:
            return ReplicaLabel(self.name, float(value), -1)
        return ReplicaLabel(self.name, float(self.grid.fixed.get("theta", 1.0)), -1,
                            param_name=sweep.flag, param_value=float(value))

    def hyper_for(self, value: float, sweep: Optional[Sweep] = None, **overrides: float):
        sweep = sweep or self.sweep
        values = {**self.grid.fixed, sweep.field: float(value), **overrides}
        return self.hyper(**{f: float(values[f]) for f in self.hyper._fields})
