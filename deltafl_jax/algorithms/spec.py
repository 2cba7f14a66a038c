"""What an algorithm is: a factory of pure round functions plus the spec that describes it.

A round of every algorithm here has the same shape (Algorithm 2 of the Delta-FL paper; the
baselines of the CISS 2021 paper, Table I):

1. the engine computes each sampled client's loss F_k(w_t) on its whole training data (unless
   the algorithm declares that it does not use them: ``uses_losses=False``);
2. ``client_weights`` turns (F, n) into aggregation weights a_k >= 0; a_k = 0 means that the
   client does no local work (the Delta-FL filter, FedAvg-Sub's subset, ...);
3. the engine runs LocalUpdate on every client with a_k > 0: the algorithm's client update
   (``client_update``: ``init`` / ``step`` / ``client_final`` over a step state that the lanes
   carry, :mod:`deltafl_jax.engine.client`; by default minibatch SGD from w_t with the client
   optimizer) and returns the sums of a_k u_k over them, and each job's own results
   (:class:`ClientFeedback`);
4. ``server_update`` returns the aggregate Delta (and the algorithm's new state);
5. the round's server optimizer turns Delta into the new global model
   (:mod:`deltafl_jax.server_optimizer`: w + Delta by default).

The functions act on ONE replica; the round vmaps them over replicas. Hyper-parameters that may
differ between replicas (theta, q, t, mu, ...) arrive in ``hyper``, the algorithm's own typed
NamedTuple; the rest are captured when the factory builds the algorithm.

An algorithm module exports one :class:`AlgorithmSpec`: its name and display name, its factory,
its hyper NamedTuple, its swept hyper-parameter (:class:`Sweep`: flag, default grid, symbol, how
replicas are labelled), its options (a frozen dataclass of :class:`Option` fields: one scalar
flag each, the same for every replica), how the report names its columns, and any forced local
steps or full participation. The registry only collects specs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import optax

from deltafl_jax.engine import LOCAL_SGD, ClientUpdate
from deltafl_jax.server_optimizer import DISPLAY as SERVER_DISPLAY
from deltafl_jax.server_optimizer import SYMBOLS as SERVER_SYMBOLS
from deltafl_jax.server_optimizer import ServerOptimizer, from_run_config
from deltafl_jax.errors import ConfigError
from deltafl_jax.replicas import GridPoint, ReplicaGrid, ReplicaLabel

Params = Any
State = Any
PAPER_THETAS = (1.0, 0.8, 0.5, 0.1)


class ClientFeedback(NamedTuple):
    """What the server learns from one round, for one replica.

    losses: [m] F_k(w_t) of the sampled clients (with the L2 term when l2 > 0).
    sizes: [m] their example counts n_k.
    weights: [m] the a_k that ``client_weights`` returned.
    delta_sum: pytree, sum over trained clients with a finite update of a_k u_k (u_k the
      update that the client update returned: w_k - w_t for local SGD).
    weight_sum: [] sum of a_k over the same clients.
    job_sqnorm: [m] ||u_k||^2 of each trained client.
    job_finite: [m] the client trained and its update is finite.
    job_trained: [m] the client trained.
    learning_rate: [] this round's client learning rate.
    clients: [m] int32 ids of the sampled clients (indices into the training clients).
    client_outputs: pytree, leaves [m, ...]: what the client update's ``final`` returned as
      each trained client's output (None for an algorithm without one; zeros for clients that
      did not train; possibly NaN for a client whose update was not finite: mask with
      ``job_finite``).
    probe_losses: [m'] the losses F_i of the round's second, uniform sample of clients at the
      model that ``probe`` chose (None without a probe); probe_clients: [m'] their ids.
    """

    losses: jax.Array
    sizes: jax.Array
    weights: jax.Array
    delta_sum: Params
    weight_sum: jax.Array
    job_sqnorm: jax.Array
    job_finite: jax.Array
    job_trained: jax.Array
    learning_rate: jax.Array
    clients: Any = None
    client_outputs: Any = None
    probe_losses: Any = None
    probe_clients: Any = None


class PrivateAggregate(NamedTuple):
    """How an algorithm's average of the updates is made differentially private
    (:mod:`deltafl_jax.privacy`); the engine clips each update to --dp_clip C first.

    max_weight(hyper, m) -> a_max: the largest weight a_k one client can get (the sum's
      sensitivity is C a_max; the noise N(0, (z C a_max)^2 I) is added to it).
    denominator(hyper, m) -> D: the fixed denominator (DP-FedAvg's expected weight of a
      round); None: the kept weight sum_k a_k, released with noise N(0, (z a_max)^2) and
      floored at floor(hyper, m) when z > 0 (so that a round that keeps few clients does not
      divide the noise by a small number), at a_max without noise (the plain average).
    releases: the noise multipliers (noise std over the replace-one sensitivity), relative to
      z, of the round's further Gaussian releases (the model update's, 1/2, is not listed):
      what the accountant composes.
    client_weights: (state, losses, sizes, hyper, key, clients, z) -> [m] a_k under DP (None:
      the algorithm's own, which must not read the losses).
    add_remove_releases: the same releases' multipliers over their add-or-remove
      sensitivity (Poisson client sampling), in the same order.
    """

    max_weight: Callable[[Any, int], Any]
    denominator: Optional[Callable[[Any, int], Any]] = None
    releases: Tuple[float, ...] = ()
    client_weights: Optional[Callable[..., jax.Array]] = None
    floor: Optional[Callable[[Any, int], Any]] = None
    add_remove_releases: Tuple[float, ...] = ()


class FederatedAlgorithm(NamedTuple):
    """The pure functions of one algorithm (optax-style: built by a factory, never jitted here).

    init(params, hyper) -> state;
    client_weights(state, losses, sizes, hyper, key, clients) -> [m] a_k;
    server_update(state, params, feedback, hyper) -> (Delta, state, dict of scalar metrics):
      Delta, a pytree like params, is the aggregate that the round's server optimizer applies
      (w + Delta by default: :func:`average_delta` gives the weighted average of the updates);
    eval_params(state, params) -> the parameters to evaluate and save (None: params);
    uses_losses: client_weights or server_update read the losses F_k(w_t). False (FedAvg,
      FedProx): the round skips step 1, the evaluation of the sampled clients at w_t, and
      their losses arrive as NaN.

    The client's own problem (fedjax's ``for_each_client``):
    client_update: what each working client does with its local steps, a
      :class:`~deltafl_jax.engine.client.ClientUpdate` (init, step, final over a step state
      the lanes carry; default :data:`~deltafl_jax.engine.client.LOCAL_SGD`, the papers' local
      SGD with the run's client optimizer). FedProx adds its proximal gradient in ``step``,
      SCAFFOLD its control variates, Ditto trains a second model.
    client_state_init(params, hyper) -> ONE client's initial state; every training client of
      every replica starts from it (leaves [R, N, ...] in the round state), and ``final``'s
      new state is written back for the clients whose update is finite.
    all_sampled_work: every sampled client runs its client update, including those whose
      weight a_k is 0 (their update adds nothing, their own state still changes: Ditto over
      Delta-FL's personal models); False: only the clients with a_k > 0 work.

    Per-client models (personalisation; evaluated on each client's held-out data,
    ``--client_holdout``):
    client_model(server_state, client_state, params, hyper) -> the model served to a training
      client from its own state (Ditto: v_k; APFL: alpha_k v_k + (1 - alpha_k) w); params is
      the served global model. None: every client is served the global model.
    adapt_step(adapt_state, grad_fn, hyper, job) -> adapt_state: how a device adapts the
      model it was served on its own data before it is evaluated (``--finetune_steps``), over
      an :class:`~deltafl_jax.engine.client.AdaptState` (Ditto: its proximal step towards the
      served global model). None: plain fine-tuning with the client optimizer
      (:func:`~deltafl_jax.engine.client.fine_tune_step`).

    Sampling and probing (DRFA):
    sampling(state) -> [N] the probabilities with which the round draws its m clients (with
      replacement), from the replica's state; the host reads them after the previous round,
      and each replica then gets its own plan. None: the run's sampler (uniform, Poisson,
      cyclic).
    probe(state, params, feedback, hyper) -> a model at which the round evaluates a second
      sample of m clients drawn uniformly (independently of the first), whose losses reach
      ``server_update`` as ``feedback.probe_losses`` (DRFA: the average of the sampled
      clients' snapshot models). None: no second sample.

    private: how its average is made differentially private (:class:`PrivateAggregate`);
      None: it has no private version (with its options), and --dp_clip is refused.
    """

    name: str
    init: Callable[[Params, Any], State]
    client_weights: Callable[..., jax.Array]
    server_update: Callable[..., Tuple[Params, State, Mapping[str, jax.Array]]]
    eval_params: Optional[Callable[[State, Params], Params]] = None
    uses_losses: bool = True
    client_update: ClientUpdate = LOCAL_SGD
    client_state_init: Optional[Callable[[Params, Any], Any]] = None
    all_sampled_work: bool = False
    client_model: Optional[Callable[..., Params]] = None
    adapt_step: Optional[Callable[..., Any]] = None
    sampling: Optional[Callable[[State], jax.Array]] = None
    probe: Optional[Callable[..., Params]] = None
    private: Optional[PrivateAggregate] = None


def scaled_delta(params, delta_sum, total):
    """delta_sum / total in the dtype of params (zero when total is 0)."""
    scale = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return jax.tree.map(lambda w, d: (scale * d).astype(w.dtype), params, delta_sum)


def average_delta(params, feedback: ClientFeedback):
    """Delta = sum_k a_k (w_k - w) / sum_k a_k over the trained clients with a finite update;
    zero if there is none. The round's server step w + Delta (server optimizer ``sgd`` at
    learning rate 1) is the reference code's plain average of the local models."""
    return scaled_delta(params, feedback.delta_sum, feedback.weight_sum)


def apply_delta(params, delta):
    """w + Delta, as the round's default server step computes it (``optax.apply_updates``)."""
    return optax.apply_updates(params, delta)


def no_state(params, hyper):
    del params, hyper
    return ()


OPTION = "deltafl_jax.option"   # the metadata key of an options field's Option

# How the platform's replica coordinates read in a report column.
PLATFORM_SYMBOLS = {"server_lr": "η_s", "dp_target_epsilon": "ε", "dp_noise_multiplier": "z"}


def _dp_parts(label: ReplicaLabel, run_config) -> List[str]:
    """A private run's DP value when its label does not name it (one value): 'ε = 8' (the
    target) or 'z = 1.1'."""
    config = dict(run_config or {})
    if config.get("dp_clip") is None:
        return []
    flag = "dp_target_epsilon" if config.get("dp_target_epsilon") else "dp_noise_multiplier"
    values = config.get(flag) or (0.0,)
    if len(values) == 1 and flag not in dict(label.extra):
        return [f"{PLATFORM_SYMBOLS[flag]} = {_g(values[0])}"]
    return []

# How the literature names a method with a server optimizer, by the method's report column:
# FedAvg (and Delta-FL at theta = 1, which is FedAvg) with momentum is Hsu et al.'s FedAvgM,
# with the adaptive steps Reddi et al.'s FedAdam, FedYogi, FedAdagrad.
SERVER_NAMES = {"FedAvg": {"momentum": "FedAvgM", "adam": "FedAdam", "yogi": "FedYogi",
                           "adagrad": "FedAdagrad"}}


@dataclasses.dataclass(frozen=True)
class Option:
    """One scalar option of an algorithm: a flag whose value is the same for every replica.

    An algorithm declares its options as a frozen dataclass whose fields are made by
    :meth:`field`; the field's name is the flag. Specs that read the same option share one
    Option object (Delta-FL, FedAvg and deltafl_alt: ``weighting``), so that its default, help
    and choices are written once; the registry refuses two different Options under one flag.

    default: the value when the flag is not given (its type is the flag's type).
    help: the flag's help text.
    choices: the values allowed (an enum flag); () for a number or a free string.
    """

    default: Any
    help: str
    choices: Tuple[str, ...] = ()

    def field(self) -> Any:
        """A dataclass field with this default that carries this Option."""
        return dataclasses.field(default=self.default, metadata={OPTION: self})

    def check(self, flag: str, value) -> None:
        """ConfigError naming --flag when the value is not one of the choices."""
        if self.choices and value not in self.choices:
            raise ConfigError(f"unknown --{flag}={value!r}; choose one of "
                              f"{', '.join(self.choices)}")


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of an algorithm that has none."""


def declared_options(options_type: type) -> Tuple[Tuple[str, Option], ...]:
    """(flag, Option) of each field of an options dataclass, in order; TypeError when it is not
    a frozen dataclass or a field was not made by :meth:`Option.field`."""
    params = getattr(options_type, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"options {options_type!r} must be a frozen dataclass")
    out = []
    for f in dataclasses.fields(options_type):
        option = f.metadata.get(OPTION)
        if not isinstance(option, Option):
            raise TypeError(f"{options_type.__name__}.{f.name} must be made by Option.field()")
        out.append((f.name, option))
    return tuple(out)


def check_options(options) -> None:
    """ConfigError naming the flag at fault: each field's choices, then the options' own
    ``check()`` (checks across fields, ranges), when they have one."""
    for flag, option in declared_options(type(options)):
        option.check(flag, getattr(options, flag))
    own = getattr(options, "check", None)
    if own is not None:
        own()


def build_options(options_type: type, given: Mapping[str, Any]):
    """The options of type `options_type` from a mapping flag -> value (a flag it lacks takes
    its default; flags of other algorithms are not read), checked."""
    names = [flag for flag, _ in declared_options(options_type)]
    options = options_type(**{k: given[k] for k in names if k in given})
    check_options(options)
    return options


def _g(v) -> str:
    return "∞" if float(v) == math.inf else f"{float(v):g}"


def label_parts(display_name: str, label: ReplicaLabel,
                symbols: Optional[Mapping[str, str]] = None) -> List[str]:
    """A report column name in parts: 'display_name, symbol = value' of the swept coordinate,
    then 'symbol = value' for each further coordinate (``label.extra``). `symbols` maps a
    coordinate (``theta``, a flag) to its symbol; theta reads as θ, any other name as itself."""
    symbols = {"theta": "θ", **dict(symbols or {})}
    name, value = label.swept()
    return ([f"{display_name}, {symbols.get(name, name)} = {_g(value)}"]
            + [f"{symbols.get(k, k)} = {_g(v)}" for k, v in label.extra])


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The hyper-parameter that a spec sweeps: one replica per value x seed, in one program.

    flag: the command-line flag that lists the values ("thetas" for theta).
    field: the field of the spec's hyper NamedTuple that receives the value.
    default: the default grid.
    help: the flag's help text (without its default, which absl prints).
    minimum: values must be >= minimum (None: any finite value).
    integer: values must be integers.
    labelled_by_theta: replicas are labelled by theta (label.theta = value); otherwise by
      param_name = flag and param_value = value.
    symbol: how the value reads in a report column ("θ", "q", "μ"; empty: the flag).
    tuned: the value is a hyper-parameter to tune (a baseline's q, mu, t, ...: the tuner's
      --tune_param picks one, the report's --best keeps the best column); False: every value
      is a model the user asks for (Delta-FL's theta).
    """

    flag: str
    field: str
    default: Tuple[float, ...]
    help: str
    minimum: Optional[float] = None
    integer: bool = False
    labelled_by_theta: bool = False
    symbol: str = ""
    tuned: bool = True

    @property
    def coordinate(self) -> str:
        """The name of its value in a replica label: "theta" or the flag."""
        return "theta" if self.labelled_by_theta else self.flag

    def check(self, values) -> Tuple[float, ...]:
        """The values as floats; ConfigError naming the flag if one is bad."""
        out = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"--{self.flag} must be finite numbers, got {v!r}")
            if self.integer and float(v) != int(v):
                raise ConfigError(f"--{self.flag} must be integers, got {v!r}")
            if self.minimum is not None and v < self.minimum:
                raise ConfigError(f"--{self.flag} must be >= {self.minimum:g}, got {v!r}")
            out.append(float(v))
        if len(set(out)) != len(out):
            raise ConfigError(f"--{self.flag} lists a value twice: {list(values)}")
        return tuple(out)


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
    options_type: the frozen dataclass of its options (:class:`Option` fields; the field names
      are the flags, e.g. ``--filter``), built from ``config.options``; :class:`NoOptions`
      for none. An options class may define ``check()`` (ConfigError naming the flag).
    fixed: values of the other hyper fields, the same for every replica.
    local_steps: force this many local steps (None: the run's --local_epochs/--local_steps).
    all_clients: every training client takes part in every round (m = N).
    values: optional (config, swept values from the flag) -> values to train, for specs whose
      grid depends on other settings (FedAvg is theta = 1; FedAvg-Sub reads --thetas).
    validate: optional (config) -> None, raising ConfigError, for checks beyond :meth:`Sweep.check`.
    alt_sweep: optional second sweep, used instead of `sweep` when its flag lists values
      (FedAvg-Sub: fixed client counts instead of the counts Delta-FL keeps at theta).
    cross: further sweeps crossed with the active one (deltafl_alt: theta x T_eta); each of
      their values becomes an extra coordinate of the replica labels (``extra``, as the
      tuner's grids), e.g. ``theta=0.5_eta_every=5_seed=1``.
    dp_requires: for an algorithm with a private version (--dp_clip), what its options must
      be for it (the one line of the refusal otherwise); empty: it has none.
    variable_cohort: its round takes a cohort of varying size (--client_sampling=poisson):
      empty slots (size 0) get weight 0 and count in none of its sums or normalisations.
    own_server_step: why the server step is the algorithm's own (non-empty: it refuses a
      server optimizer other than the default w + Delta); empty: the round's server optimizer
      applies to its Delta. A list of --server_lr values is crossed like `cross`, after it
      (``theta=0.5_server_lr=0.03_seed=1``).
    column_name: optional (label, options, name) -> the report's name of a column, given the
      default name ('display_name, symbol = value') and the run's options (Delta-FL at
      theta = 1 is "FedAvg"; its reference filter is named).
    names_value: a report column names the swept value ('q-FFL, q = 10'); False: the spec
      trains one model, named by its display name alone (FedAvg, SCAFFOLD: theta = 1).
    fixed_sweep: the spec trains one value of its sweep whatever the flag lists (FedAvg:
      theta = 1); beside other methods in one run it does not read that flag's values, which
      are the others' grid.
    tunes_l2: the tuner's lambda step applies: the spec's replicas are Delta-FL at the
      theta of its sweep (FedAvg: 1), and the lambda grid trains Delta-FL at each of them.
    leaderboard: how the tail leaderboard runs it (``leaderboard.Board``); None: not on it.

    Hyper fields that the active sweep and `cross` do not set take their value from `fixed`.
    """

    name: str
    display_name: str
    help: str
    factory: Callable[[Any, Any, Any], FederatedAlgorithm]
    hyper: type
    sweep: Sweep
    fixed: Mapping[str, float] = dataclasses.field(default_factory=dict)
    local_steps: Optional[int] = None
    all_clients: bool = False
    values: Optional[Callable[[Any, Tuple[float, ...]], Tuple[float, ...]]] = None
    validate: Optional[Callable[[Any], None]] = None
    alt_sweep: Optional[Sweep] = None
    cross: Tuple[Sweep, ...] = ()
    own_server_step: str = ""
    dp_requires: str = ""
    options_type: type = NoOptions
    column_name: Optional[Callable[[ReplicaLabel, Any, str], str]] = None
    names_value: bool = True
    fixed_sweep: bool = False
    tunes_l2: bool = False
    variable_cohort: bool = False
    leaderboard: Any = None

    def __post_init__(self):
        declared_options(self.options_type)   # TypeError unless a frozen dataclass of Options
        fields = set(self.hyper._fields)
        crossed = {c.field for c in self.cross}
        for sweep in self.primary_sweeps():
            missing = fields - {sweep.field} - set(self.fixed) - crossed
            if sweep.field not in fields or missing or not crossed <= fields:
                raise TypeError(f"spec {self.name}: hyper fields {sorted(fields)} must be the "
                                f"swept field {sweep.field!r} and the fixed ones "
                                f"{sorted(self.fixed)}")

    def primary_sweeps(self) -> Tuple[Sweep, ...]:
        """The sweep and the alternative one: the sweeps that name the replicas."""
        return (self.sweep,) + ((self.alt_sweep,) if self.alt_sweep is not None else ())

    def sweeps(self) -> Tuple[Sweep, ...]:
        """Every sweep whose flag this spec reads (for the command line)."""
        return self.primary_sweeps() + tuple(self.cross)

    def crossed(self, config) -> Tuple[Tuple[Mapping[str, float], Tuple], ...]:
        """(hyper overrides, extra label coordinates) for each combination of the `cross`
        sweeps' values (one empty combination when there are none)."""
        combos: Tuple[Tuple[Mapping[str, float], Tuple], ...] = (({}, ()),)
        for c in self.cross:
            values = c.check(config.sweep(c.flag)) or c.default
            combos = tuple(({**o, c.field: v}, e + ((c.flag, v),))
                           for o, e in combos for v in values)
        return combos

    @staticmethod
    def platform_values(config, dp_noise: Sequence[float] = (0.0,)
                        ) -> Tuple[Tuple[float, float, Tuple], ...]:
        """(eta, z, extra label coordinates) for each --server_lr value x each DP value
        (`dp_noise`: the noise multiplier of each value of the config's DP sweep, calibrated
        already); the label names the server learning rate and the DP value only when
        several are trained."""
        lrs = tuple(config.server_lr)
        (flag, given), = config.privacy.swept
        if len(given) != len(dp_noise):
            raise ValueError(f"{len(dp_noise)} noise multipliers for {len(given)} --{flag} values")
        return tuple((eta, z, ((("server_lr", eta),) if len(lrs) > 1 else ())
                      + (((flag, g),) if len(given) > 1 else ()))
                     for eta in lrs for g, z in zip(given, dp_noise))

    def active_sweep(self, config) -> Sweep:
        alt = self.alt_sweep
        return alt if alt is not None and config.sweep(alt.flag) else self.sweep

    def sweep_values(self, config) -> Tuple[float, ...]:
        sweep = self.active_sweep(config)
        given = sweep.check(config.sweep(sweep.flag))
        if self.values is not None and sweep is self.sweep:
            return tuple(self.values(config, given))
        return given or sweep.default

    def reads(self) -> Tuple[str, ...]:
        """Every flag of its own: its sweeps' and its options'."""
        return tuple(s.flag for s in self.sweeps()) + self.option_flags()

    def option_flags(self) -> Tuple[str, ...]:
        """The flags of its options, in order."""
        return tuple(flag for flag, _ in declared_options(self.options_type))

    def options_for(self, config):
        """Its typed options from ``config.options`` (defaults for the flags not given),
        checked: ConfigError naming the flag at fault."""
        return build_options(self.options_type, config.options)

    def stored_options(self, run_config: Optional[Mapping[str, Any]]):
        """Its typed options as a finished run's configuration holds them (summary.json's
        ``config``: ``options``; runs written before options had their own mapping hold them
        at the top level), unchecked."""
        run_config = dict(run_config or {})
        given = {**run_config, **dict(run_config.get("options") or {})}
        names = self.option_flags()
        return self.options_type(**{k: given[k] for k in names if k in given})

    def make(self, config, data) -> FederatedAlgorithm:
        """The algorithm of a run: the factory with the config's typed options."""
        return self.factory(config, data, self.options_for(config))

    def sweep_of(self, label: ReplicaLabel) -> Optional[Sweep]:
        """The primary sweep whose value names the label (None: a label it does not make)."""
        name, _ = label.swept()
        return next((s for s in self.primary_sweeps() if s.coordinate == name), None)

    def method_name(self, label: ReplicaLabel,
                    run_config: Optional[Mapping[str, Any]] = None) -> str:
        """The report's column name of a replica label, in the papers' style ('q-FFL, q = 10',
        'Δ-FL, θ = 0.5'); further coordinates follow as 'symbol = value'. `run_config`: the
        run's configuration as summary.json stores it (its options may name the column)."""
        symbols = {s.coordinate: s.symbol for s in self.sweeps() if s.symbol}
        parts = label_parts(self.display_name, label, {**symbols, **PLATFORM_SYMBOLS})
        if not self.names_value:
            parts[0] = self.display_name
        if self.column_name is not None:
            parts[0] = self.column_name(label, self.stored_options(run_config), parts[0])
        return ", ".join(self._server_parts(parts, run_config) + _dp_parts(label, run_config))

    @staticmethod
    def _server_parts(parts: List[str], run_config) -> List[str]:
        """The column's parts with the run's server step named (nothing for the plain step
        w + Delta): the optimizer after the swept value ("Δ-FL, θ = 0.5, server Adam"), or
        the literature's name of the method with it ("FedAdam": :data:`SERVER_NAMES`), then
        its learning rate η_s unless the label names it (a sweep), and its settings that
        differ from the defaults ("τ = 0.01")."""
        server = from_run_config(dict(run_config or {}))
        if server.is_default:
            return parts
        named = SERVER_NAMES.get(parts[0], {}).get(server.name)
        head = [named or parts[0]]
        if named is None and server.name != "sgd":
            head.append(f"server {SERVER_DISPLAY[server.name]}")
        lrs = server.learning_rates
        defaults = dict(ServerOptimizer(name=server.name).settings())
        settings = [f"{SERVER_SYMBOLS[f]} = {_g(v)}" for f, v in server.settings()
                    if v != defaults[f]]
        return (head + ([f"η_s = {_g(lrs[0])}"] if len(lrs) == 1 else []) + settings
                + parts[1:])

    def check(self, config) -> None:
        self.sweep_values(config)
        self.options_for(config)
        if config.privacy.enabled and not self.dp_requires:
            raise ConfigError(f"--algorithm={self.name} has no private version (--dp_clip): "
                              "its round releases more than a bounded-weight average of clipped "
                              "updates (per-client state, loss-driven weights or its own step)")
        if self.own_server_step and not config.server.is_default:
            raise ConfigError(f"--algorithm={self.name} takes no --server_optimizer or "
                              f"--server_lr: {self.own_server_step}")
        if self.validate is not None:
            self.validate(config)

    def label(self, value: float, sweep: Optional[Sweep] = None) -> ReplicaLabel:
        sweep = sweep or self.sweep
        if sweep.labelled_by_theta:
            return ReplicaLabel(self.name, float(value), -1)
        return ReplicaLabel(self.name, float(self.fixed.get("theta", 1.0)), -1,
                            param_name=sweep.flag, param_value=float(value))

    def hyper_for(self, value: float, sweep: Optional[Sweep] = None, **overrides: float):
        sweep = sweep or self.sweep
        values = {**self.fixed, sweep.field: float(value), **overrides}
        return self.hyper(**{f: float(values[f]) for f in self.hyper._fields})

    def grid(self, config, dp_noise: Sequence[float] = (0.0,)) -> ReplicaGrid:
        """The sweep values (x the `cross` values x the --server_lr values x the DP values,
        whose noise multipliers `dp_noise` are) x seeds, with the config's schedule and
        per-value L2."""
        sweep = self.active_sweep(config)
        values = self.sweep_values(config)
        l2s = config.l2_for(len(values))
        points = tuple(
            GridPoint(label=dataclasses.replace(self.label(v, sweep), extra=extra + more),
                      hyper=self.hyper_for(v, sweep, **overrides), l2=l2,
                      learning_rate=config.learning_rate, lr_decay=config.lr_decay,
                      lr_decay_every=config.lr_decay_every, server_lr=eta, dp_noise=z)
            for v, l2 in zip(values, l2s) for overrides, extra in self.crossed(config)
            for eta, z, more in self.platform_values(config, dp_noise))
        return ReplicaGrid(points=points, seeds=tuple(config.seeds))
