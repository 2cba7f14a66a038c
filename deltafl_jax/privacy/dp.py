"""Client-level differential privacy: DP-FedAvg (McMahan et al., *Learning Differentially
Private Recurrent Language Models*, ICLR 2018) for every algorithm whose server step averages
updates, a private Delta-FL (the long paper's Algorithm 3 with noised secure sums), and their
accounting with Google's ``dp-accounting`` library.

The mechanism, per round and replica, with clip C (``--dp_clip``) and noise multiplier z
(``--dp_noise_multiplier``, or calibrated from ``--dp_target_epsilon``):

1. each trained client's update Delta_k = w_k - w_t is clipped in the engine, before it enters
   the sum: Delta_k min(1, C / ||Delta_k||) (:func:`clip_factor`);
2. the server receives S = sum_k a_k clip(Delta_k) + N(0, (z C a_max)^2 I), a_max the largest
   weight one client can have: one client's term is at most C a_max long, and replacing one
   client by another moves S by at most 2 C a_max in L2 (its sensitivity);
3. Delta = S / D with D a denominator that does not depend on who took part: for FedAvg and
   FedProx (a_k = 1/m, m clients drawn each round) the expected weight of a round, D = 1
   (DP-FedAvg's fixed-denominator estimator); for private Delta-FL, whose kept weight is
   random, D = max(sum_k a_k + N(0, z^2), theta m / 2), the kept weight released with its own
   noise (a_k = 1, sensitivity 1) and floored, as DP-FedAvg's clipped-denominator estimator
   is, at half its expected value (at 1 without noise: the plain average).

Private Delta-FL (``--algorithm=deltafl --quantile=secagg_mm --weighting=unweighted`` with
``--dp_clip``): eta comes from the mm_iters + 1 secure sums of Algorithm 3, each noised
(:func:`deltafl_jax.privacy.secagg.mm_quantile`): losses clipped to [0, B] (``--dp_loss_bound``) and
beta_k = 1 / max(|F_k - mu|, xi) (``--dp_mm_floor``), with Gaussian noise of z_q
sqrt(B^2 + 1) on the first sum (F_k, 1) and z_q sqrt(B^2 + 1) / xi on every later one
(beta_k F_k, beta_k), z_q = ``--dp_quantile_noise_ratio`` x z. The clients then filter
themselves (F_k > eta).

Accounting (:class:`Accounting`). The simulator draws exactly m of the N training clients
without replacement each round, so two neighbouring populations differ by one client replaced
by another (with a fixed m, adding one would not add a term). Under that relation each release
of a round is a Gaussian mechanism whose noise multiplier (noise std / sensitivity) is z / 2
for the update (sensitivity 2 C a_max), z for Delta-FL's kept weight (each client adds 0 or
1), z_q sqrt(B^2 + 1) / B for the first quantile sum (replacing a client changes its F_k by at
most B, its 1 not at all) and z_q for every later one (its two entries lie in [0, B / xi] and
[0, 1 / xi]). A round is their composition on a sample of m of N without replacement, and the
replica's epsilon after t rounds at ``--dp_delta`` (default 1 / N^1.1) is dp-accounting's RDP
accountant's (replace-one relation) for t self-compositions of that event
(:func:`round_event`). DP-FedAvg's own analysis (and DP-SGD's) samples each client
independently with probability q and takes add-or-remove neighbours: :func:`poisson_event`,
which the tests use to reproduce a published figure.

Poisson client sampling (``--client_sampling=poisson``, :mod:`deltafl_jax.sampling.samplers`): each
training client joins a round independently with probability q = m / N, and two neighbouring
populations differ by one client added or removed. Each release's multiplier is then its noise
std over the add-or-remove sensitivity: z for the update (one client adds at most C a_max), z
for the kept weight, z_q for every quantile sum (``PrivateAggregate.add_remove_releases``). A
round is ``PoissonSampledDpEvent(q, GaussianDpEvent(z_eff))``, z_eff = z (sum_i r_i^-2)^-1/2
the one Gaussian mechanism equivalent to the composition of Gaussians with multipliers z r_i
on the same sample (their joint privacy loss is that Gaussian's; dp-accounting's RDP
accountant reduces them the same way), self-composed over the rounds, under dp-accounting's
PLD accountant (``--dp_accountant=pld``, the default under Poisson; ``rdp`` keeps the RDP
accountant). The plan has a fixed number of slots, the cap M
(:func:`deltafl_jax.sampling.samplers.poisson_cap`):
a round whose cohort overflows it trains a uniform M of its clients. Truncation changes the
mechanism only on the overflow event, so with P the probability that any round of the run
overflows (union bound, population N + 1) the truncated run is (epsilon, delta + (1 + e^eps) P)
-DP when the Poisson one is (epsilon, delta) (its output law is within P in total variation on
each of the two neighbouring populations). The cap is the smallest M that makes that term at
most delta / 1000 at the run's largest finite epsilon, and the term itself is recorded
(``overflow_delta``). DP-FedAvg under Poisson divides by the fixed expected weight q N (every
sampled client weighs a_max = 1 / (q N), :func:`poisson_weights`; McMahan et al. 2018), not
by the realised cohort.

Adaptive clipping (``--dp_clip=adaptive``; Andrew, Thakkar, McMahan, Ramaswamy, *Differentially
Private Learning with Adaptive Clipping*, NeurIPS 2021) for the private versions with a fixed
denominator (DP-FedAvg; private Delta-FL with ``--dp_kept_weight=expected``): each replica's
clip C_t lives in the round state (checkpointed with it); each round the server also
receives the count of trained clients whose update was not clipped, b = sum_k [||Delta_k||
<= C_t], with noise N(0, (r z)^2) (r = ``--dp_clip_count_noise``), and moves the clip
geometrically toward the target quantile gamma: C_{t+1} = C_t exp(-eta_C (b~ - gamma)),
b~ = (b + noise) / the expected count of trained clients (m for DP-FedAvg;
:func:`adaptive_clip`). Each client adds 0 or 1 to the count under either relation, so that
release's multiplier is r z; the accountant composes it with the update's.

DP-FTRL with a banded matrix factorisation (``--dp_mechanism=bandmf``; Kairouz et al. 2021,
Choquette-Choo et al., *(Amplified) Banded Matrix Factorization*, NeurIPS 2023) for
DP-FedAvg under cyclic participation (``--client_sampling=cyclic``: round t trains group
t mod G of G = N // m fixed groups, so a client's rounds are G apart). The released sums
S_t = sum_k a_k clip(Delta_k) (one client's share at most C a_max) form a matrix X (rows:
rounds); the mechanism releases C X + Z for a lower-triangular banded Toeplitz C (b bands,
``--dp_bands``, coefficients c_0..c_{b-1} optimised for the prefix sums that FedAvg's model
is, by ``jax-privacy``'s ``optimize_banded_toeplitz``), which the server turns back into
X + C^-1 Z: round t adds W_t = (Z_t - sum_{j=1}^{b-1} c_j W_{t-j}) / c_0 to S_t, so each
replica keeps its last b - 1 noise vectors in the round state (:func:`bandmf_privatize`).
Z_t ~ N(0, (z C a_max s_T)^2 I), where s_T, the sensitivity of C X over the T rounds in units
of C a_max, is jax-privacy's ``minsep_sensitivity_squared`` for participations G apart (at
most ceil(T / G) of them; with b <= G the columns do not overlap and s_T = sqrt(ceil(T/G)) for
c of norm 1). The whole run is then one Gaussian mechanism with multiplier z under
add-or-remove (a client's contributions present or zero); after t < T rounds its prefix has
sensitivity s_t, multiplier z s_T / s_t (:class:`Correlated`). ``--dp_mechanism=gaussian``
under cyclic participation is the case b = 1 (c = (1,), independent noise each round): k
compositions of a Gaussian without amplification.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple, Union

from deltafl_jax.declared import check_finite, floats, setting
from deltafl_jax.errors import ConfigError, UsageError

NOISE_STREAM = 0x5EC   # folded into a replica's round key for the server's noise
# The model update's noise multiplier relative to z under the replace-one relation: its noise
# std is z C a_max and replacing one client moves the sum by up to 2 C a_max.
UPDATE_RELEASE = 0.5
# Under add-or-remove (Poisson sampling) one client moves the sum by at most C a_max: z.
UPDATE_RELEASE_ADD_REMOVE = 1.0
ACCOUNTANT = ("dp-accounting RDP, replace-one neighbours, m of N sampled without replacement "
              "each round")
CLIP_STREAM = 0xC11    # folded into a replica's round key for the clip count's noise
ACCOUNTANTS = ("pld", "rdp")
ADAPTIVE = "adaptive"
KEPT_WEIGHTS = ("noised", "expected")   # private Delta-FL's denominator
MECHANISMS = ("gaussian", "bandmf")
# The overflow term (1 + e^eps) P of a capped Poisson run is kept below delta / this.
OVERFLOW_SHARE = 1000.0
# A non-private Poisson run's cap: an overflow anywhere in the run has at most this chance.
OVERFLOW_PLAIN = 1e-9
# The default delta 1 / N^1.1 above this (N below about 530) is reported as large: it is the
# chance that the guarantee fails outright, and --dp_delta should be set.
LARGE_DELTA = 1e-3
PLD_LOWEST_Z = 0.05   # the smallest z that calibration tries with the PLD accountant
PLD_BRACKET = 0.7     # the PLD search's lower end, relative to the RDP accountant's z
CALIBRATION_TOL = 1e-6  # calibrated z to this (absolute; then rounded up to float32)
PLD_CALIBRATION_TOL = 1e-4   # the PLD search's (each step costs a PLD composition)
PLD_COARSE = 1e-3     # the PLD search's discretisation interval (the accountant's: 1e-4)


def describe_accountant(sampler: str, accountant: str) -> str:
    """The accountant, the neighbouring relation and the sampler, in words."""
    if sampler == "fixed":
        return ACCOUNTANT
    if sampler == "cyclic":
        return (f"dp-accounting {accountant.upper()}, add-or-remove neighbours, cyclic "
                f"participation (G = N // m groups, a client every G rounds): one Gaussian "
                f"mechanism over the run's banded matrix factorisation")
    name = "PLD" if accountant == "pld" else "RDP"
    return (f"dp-accounting {name}, add-or-remove neighbours, Poisson sampling (each client "
            f"independently with probability q = m / N each round)")


def clip_flag(name: str, value):
    """--dp_clip: None, 'adaptive' or a number (UsageError otherwise)."""
    if value is None or value.strip() == ADAPTIVE:
        return None if value is None else ADAPTIVE
    try:
        return float(value)
    except ValueError:
        raise UsageError(f"--{name} must be a number C > 0 or 'adaptive', got {value!r}") \
            from None


def check_private_version(privacy: "Privacy", sampler: str, spec, algorithm=None,
                          tuned: bool = False) -> None:
    """With --dp_clip: ConfigError unless the algorithm has a private version that this run
    can use. The one place that refuses a private run for its algorithm: the configuration
    calls it with the spec alone (an algorithm with no private version at all, refused before
    any data is loaded), the resolve step with the built `algorithm` (its options may leave
    it none; the tuner's grid, adaptive clipping and cyclic sampling need more of it).
    `sampler`: the run's ``--client_sampling`` (:class:`deltafl_jax.sampling.Sampling`)."""
    if not privacy.enabled:
        return
    if not spec.dp_requires:
        raise ConfigError(f"--algorithm={spec.name} has no private version (--dp_clip): its "
                          "round releases more than a bounded-weight average of clipped "
                          "updates (per-client state, loss-driven weights or its own step)")
    if algorithm is None:
        return
    private = algorithm.private
    if private is None:
        raise ConfigError(f"--dp_clip: --algorithm={spec.name} has a private version only with "
                          f"{spec.dp_requires}")
    if tuned:
        raise ConfigError("--dp_clip applies to the replicas of the algorithm's own sweep, not "
                          "to a grid given with them (the tuner's)")
    if privacy.adaptive and private.denominator is None:
        raise ConfigError(f"--dp_clip=adaptive: the clip's target fraction needs a fixed "
                          f"denominator (DP-FedAvg; private Delta-FL with "
                          f"--dp_kept_weight=expected); --algorithm={spec.name}'s private "
                          f"version divides by a noised kept weight")
    if sampler == "cyclic" and (private.denominator is None or private.releases):
        raise ConfigError(f"--client_sampling=cyclic with --dp_clip: --algorithm={spec.name}'s "
                          f"private version releases more than its update (DP-FTRL's account "
                          f"covers DP-FedAvg and DP-FedProx)")


@dataclasses.dataclass(frozen=True)
class Privacy:
    """The DP settings of a run (module docstring); ``clip`` None = not private. The sampler
    they account is the run's ``--client_sampling`` (:class:`deltafl_jax.sampling.Sampling`),
    which the checks and the accountant take as `sampler`.

    clip: C, or "adaptive" (the clip adapts from clip_init toward the unclipped fraction
    clip_quantile at rate clip_lr, its count noised at clip_count_noise x z; the clip applied
    first is :attr:`initial_clip`). noise_multipliers: z, one per value (several: swept as
    replicas). target_epsilons: epsilon per value instead of z, each calibrated to a z for the
    run's rounds (inf: z = 0). delta: None = 1 / N^1.1. quantile_noise_ratio: z_q / z for
    private Delta-FL's secure sums. loss_bound: B. mm_floor: xi. accountant: pld | rdp (None:
    by sampler, :meth:`accountant_for`). kept_weight: private
    Delta-FL's denominator, the noised kept weight or its expectation theta m.
    """

    clip: Optional[Union[float, str]] = setting(
        None, "client-level DP (DP-FedAvg): clip each client's update to this L2 norm C; "
        "'adaptive': a clip per replica that follows the --dp_clip_quantile of the update norms "
        "(Andrew et al. 2021); unset: not private", flag="dp_clip", kind="string",
        parse=clip_flag)
    clip_init: float = setting(0.1, "--dp_clip=adaptive: the initial clip C_0",
                               flag="dp_clip_init")
    clip_quantile: float = setting(
        0.5, "--dp_clip=adaptive: the target quantile gamma of the update norms (the fraction "
        "left unclipped)", flag="dp_clip_quantile")
    clip_lr: float = setting(0.2, "--dp_clip=adaptive: eta_C of the geometric step C <- C "
                             "exp(-eta_C (b - gamma))", flag="dp_clip_lr")
    clip_count_noise: float = setting(
        5.0, "--dp_clip=adaptive: the noise std of the unclipped count, relative to z "
        "(accounted)", flag="dp_clip_count_noise")
    kept_weight: str = setting(
        "noised", "private Delta-FL: divide the noised update by the kept weight released with "
        "noise (noised) or by its expectation theta m, fixed and not released (expected)",
        flag="dp_kept_weight", choices=KEPT_WEIGHTS)
    mechanism: str = setting(
        "gaussian", "gaussian: independent noise each round | bandmf: DP-FTRL's banded matrix "
        "factorisation (correlated noise; needs --client_sampling=cyclic)",
        flag="dp_mechanism", choices=MECHANISMS)
    bands: Optional[int] = setting(
        None, "--dp_mechanism=bandmf: the bands b of the Toeplitz strategy (each replica keeps "
        "b - 1 noise vectors); unset: min(G, rounds), G = N // m", flag="dp_bands",
        kind="integer")
    accountant: Optional[str] = setting(
        None, "pld | rdp: dp-accounting's accountant; unset: rdp with --client_sampling=fixed "
        "(replace-one), pld with poisson (add-or-remove)", flag="dp_accountant",
        kind="enum", choices=ACCOUNTANTS)
    noise_multipliers: Tuple[float, ...] = setting(
        (0.0,), "z: the server adds N(0, (z C a_max)^2) to the sum of the clipped updates; "
        "several values train as replicas", flag="dp_noise_multiplier", parse=floats)
    target_epsilons: Tuple[float, ...] = setting(
        (), "epsilon at --dp_delta after the run's rounds, each value calibrated to a z before "
        "the run (inf: no noise); several values train as replicas; instead of "
        "--dp_noise_multiplier", flag="dp_target_epsilon", parse=floats)
    delta: Optional[float] = setting(
        None, "delta of the accounting; unset: 1 / N^1.1 with N the training clients",
        flag="dp_delta", kind="float")
    quantile_noise_ratio: float = setting(
        1.0, "private Delta-FL: the noise multiplier of each secure sum of its quantile, "
        "relative to z", flag="dp_quantile_noise_ratio")
    loss_bound: float = setting(
        10.0, "private Delta-FL: the losses are clipped to [0, B] for the quantile's secure sums",
        flag="dp_loss_bound")
    mm_floor: float = setting(
        0.1, "private Delta-FL: the MM weights are 1 / max(|F_k - mu|, xi), which bounds their "
        "sensitivity", flag="dp_mm_floor")
    def __post_init__(self):
        for name in ("noise_multipliers", "target_epsilons"):
            v = getattr(self, name)
            object.__setattr__(self, name, tuple(v) if isinstance(v, (tuple, list)) else (v,))

    @property
    def enabled(self) -> bool:
        return self.clip is not None

    @property
    def adaptive(self) -> bool:
        """--dp_clip=adaptive."""
        return self.clip == ADAPTIVE

    @property
    def initial_clip(self) -> Optional[float]:
        """The clip of the first round: C, or C_0 with --dp_clip=adaptive (None: not private)."""
        return self.clip_init if self.adaptive else self.clip

    def accountant_for(self, sampler: str) -> str:
        """pld or rdp: as given, else rdp for fixed sampling and pld for Poisson."""
        if self.accountant is not None:
            return self.accountant
        return "rdp" if sampler == "fixed" else "pld"

    def check(self, sampler: str = "fixed") -> None:
        """ConfigError naming the flag at fault; `sampler`: the run's --client_sampling."""
        if isinstance(self.clip, str) and self.clip != ADAPTIVE:
            raise ConfigError(f"--dp_clip must be a number C > 0 or 'adaptive', got "
                              f"{self.clip!r}")
        if not self.adaptive and self.clip_init != Privacy().clip_init:
            raise ConfigError("--dp_clip_init needs --dp_clip=adaptive")
        if not self.enabled:
            self._check_unset()
            return
        _positive("dp_clip_init" if self.adaptive else "dp_clip", self.initial_clip)
        self._check_sampling(sampler)
        self._check_adaptive(sampler)
        for z in self.noise_multipliers:
            _number("dp_noise_multiplier", z, 0.0)
        for e in self.target_epsilons:
            if isinstance(e, bool) or not isinstance(e, (int, float)) or not e > 0:
                raise ConfigError(f"--dp_target_epsilon must be > 0 (inf: no noise), got {e!r}")
        if self.target_epsilons and tuple(self.noise_multipliers) != (0.0,):
            raise ConfigError("give --dp_noise_multiplier or --dp_target_epsilon, not both")
        for flag, values in (("dp_noise_multiplier", self.noise_multipliers),
                             ("dp_target_epsilon", self.target_epsilons)):
            if len(set(values)) != len(values):
                raise ConfigError(f"--{flag} lists a value twice: {list(values)}")
        if self.delta is not None and not 0.0 < self.delta < 1.0:
            raise ConfigError(f"--dp_delta must lie in (0, 1), got {self.delta!r}")
        _number("dp_quantile_noise_ratio", self.quantile_noise_ratio, 0.0)
        _positive("dp_loss_bound", self.loss_bound)
        _number("dp_mm_floor", self.mm_floor, 0.0)
        noisy = any(z > 0 for z in self.noise_multipliers) or any(
            math.isfinite(e) for e in self.target_epsilons)
        if noisy and self.mm_floor == 0:
            raise ConfigError("--dp_mm_floor must be > 0 with noise: 1/|F_k - mu| has no bound")
        if noisy and self.quantile_noise_ratio == 0:
            raise ConfigError("--dp_quantile_noise_ratio must be > 0 with noise: a quantile "
                              "released without noise has no finite epsilon")

    def _check_unset(self) -> None:
        """Without --dp_clip: no other --dp_* flag."""
        d = Privacy()
        given = [f for f, on in (("dp_target_epsilon", bool(self.target_epsilons)),
                                 ("dp_noise_multiplier", tuple(self.noise_multipliers) != (0.0,)),
                                 ("dp_delta", self.delta is not None),
                                 ("dp_quantile_noise_ratio",
                                  self.quantile_noise_ratio != d.quantile_noise_ratio),
                                 ("dp_loss_bound", self.loss_bound != d.loss_bound),
                                 ("dp_mm_floor", self.mm_floor != d.mm_floor),
                                 ("dp_accountant", self.accountant is not None),
                                 ("dp_kept_weight", self.kept_weight != d.kept_weight),
                                 ("dp_mechanism", self.mechanism != d.mechanism),
                                 ("dp_bands", self.bands is not None),
                                 ("dp_clip_quantile", self.clip_quantile != d.clip_quantile),
                                 ("dp_clip_lr", self.clip_lr != d.clip_lr),
                                 ("dp_clip_count_noise",
                                  self.clip_count_noise != d.clip_count_noise)) if on]
        if given:
            raise ConfigError(f"--{given[0]} needs --dp_clip (the clip norm C of the "
                              f"clients' updates)")

    def _check_sampling(self, sampler: str) -> None:
        """The accountant, the mechanism and the kept weight against the sampler."""
        if self.mechanism not in MECHANISMS:
            raise ConfigError(f"--dp_mechanism must be one of {', '.join(MECHANISMS)}, got "
                              f"{self.mechanism!r}")
        if self.mechanism == "bandmf" and sampler != "cyclic":
            raise ConfigError("--dp_mechanism=bandmf needs --client_sampling=cyclic: its "
                              "sensitivity assumes a client's rounds at least G = N // m apart")
        if self.bands is not None:
            if self.mechanism != "bandmf":
                raise ConfigError("--dp_bands needs --dp_mechanism=bandmf")
            if isinstance(self.bands, bool) or not isinstance(self.bands, int) \
                    or self.bands < 1:
                raise ConfigError(f"--dp_bands must be an integer >= 1, got {self.bands!r}")
        if self.kept_weight not in KEPT_WEIGHTS:
            raise ConfigError(f"--dp_kept_weight must be one of {', '.join(KEPT_WEIGHTS)}, got "
                              f"{self.kept_weight!r}")
        if self.accountant is not None and self.accountant not in ACCOUNTANTS:
            raise ConfigError(f"--dp_accountant must be one of {', '.join(ACCOUNTANTS)}, got "
                              f"{self.accountant!r}")
        if self.accountant is not None and sampler == "fixed" and self.accountant != "rdp":
            raise ConfigError("--dp_accountant=pld needs --client_sampling=poisson: "
                              "dp-accounting's PLD accountant has no event for m of N sampled "
                              "without replacement (fixed sampling uses its RDP accountant)")

    def _check_adaptive(self, sampler: str) -> None:
        """--dp_clip=adaptive's settings, and none of them without it."""
        d = Privacy()
        if not self.adaptive:
            for flag, v, dv in (("dp_clip_quantile", self.clip_quantile, d.clip_quantile),
                                ("dp_clip_lr", self.clip_lr, d.clip_lr),
                                ("dp_clip_count_noise", self.clip_count_noise,
                                 d.clip_count_noise)):
                if v != dv:
                    raise ConfigError(f"--{flag} needs --dp_clip=adaptive")
            return
        if sampler == "cyclic":
            raise ConfigError("--dp_clip=adaptive applies with --client_sampling=fixed or "
                              "poisson, not cyclic (its count would need its own "
                              "multi-participation accounting)")
        q = self.clip_quantile
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < q < 1.0:
            raise ConfigError(f"--dp_clip_quantile must lie in (0, 1), got {q!r}")
        _positive("dp_clip_lr", self.clip_lr)
        _positive("dp_clip_count_noise", self.clip_count_noise)

    @property
    def swept(self) -> Tuple[Tuple[str, Tuple[float, ...]], ...]:
        """The values that name replicas when several are trained: (flag, values)."""
        if self.target_epsilons:
            return (("dp_target_epsilon", tuple(self.target_epsilons)),)
        return (("dp_noise_multiplier", tuple(self.noise_multipliers)),)

    def delta_for(self, num_clients: int) -> float:
        return self.delta if self.delta is not None else float(num_clients) ** -1.1

    def delta_warning(self, num_clients: int) -> Optional[str]:
        """One warning line when --dp_delta is unset and its default 1 / N^1.1 exceeds
        LARGE_DELTA (a small population), else None."""
        delta = self.delta_for(num_clients)
        if self.delta is not None or delta <= LARGE_DELTA:
            return None
        return (f"deltafl_jax: warning: the default delta = 1/N^1.1 = {delta:.3g} at N = "
                f"{num_clients} training clients is large (the chance that the guarantee fails "
                f"outright, above {LARGE_DELTA:g}); set --dp_delta, e.g. --dp_delta=1e-5")

    def noise_multipliers_for(self, m: int, rounds: int, num_clients: int,
                              releases: Sequence[float],
                              correlated: Optional["Correlated"] = None,
                              sampler: str = "fixed") -> Tuple[float, ...]:
        """z for each swept value: as given, or calibrated to each target epsilon; each a
        float32 number (the round's), rounded up so that the accounted z is the applied one
        and a calibrated epsilon stays within its target."""
        if not self.target_epsilons:
            zs = tuple(float(z) for z in self.noise_multipliers)
        else:
            delta = self.delta_for(num_clients)
            ledger = Ledger(num_clients, m, releases, rounds, delta, sampler,
                            self.accountant_for(sampler), correlated)
            zs = tuple(calibrate(e, ledger) for e in self.target_epsilons)
        return tuple(float32_at_least(z) for z in zs)


def float32_at_least(x: float) -> float:
    """The smallest float32 number >= x, as a Python float."""
    import numpy as np
    y = np.float32(x)
    return float(y if float(y) >= x else np.nextafter(y, np.float32(np.inf)))


class _QuietAccountant:
    """dp-accounting logs (through absl) each Renyi order it drops for not converging, which
    is routine at small z; those lines are held back while it computes."""

    def __enter__(self):
        import logging
        self.logger = logging.getLogger("absl")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def _number(flag, v, low):
    check_finite(flag, v, low)


def _positive(flag, v):
    check_finite(flag, v, 0.0, low_open=True)


def _gaussians(z: float, releases: Sequence[float]):
    """The composition of Gaussian mechanisms with noise multipliers z r, r in `releases`."""
    import dp_accounting
    gaussians = [dp_accounting.GaussianDpEvent(z * r) for r in releases]
    return gaussians[0] if len(gaussians) == 1 else dp_accounting.ComposedDpEvent(gaussians)


def round_event(population: int, m: int, z: float, releases: Sequence[float]):
    """One round as a ``dp_accounting`` event: the releases (noise multipliers z r) on m of
    `population` clients sampled without replacement (replace-one relation)."""
    import dp_accounting
    return dp_accounting.SampledWithoutReplacementDpEvent(population, m, _gaussians(z, releases))


def poisson_event(q: float, z: float, releases: Sequence[float]):
    """The same releases on clients sampled independently with probability q (DP-SGD's and
    DP-FedAvg's analyses; add-or-remove relation)."""
    import dp_accounting
    return dp_accounting.PoissonSampledDpEvent(q, _gaussians(z, releases))


def effective_multiplier(z: float, releases: Sequence[float]) -> float:
    """z (sum_i r_i^-2)^-1/2: the multiplier of the one Gaussian mechanism equivalent to the
    composition of Gaussians with multipliers z r_i on the same sample."""
    return z / math.sqrt(sum(1.0 / (r * r) for r in releases))


def poisson_round_event(population: int, m: int, z: float, releases: Sequence[float]):
    """One Poisson round (q = m / population) of the releases with add-or-remove multipliers
    z r: ``PoissonSampledDpEvent(q, GaussianDpEvent(z_eff))``."""
    import dp_accounting
    return dp_accounting.PoissonSampledDpEvent(
        m / population, dp_accounting.GaussianDpEvent(effective_multiplier(z, releases)))


def _replace_one():
    from dp_accounting import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant
    return RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)


def _add_or_remove(accountant: str):
    from dp_accounting import NeighboringRelation
    if accountant == "pld":
        from dp_accounting.pld import PLDAccountant
        return PLDAccountant(neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    from dp_accounting.rdp import RdpAccountant
    return RdpAccountant(neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)


@dataclasses.dataclass(frozen=True)
class Correlated:
    """BandMF's noise (module docstring): the banded Toeplitz coefficients c (float32
    numbers, as the round applies them), the participations' separation G, and the run's
    rounds T."""

    coef: Tuple[float, ...]
    min_sep: int
    rounds: int

    def sensitivity(self, rounds: int) -> float:
        """s_t: the L2 sensitivity of the first `rounds` rows of C X, in units of C a_max
        (jax-privacy's ``minsep_sensitivity_squared``, in float64)."""
        import jax
        import jax.numpy as jnp
        from jax_privacy.matrix_factorization import toeplitz
        with jax.enable_x64(True):
            sq = toeplitz.minsep_sensitivity_squared(jnp.asarray(self.coef, jnp.float64),
                                                     self.min_sep, None, n=int(rounds))
            return math.sqrt(float(sq))

    def scale(self, rounds: int) -> float:
        """s_T / s_t: the prefix's multiplier over z."""
        return self.sensitivity(self.rounds) / self.sensitivity(rounds)


def bandmf_coefficients(rounds: int, bands: int) -> Tuple[float, ...]:
    """c_0..c_{b-1} of a b-banded Toeplitz strategy for the prefix sums of `rounds` rounds
    (jax-privacy's ``optimize_banded_toeplitz``: mean squared error, norm 1), as float32
    numbers; (1,) for one band."""
    import numpy as np
    bands = min(int(bands), int(rounds))
    if bands <= 1:
        return (1.0,)
    from jax_privacy.matrix_factorization import toeplitz
    with _QuietAccountant():
        c = toeplitz.optimize_banded_toeplitz(int(rounds), bands)
    return tuple(float(v) for v in np.asarray(c, np.float32))


def bandmf_privatize(private, clip: float, m: int, coef: Tuple[float, ...], scale: float,
                     feedback, hyper, key, z, history):
    """One replica's feedback under BandMF (module docstring): W_t = (Z_t - sum_{j>=1} c_j
    W_{t-j}) / c_0 added to the sum, Z_t ~ N(0, (z C a_max s_T)^2 I) (`scale` = s_T), the
    algorithm's fixed denominator; `history`: W_{t-1}, ..., W_{t-b+1} (leaves [b-1, ...]).
    Returns (feedback, the new history)."""
    import jax
    import jax.numpy as jnp
    a_max = jnp.asarray(private.max_weight(hyper, m), jnp.float32)
    leaves, treedef = jax.tree.flatten(feedback.delta_sum)
    past = treedef.flatten_up_to(history)
    keys = jax.random.split(jax.random.fold_in(key, NOISE_STREAM), len(leaves) + 1)
    noisy, kept = [], []
    for x, k, h in zip(leaves, keys[1:], past):
        w = z * clip * a_max * scale * jax.random.normal(k, x.shape, jnp.float32)
        for j in range(1, len(coef)):
            w = w - coef[j] * h[j - 1]
        w = w / coef[0]
        noisy.append(x + w.astype(x.dtype))
        kept.append(jnp.concatenate([w[None], h[:-1]], axis=0) if len(coef) > 1 else h)
    total = jnp.asarray(private.denominator(hyper, m), jnp.float32)
    return (feedback._replace(delta_sum=jax.tree.unflatten(treedef, noisy), weight_sum=total),
            jax.tree.unflatten(treedef, kept))


@dataclasses.dataclass(frozen=True)
class Ledger:
    """What the accountant composes: `rounds` rounds, each sampling m of `population`
    clients (Poisson: m expected) and releasing `releases` (noise multipliers relative to z,
    the update's first); epsilon at `delta`."""

    population: int
    m: int
    releases: Sequence[float]
    rounds: int
    delta: float
    sampler: str = "fixed"        # "fixed" (:data:`ACCOUNTANT`, replace-one) or "poisson"
    accountant: str = "rdp"       # Poisson's accountant, add-or-remove: "rdp" or "pld"
    correlated: Optional[Correlated] = None   # BandMF's noise (one Gaussian over the prefix)


def _ledger(ledger: Ledger):
    """(a fresh accountant maker, z -> the run's event) of a sampler and an accountant."""
    import dp_accounting
    population, m, releases, rounds = (ledger.population, ledger.m, ledger.releases,
                                       ledger.rounds)
    accountant, correlated = ledger.accountant, ledger.correlated
    if correlated is not None:   # one Gaussian mechanism over the whole prefix
        scale = correlated.scale(rounds)
        return (lambda: _add_or_remove(accountant)), \
            lambda z: dp_accounting.GaussianDpEvent(z * scale)
    if ledger.sampler == "fixed":
        return _replace_one, lambda z: dp_accounting.SelfComposedDpEvent(
            round_event(population, m, z, releases), rounds)
    return (lambda: _add_or_remove(accountant)), lambda z: dp_accounting.SelfComposedDpEvent(
        poisson_round_event(population, m, z, releases), rounds)


def _epsilon_of(fresh, event, z, delta) -> float:
    acc = fresh()
    acc.compose(event(z))
    return float(acc.get_epsilon(delta))


def epsilon(ledger: Ledger, z: float) -> float:
    """epsilon at ``ledger.delta`` after ``ledger.rounds`` rounds with noise multiplier z
    (fixed sampling: :data:`ACCOUNTANT`; Poisson: :func:`poisson_round_event` under the
    ledger's accountant, add-or-remove); inf without noise, 0 before the first round."""
    if ledger.rounds <= 0:
        return 0.0
    if z <= 0:
        return math.inf
    fresh, event = _ledger(ledger)
    with _QuietAccountant():
        acc = fresh()
        acc.compose(event(z))
        return float(acc.get_epsilon(ledger.delta))


def calibrate(target: float, ledger: Ledger) -> float:
    """The smallest z whose epsilon after ``ledger.rounds`` rounds is at most `target` (0 for
    inf)."""
    if math.isinf(target):
        return 0.0
    import dp_accounting

    fresh, event = _ledger(ledger)
    bracket = dp_accounting.LowerEndpointAndGuess(1e-3, 1.0)
    try:
        if ledger.sampler != "fixed" and ledger.accountant == "pld":
            return _calibrate_pld(target, ledger, fresh, event)
        with _QuietAccountant():
            return float(dp_accounting.calibrate_dp_mechanism(
                fresh, event, target, ledger.delta, bracket_interval=bracket,
                tol=CALIBRATION_TOL))
    except Exception as e:   # pylint: disable=broad-except
        raise ConfigError(f"--dp_target_epsilon={target:g} cannot be calibrated for m = "
                          f"{ledger.m} of {ledger.population} clients, {ledger.rounds} rounds, "
                          f"delta = {ledger.delta:g}: {e}") from None


def _calibrate_pld(target, ledger: Ledger, fresh, event) -> float:
    """The PLD accountant's calibration. Its discretised loss grows as 1 / z^2, and each
    composition costs seconds at the default discretisation: the search runs on a 10x
    coarser grid (PLD_COARSE; its epsilon differs by ~1e-5 relative) between the RDP
    accountant's z (an upper bound: RDP's epsilon is the looser) and PLD_BRACKET of it
    (widened downward if needed), to PLD_CALIBRATION_TOL; then z grows by 1e-4 relative steps
    until the default accountant's epsilon is within the target."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    z_rdp = calibrate(target, dataclasses.replace(ledger, accountant="rdp"))
    delta = ledger.delta

    def coarse():
        return PLDAccountant(neighboring_relation=dp_accounting.NeighboringRelation
                             .ADD_OR_REMOVE_ONE, value_discretization_interval=PLD_COARSE)

    with _QuietAccountant():
        low = z_rdp * PLD_BRACKET
        while low > PLD_LOWEST_Z and _epsilon_of(coarse, event, low, delta) <= target:
            low *= PLD_BRACKET
        above = _epsilon_of(coarse, event, z_rdp, delta) > target
        bracket = (dp_accounting.LowerEndpointAndGuess(z_rdp, 2 * z_rdp) if above else
                   dp_accounting.ExplicitBracketInterval(max(low, PLD_LOWEST_Z), z_rdp))
        z = float(dp_accounting.calibrate_dp_mechanism(
            coarse, event, target, delta, bracket_interval=bracket, tol=PLD_CALIBRATION_TOL))
        while _epsilon_of(fresh, event, z, delta) > target:
            z *= 1.0 + PLD_CALIBRATION_TOL
    return z


def library_version() -> str:
    """dp-accounting's version (a resume must account with the same one)."""
    from importlib import metadata
    try:
        return metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:
        return "unknown"


# The clip scales to C (1 - 2^-20): float32 rounding of the scaled update's norm, about 2e-7
# relative, then stays within C.
CLIP_MARGIN = 1.0 - 2.0 ** -20


def clip_factor(sqnorm, clip: float):
    """min(1, C / ||Delta||) from ||Delta||^2 (1 for a zero update), to C (1 - 2^-20)."""
    import jax.numpy as jnp
    norm = jnp.sqrt(sqnorm)
    inside = clip * CLIP_MARGIN
    return jnp.where(norm > inside, inside / jnp.where(norm > 0, norm, 1.0), 1.0)


@dataclasses.dataclass(frozen=True)
class Accounting:
    """The privacy ledger of a run: m of `population` clients sampled per round (Poisson: m
    expected, q = m / population), the round's releases (noise multipliers relative to z under
    the sampler's relation, the update's first), delta, each replica's z (the float32 number
    the round applies), the sampler and the accountant; for Poisson the plan's cap and the
    run's rounds (the overflow term)."""

    population: int
    m: int
    releases: Tuple[float, ...]
    delta: float
    noise: Tuple[float, ...]
    sampler: str = "fixed"
    accountant: str = "rdp"
    cap: Optional[int] = None
    rounds: int = 0
    correlated: Optional[Correlated] = None

    def epsilons(self, rounds: int):
        """[R] epsilon of each replica after `rounds` rounds (float64; inf without noise)."""
        import numpy as np
        ledger = Ledger(self.population, self.m, self.releases, rounds, self.delta,
                        self.sampler, self.accountant, self.correlated)
        per_z = {z: epsilon(ledger, z) for z in set(self.noise)}
        return np.asarray([per_z[z] for z in self.noise], np.float64)

    def overflow_delta(self, eps: float) -> float:
        """(1 + e^eps) P: what a capped Poisson run adds to delta (0 for fixed sampling), P
        the probability that some round of the run overflows the cap."""
        if self.sampler != "poisson" or self.cap is None:
            return 0.0
        from deltafl_jax.sampling.samplers import overflow_probability
        p = min(1.0, self.rounds * overflow_probability(self.population + 1,
                                                        self.m / self.population, self.cap))
        return 0.0 if p == 0 else (math.inf if eps > 700 else (1.0 + math.exp(eps)) * p)

    def describe(self, labels) -> dict:
        """What summary.json records: the accountant, its inputs, each replica's z and its
        epsilon at delta after the run's rounds (``epsilon``, the final evaluation's
        ``dp_epsilon``), and under Poisson the sampler's q, cap and the overflow term at those
        epsilons."""
        out = {"accountant": describe_accountant(self.sampler, self.accountant),
               "dp_accounting_version": library_version(),
               "population": self.population, "clients_per_round": self.m,
               "delta": self.delta, "releases": list(self.releases),
               "noise_multiplier": {lab.key(): z for lab, z in zip(labels, self.noise)}}
        eps = (self.epsilons(self.rounds) if self.rounds > 0 or self.sampler == "poisson"
               else None)
        if self.rounds > 0:   # epsilon at delta after the run's rounds, per replica
            out["rounds"] = self.rounds
            out["epsilon"] = {lab.key(): float(e) for lab, e in zip(labels, eps)}
        if self.correlated is not None:
            c = self.correlated
            out.update({"sampler": "cyclic", "neighbours": "add-or-remove (zero-out)",
                        "mechanism": "bandmf" if len(c.coef) > 1 else "gaussian",
                        "bands": len(c.coef), "coefficients": list(c.coef),
                        "min_separation": c.min_sep,
                        "sensitivity": c.sensitivity(c.rounds)})
        if self.sampler == "poisson":
            out.update({"sampler": "poisson", "neighbours": "add-or-remove",
                        "sampling_probability": self.m / self.population, "cap": self.cap,
                        "overflow_delta": {lab.key(): self.overflow_delta(float(e))
                                           for lab, e in zip(labels, eps)}})
        return out


def poisson_weights(private, weights, hyper, m: int):
    """Under Poisson sampling a fixed-denominator private version (DP-FedAvg) weighs every
    sampled client a_max = its weight at the expected cohort m = q N, whatever the realised
    cohort (McMahan et al. 2018's estimator); others keep their weights."""
    import jax.numpy as jnp
    if private is None or private.denominator is None:
        return weights
    a_max = jnp.asarray(private.max_weight(hyper, m), jnp.float32)
    return jnp.where(weights > 0, a_max, 0.0).astype(weights.dtype)


def adaptive_clip(clip, unclipped, key, z, privacy: "Privacy", expected):
    """One replica's next clip (Andrew et al. 2021): C exp(-eta_C (b~ - gamma)), b~ = (the
    count of updates not clipped + N(0, (r z)^2)) / the expected count of trained clients
    (the fixed denominator over a_max: m for DP-FedAvg, theta m for private Delta-FL with
    --dp_kept_weight=expected); and b~."""
    import jax
    import jax.numpy as jnp
    noise = privacy.clip_count_noise * z * jax.random.normal(
        jax.random.fold_in(key, CLIP_STREAM), (), jnp.float32)
    frac = (unclipped.astype(jnp.float32) + noise) / expected
    return clip * jnp.exp(-privacy.clip_lr * (frac - privacy.clip_quantile)), frac
