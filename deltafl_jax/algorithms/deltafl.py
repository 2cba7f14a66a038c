"""Delta-FL (Algorithm 2 of "Device Heterogeneity in Federated Learning: A Superquantile
Approach") and FedAvg, its theta = 1 case.

Each round, eta_t is the alpha-weighted (1 - theta)-quantile of the sampled clients' losses
F_k(w_t) (line 5); the clients with F_k >= eta_t train (lines 6-8); the server averages their
models (line 9). Two filters:

- ``exact`` (default): aggregation weights proportional to
  :func:`deltafl_jax.superquantile.tail_weights`, the maximiser of the superquantile LP: the
  clients above eta keep alpha_k and the boundary client gets a fraction, so the kept mass is
  exactly theta.
- ``reference``: the authors' code: every client with F_k >= eta keeps its full alpha_k
  (ties and the boundary client included).

eta's level 1 - theta is computed on the host in float64 from the Python theta of ``--thetas``
(:func:`deltafl_jax.superquantile.quantile_levels`), so that at exact boundaries of the
cumulative weights (theta = 0.9 with 10 equal clients, theta = 2/3 with 3) the filter keeps
the clients that the authors' double-precision rule keeps.

Losses within ``tie_rtol`` (relative, 1e-5 by default) of eta count as tied with it. Losses that
are equal in exact arithmetic, such as log C for every client at the zero initialisation of the
linear models, differ in float32 by summation noise of that order; without the tolerance the
round-0 filter would pick clients by rounding noise, and the result would depend on how the
evaluation is chunked.

**Options** (:class:`DeltaFLOptions`; scalar flags, the same for every replica):

- ``filter``: ``exact`` or ``reference`` (above).
- ``weighting``: ``weighted`` (alpha_k proportional to n_k, the long paper) or ``unweighted``
  (alpha_k = 1/N, the 2022 paper: the quantile of the unweighted losses, and the kept clients
  averaged uniformly).
- ``smoothing`` = nu > 0: the smoothed superquantile F_{theta,nu} (eqs. 5-7): weights
  alpha_k g_nu'(F_k - eta*) with eta* the minimiser of Property 9 (the gradient of
  F_{theta,nu}, Prop. 4 / Algorithm 1 on the smoothed objective); it replaces the filter, and
  nu -> 0 gives the exact filter back.
- ``deltafl_participation``: ``none`` (default), ``fedau`` or ``inverse``: each sampled client's
  alpha_k is multiplied by its estimated inverse participation rate before the quantile and the
  filter (below, *Participation*).
- ``quantile``: ``sort`` (the server sorts the losses that the clients report, line 5) or
  ``secagg_mm`` (Algorithm 3): eta from ``mm_iters`` majorisation-minimisation steps whose
  every input is a secure-aggregation sum (:mod:`deltafl_jax.privacy.secagg`, App. B.1); the server
  never sees a loss, the clients filter themselves (F_k > eta, strictly, as Algorithm 3's
  LocalUpdate writes it) and keep their full alpha_k; the round metric ``secagg_calls`` counts
  mm_iters + 1 calls for eta and 1 for the model.

**Participation** (``--deltafl_participation``). A client that is online in a fraction p_k
of the rounds is in the cohort about p_k m / (sum_i p_i) as often as the others: the sampled
losses are drawn from the participation-weighted population, and the (1 - theta)-quantile and
the superquantile over them are those of the clients that are often online, not of the N
clients. With the correction each sampled client's weight is alpha_k c_k, c_k an estimate of
1 / p_k: FedAU's omega_k (``fedau``, its mean participation interval, cut-off ``--fedau_cap``)
or 1 / p_hat_k (``inverse``, p_hat_k its running participation rate, this round included)
(:mod:`deltafl_jax.algorithms.participation`). Then sum_{k in S} alpha_k c_k 1{F_k <= x}
estimates sum_{i=1..N} alpha_i 1{F_i <= x} (its expectation when c_k = 1 / p_k), each client
counted as often as it exists (a Horvitz-Thompson weight; the quantile is scale-free): eta and the tail weights estimate the
population's quantile and superquantile rather than the cohort's. Under uniform participation
every c_k has the same expectation (N / m), so the weights are those of ``none`` in
expectation, and exactly so when every client takes part in every round (c_k = 1). "Taking
part" is being sampled (the loss was seen), whether or not the filter keeps the client. The
estimate is the algorithm's state ([N] counters per replica, restored on resume; O(m) per
round). Private Delta-FL (``--dp_clip``) takes ``none`` only.

Each is a field of :class:`DeltaFLOptions` that declares its flag (default, help, choices,
range: :func:`~deltafl_jax.declared.setting`); the two that other specs read are
:class:`~deltafl_jax.algorithms.options.Option` records written once here (``FILTER``,
``WEIGHTING``) and shared with them (FedAvg: ``weighting``; FedAvg-Sub: ``filter``;
deltafl_alt: both).

These are options of Delta-FL rather than algorithms of their own: each changes only how one
round turns the sampled losses into weights, while the sweep over theta, the replica labels,
FedAvg as theta = 1, the outputs and the reports are Delta-FL's; as options they also combine
with every --thetas in one compiled program without a second copy of the spec.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Option, Sweep, check_options
from deltafl_jax.algorithms.participation import FEDAU_CAP, correction, init_estimator
from deltafl_jax.algorithms.protocol import (FederatedAlgorithm, PrivateAggregate, RoundContext,
                                             average_delta, no_state)
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Grid, Reporting
from deltafl_jax.declared import Bounds, finite_in, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.privacy.secagg import SumNoise, mm_quantile
from deltafl_jax.superquantile import (quantile_levels, smoothed_eta, smoothed_tail_weights,
                                       tail_weights, threshold_weights, weighted_quantile)

FILTERS = ("exact", "reference")
WEIGHTINGS = ("weighted", "unweighted")
QUANTILES = ("sort", "secagg_mm")
PARTICIPATIONS = ("none", "fedau", "inverse")
DEFAULT_TIE_RTOL = 1e-5
PAPER_THETAS = (1.0, 0.8, 0.5, 0.1)

FILTER = Option(
    default="exact", choices=FILTERS,
    help="exact: tail weights of the superquantile (fractional boundary client) | reference: "
    "every client with F_k >= eta, full weight")
WEIGHTING = Option(
    default="weighted", choices=WEIGHTINGS,
    help="weighted: alpha_k proportional to n_k | unweighted: alpha_k = 1/N and the tail "
    "averaged uniformly (2022 paper)")


class DeltaFLHyper(NamedTuple):
    """theta: [] the conformity level in (0, 1]."""

    theta: float


@dataclasses.dataclass(frozen=True)
class DeltaFLOptions:
    """How a Delta-FL round weighs clients and finds eta (module docstring)."""

    filter: str = FILTER.field()
    weighting: str = WEIGHTING.field()
    smoothing: float = setting(
        0.0, "nu > 0: Delta-FL weights alpha_k g_nu'(F_k - eta) of the smoothed superquantile "
        "(eqs. 5-6, Property 9) instead of the filter; 0: off", bounds=Bounds(0.0))
    quantile: str = setting(
        "sort", "sort: the server sorts the reported losses | secagg_mm: eta from --mm_iters MM "
        "steps over secure sums, clients with F_k > eta train (Algorithm 3, App. B.1)",
        choices=QUANTILES)
    mm_iters: int = setting(20, "MM steps of --quantile=secagg_mm",
                            bounds=Bounds(1, integer=True))
    deltafl_participation: str = setting(
        "none", "none | fedau: each sampled client's alpha_k times FedAU's omega_k (its "
        "estimated participation interval) | inverse: times 1/p_hat_k (its running "
        "participation rate), so that rarely online clients count as often as they exist",
        choices=PARTICIPATIONS)
    fedau_cap: int = FEDAU_CAP.field()

    def check(self) -> None:
        """ConfigError naming the flag at fault, across fields (each field's choices and
        range are checked before)."""
        nu = self.smoothing
        if nu > 0 and self.quantile != "sort":
            raise ConfigError("--smoothing and --quantile=secagg_mm each replace the filter; "
                              "use one of them")
        if self.filter != "exact" and (nu > 0 or self.quantile != "sort"):
            raise ConfigError(f"--filter={self.filter} cannot apply: --smoothing / "
                              "--quantile=secagg_mm replace the filter")


def unnormalised_alphas(sizes, weighting: str):
    """alpha_k up to a constant factor (not normalised to sum to 1): n_k (weighted) or 1
    (unweighted); 0 for an empty slot of a Poisson cohort (size 0)."""
    n = sizes.astype(jnp.float32)
    return n if weighting == "weighted" else (sizes > 0).astype(jnp.float32)


def filter_rule(filter: str):
    """The weights of the kept clients: tail_weights (exact) or threshold_weights (reference)."""
    FILTER.check("filter", filter)
    return tail_weights if filter == "exact" else threshold_weights


def round_rule(options: DeltaFLOptions, tie_rtol: float) -> Callable:
    """rule(losses, alphas, theta, level) -> (weights [m], eta, extra metrics): the
    aggregation weights a_k (0 = no local work), eta, and what the option adds to the
    metrics. `level` is 1 - theta in float64."""
    if options.smoothing > 0:
        nu = options.smoothing

        def smoothed(losses, alphas, theta, level):
            return (smoothed_tail_weights(losses, alphas, theta, nu),
                    smoothed_eta(losses, alphas, theta, nu), {})
        return smoothed
    if options.quantile == "secagg_mm":
        def secagg(losses, alphas, theta, level):
            eta, calls = mm_quantile(losses, alphas, 1.0 - theta, options.mm_iters)
            weights = jnp.where((losses > eta) & (alphas > 0), alphas, 0.0)
            return weights, eta, {"secagg_calls": jnp.int32(calls + 1)}
        return secagg
    base = filter_rule(options.filter)

    def sort(losses, alphas, theta, level):
        return (base(losses, alphas, theta, tie_rtol, level=level),
                weighted_quantile(losses, alphas, level), {})
    return sort


QUANTILE_STREAM = 0x9A1   # folded into a replica's round key for the quantile's noise


def private_deltafl(options: DeltaFLOptions, privacy) -> Optional[PrivateAggregate]:
    """Private Delta-FL (Algorithm 3 with noised secure sums, :mod:`deltafl_jax.privacy.dp`):
    eta from the mm_iters + 1 secure sums, each with noise z_q = privacy.quantile_noise_ratio
    x z in units of its sensitivity; the clients with F_k > eta train at weight 1, and the
    kept weight is released with noise too (denominator None), floored at half its expected
    value theta m / 2; or, with ``--dp_kept_weight=expected``, the update is divided by that
    expected value theta m, fixed (DP-FedAvg's estimator), and the kept weight is not
    released. None unless --quantile=secagg_mm and --weighting=unweighted (weights
    n_k would make one client's share unbounded)."""
    if not (privacy is not None and privacy.enabled and options.quantile == "secagg_mm"
            and options.weighting == "unweighted"
            and options.deltafl_participation == "none"):
        return None
    ratio, iters = float(privacy.quantile_noise_ratio), options.mm_iters
    bound = float(privacy.loss_bound)
    first = ratio * math.sqrt(bound ** 2 + 1.0) / bound   # replacing a client moves F_k only

    def client_weights(ctx: RoundContext, z: jax.Array) -> jax.Array:
        alphas = unnormalised_alphas(ctx.sizes, "unweighted")
        noise = SumNoise(jax.random.fold_in(ctx.key, QUANTILE_STREAM), z * ratio,
                         privacy.loss_bound, privacy.mm_floor)
        eta, _ = mm_quantile(ctx.losses, alphas, 1.0 - ctx.hyper.theta, iters, noise)
        return jnp.where((ctx.losses > eta) & (alphas > 0), alphas, 0.0)

    # Adding or removing a client moves the kept weight by 1, the first sum (F_k, 1) by
    # sqrt(B^2 + 1) and each MM sum by sqrt(B^2 + 1) / xi: multipliers z, z_q, z_q.
    if getattr(privacy, "kept_weight", "noised") == "expected":
        # The fixed denominator theta m (the kept weight's expectation, m the expected
        # cohort): the kept weight is not released, and costs no budget.
        return PrivateAggregate(max_weight=lambda hyper, m: 1.0,
                                denominator=lambda hyper, m: hyper.theta * m,
                                releases=(first,) + (ratio,) * iters,
                                client_weights=client_weights,
                                add_remove_releases=(ratio,) + (ratio,) * iters)
    return PrivateAggregate(max_weight=lambda hyper, m: 1.0, denominator=None,
                            releases=(1.0, first) + (ratio,) * iters,
                            client_weights=client_weights,
                            floor=lambda hyper, m: 0.5 * hyper.theta * m,
                            add_remove_releases=(1.0, ratio) + (ratio,) * iters)


def participation_alphas(options: DeltaFLOptions, num_clients: int):
    """(init, alphas, record): the algorithm's state, alpha_k of a cohort (state, sizes,
    clients) -> [m], and the state after the round (state, sizes, clients) -> state; with
    ``deltafl_participation=none`` no state and alpha_k alone (module docstring)."""
    weighting = options.weighting
    if options.deltafl_participation == "none":
        return (no_state, lambda state, sizes, clients: unnormalised_alphas(sizes, weighting),
                lambda state, sizes, clients: state)
    if num_clients < 1:
        raise ValueError("--deltafl_participation needs the number of training clients")
    corr = correction(options.deltafl_participation, int(options.fedau_cap))

    def alphas(state, sizes, clients):
        return unnormalised_alphas(sizes, weighting) * corr.weights(state, clients)
    return (lambda params, hyper: init_estimator(num_clients), alphas,
            lambda state, sizes, clients: corr.record(state, clients, sizes > 0))


def deltafl(options: DeltaFLOptions = DeltaFLOptions(), tie_rtol: float = DEFAULT_TIE_RTOL,
            thetas: Sequence[float] = (), privacy=None,
            num_clients: int = 0) -> FederatedAlgorithm:
    """Delta-FL with hyper.theta in (0, 1]; theta = 1 is FedAvg. `thetas`: the run's levels
    as Python floats, whose 1 - theta is taken in float64 (others: 1 - float32 theta, in
    float64). `privacy`: the run's :class:`deltafl_jax.privacy.dp.Privacy` (its private version,
    :func:`private_deltafl`). `num_clients`: N, for ``--deltafl_participation``."""
    check_options(options)
    private = private_deltafl(options, privacy)
    rule = round_rule(options, tie_rtol)
    level = quantile_levels(thetas)
    init, cohort_alphas, record = participation_alphas(options, num_clients)

    def client_weights(ctx: RoundContext) -> jax.Array:
        alphas = cohort_alphas(ctx.state, ctx.sizes, ctx.clients)
        return rule(ctx.losses, alphas, ctx.hyper.theta, level(ctx.hyper.theta))[0]

    def server_update(state, params, feedback, hyper):
        if private is not None:   # eta was noised in client_weights; the server never saw it
            return average_delta(params, feedback), state, {      # (the kept weight goes
                "secagg_calls": jnp.int32(options.mm_iters + 2)}  # with the model's call)
        alphas = cohort_alphas(state, feedback.sizes, feedback.clients)
        _, eta, extra = rule(feedback.losses, alphas, hyper.theta, level(hyper.theta))
        new = record(state, feedback.sizes, feedback.clients)
        return average_delta(params, feedback), new, {"eta": eta, **extra}

    return FederatedAlgorithm(name="deltafl", init=init, client_weights=client_weights,
                              server_update=server_update, private=private)


THETA_SWEEP = Sweep(flag="thetas", field="theta", default=PAPER_THETAS,
                    help="conformity levels theta in (0, 1], all trained in one program",
                    interval=(0.0, 1.0), labelled_by_theta=True, symbol="θ", tuned=False)


def run_thetas(config) -> Sequence[float]:
    """The thetas that the run trains, as Python floats (--thetas, else the paper's)."""
    return tuple(config.thetas) or PAPER_THETAS


def theta_one(algorithm: str, why: str) -> Callable:
    """The ``values`` of a spec that trains theta = 1 alone (FedAvg, SCAFFOLD): (1.0,), and a
    ConfigError saying `why` when --thetas lists another level."""
    def values(config, given):
        if given and tuple(given) != (1.0,):
            raise ConfigError(f"--algorithm={algorithm} {why}; got --thetas={list(given)}")
        return (1.0,)
    return values


def at_theta_one(algorithm: str, why: str = "trains every sampled client (theta = 1)", *,
                 tunes_l2: bool = False, leaderboard: Any = None) -> Dict[str, Any]:
    """The spec fields of a method that trains theta = 1 alone (FedAvg, SCAFFOLD, MIFA, ...):
    Delta-FL's hyper-parameters and sweep, whose --thetas it refuses but 1 (:func:`theta_one`,
    saying `why`; :func:`check_thetas`), and one model named by the method alone; `tunes_l2`
    and `leaderboard` as in :class:`Grid` and :class:`Reporting`."""
    return dict(hyper=DeltaFLHyper, sweep=THETA_SWEEP, validate=check_thetas,
                grid=Grid(values=theta_one(algorithm, why), fixed_sweep=True, tunes_l2=tunes_l2),
                reporting=Reporting(names_value=False, leaderboard=leaderboard))


def check_thetas(config) -> None:
    for t in config.thetas:
        if not finite_in(t, 0.0, 1.0, low_open=True):
            raise ConfigError(f"--thetas must lie in (0, 1], got {t!r}")


def name_the_filter(head: str, filter: str) -> str:
    """A column name that says when the filter is not the exact one: '... (reference filter)'."""
    return head if filter == "exact" else f"{head} ({filter} filter)"


PARTICIPATION_NAMES = {"fedau": "FedAU-corrected", "inverse": "1/p̂-corrected"}


def column_name(label, options: DeltaFLOptions, head: str) -> str:
    """Delta-FL at theta = 1 is FedAvg (bit for bit) and is named so; the reference filter is
    named, and so is a participation correction ('Δ-FL, θ = 0.5 (FedAU-corrected)')."""
    correction = PARTICIPATION_NAMES.get(getattr(options, "deltafl_participation", "none"))
    if float(label.theta) == 1.0 and correction is None:
        return "FedAvg"
    named = name_the_filter(head, options.filter)
    return f"{named} ({correction})" if correction else named


# --smoothing below this many float32 steps of a typical loss resolves nothing (see below).
SMOOTHING_ULPS = 8


def smoothing_warning(nu: float, num_classes: Optional[int]) -> Optional[str]:
    """One warning line when nu > 0 is below SMOOTHING_ULPS float32 steps (ulps) of a typical
    loss, else None. The typical loss is log C for C classes (a uniform guess; 1 when C < 3),
    whose ulp is about 2.4e-7 for C = 10: the losses F_k - eta are then resolved more coarsely
    than the ramp (0, nu] of g_nu', so the boundary client gets weight 0 or 1 instead of its
    fraction, as the unsmoothed filter would."""
    if not nu > 0:
        return None
    scale = math.log(num_classes) if num_classes and num_classes >= 3 else 1.0
    floor = SMOOTHING_ULPS * float(np.spacing(np.float32(scale)))
    if nu >= floor:
        return None
    return (f"deltafl_jax: warning: --smoothing={nu:g} is below {SMOOTHING_ULPS} float32 steps "
            f"of a typical loss ({SMOOTHING_ULPS} x ulp({scale:.3g}) = {floor:.2g}): the boundary "
            f"client gets weight 0 or 1, not its fraction; use --smoothing >= {floor:.1g}")


def build_deltafl(config, data, options: DeltaFLOptions) -> FederatedAlgorithm:
    """The spec's factory: :func:`deltafl` for the run, after a one-line warning on stderr
    when --smoothing is below the losses' float32 resolution (:func:`smoothing_warning`)."""
    line = smoothing_warning(options.smoothing, getattr(data, "num_classes", None))
    if line:
        print(line, file=sys.stderr, flush=True)
    corrected = options.deltafl_participation != "none"
    return deltafl(options, thetas=run_thetas(config), privacy=config.privacy,
                   num_clients=data.train.num_clients if corrected else 0)


SPEC = AlgorithmSpec(
    name="deltafl", display_name="Δ-FL",
    help="Delta-FL: the clients above the (1 - theta)-quantile train",
    factory=build_deltafl,
    hyper=DeltaFLHyper, sweep=THETA_SWEEP, validate=check_thetas, options_type=DeltaFLOptions,
    grid=Grid(tunes_l2=True), clients=Clients(variable_cohort=True),
    reporting=Reporting(column_name=column_name,
                        leaderboard=Board(grid={"thetas": (0.8, 0.5, 0.1)})),
    dp_requires="--quantile=secagg_mm --weighting=unweighted --deltafl_participation=none "
    "(private Delta-FL: eta from "
    "Algorithm 3's noised secure sums, the clients filtering themselves at weight 1)")
