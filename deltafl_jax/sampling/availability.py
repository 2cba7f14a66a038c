"""Who of the N training clients is online in each round: the availability models.

Availability is decided on the host, per client and round, before the server samples its
cohort among the clients online (see :mod:`deltafl_jax.sampling`). Every model is a pure
function of (seed, round) drawn with NumPy from ``SeedSequence`` keys of four words whose
third word is one of this module's stream ids (0xA7A1..0xA7A3); :mod:`deltafl_jax.plan`'s
keys are three words with a third word in 0..4, and a SeedSequence key pads with zeros, so no
key here equals one of theirs:

- ``[seed, round, STREAM, model]``: the round's draws (a Bernoulli round, a Markov step);
- ``[seed, 0, SEED_STREAM, model]``: a seed's draws made once (Markov's start, cyclic phases);
- ``[availability_seed, 0, MODEL_STREAM, what]``: draws of the model itself, the same for
  every seed of the run (the Dirichlet weights of data-correlated probabilities, the
  assignment of clients to traces by seed), so :meth:`Availability.rates` needs no seed.

The models (``--availability``; the laws are in ``docs/guides/availability.md``):

- ``always``: every client, every round.
- ``bernoulli``: client i online in a round with probability p_i, independently across
  clients and rounds. p_i (``--availability_probs``): ``uniform`` p_i = ``--availability_p``;
  ``data`` as the FedAU paper's code draws it (IBM/fedau, commit 6e9cce9b, util/util.py:
  ``data_participation_each_node``): p_i = max(p_min, C p_mean <d_i, w>) with d_i client i's
  label distribution (its label counts over its examples), w ~ Dir(alpha_p 1_C) drawn once
  and C the number of labels (defaults p_mean 0.1, p_min 0.02, alpha_p 0.1, as there);
  ``more_data`` / ``less_data`` as FLGo's MDF / LDF modes (WwZzz/easyFL, commit 19de9fb4,
  flgo/simulator/default_simulator.py): p_i = n_i^beta / max_j n_j^beta (MDF, beta 0.0001)
  and p_i = n_i^-beta / max_j n_j^-beta (LDF, beta 0.5), n_i client i's example count.
- ``markov``: a two-state chain per client (IBM/fedau's ``markov-q``, util/util.py
  ``WorkerSampler``): off -> on with probability b_i = q (``--availability_markov_off_on``),
  on -> off with a_i = q (1/p_i - 1), both divided by a_i when a_i > 1, so the stationary
  on-probability is p_i; round 0 is drawn from the stationary law (on with probability p_i),
  round r >= 1 is one step of the chain from round r - 1.
- ``cyclic``: client i online A_i = max(1, round(P p_i)) rounds in every A_i + I_i, with
  I_i = max(1, P - A_i) and P = ``--availability_period`` (IBM/fedau's ``cyclic-P``); its
  phase r0_i is uniform in [0, I_i) per seed: online in round r iff (r - r0_i) mod (A_i + I_i)
  < A_i (offline in rounds 0 .. r0_i - 1, as there).
- ``schedule``: an ``.npz`` holding ``available``, bool [rounds, N]: replayed as it is.
- ``trace``: device traces (FedScale's ``client_behave_trace`` pickle or FLASH's JSON; see
  :mod:`deltafl_jax.sampling.traces`) read at the times t_r = start + r x round seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import CheckpointMismatch, ConfigError, DataError

STREAM = 0xA7A1        # [seed, round, STREAM, model]: a round's draws
SEED_STREAM = 0xA7A2   # [seed, 0, SEED_STREAM, model]: a seed's draws made once
MODEL_STREAM = 0xA7A3  # [availability_seed, 0, MODEL_STREAM, what]: the model's own draws

MODELS = ("always", "bernoulli", "markov", "cyclic", "schedule", "trace")
PROBABILITIES = ("uniform", "data", "more_data", "less_data")
ASSIGNMENTS = ("modulo", "seed")
TRACE_FORMATS = ("auto", "fedscale", "flash")

# Stream words of each model ([.., .., STREAM or SEED_STREAM, word]).
_BERNOULLI, _MARKOV, _CYCLIC = 1, 2, 3
# Words of MODEL_STREAM draws.
_DIRICHLET, _ASSIGN = 1, 2

# FLGo's default beta of its MDF and LDF modes.
SIZE_BETA = {"more_data": 0.0001, "less_data": 0.5}


def _flag(name: str, value) -> str:
    return f"--{name}={value:g}" if isinstance(value, float) else f"--{name}={value}"


@dataclasses.dataclass(frozen=True)
class AvailabilitySettings:
    """Which clients are online in a round (module docstring; docs/guides/availability.md)."""

    model: str = setting(
        "always", "who is online each round: always (everyone) | bernoulli (client i with "
        "probability p_i) | markov (an on/off chain per client, stationary p_i) | cyclic (a "
        "window of every period) | schedule (--availability_schedule) | trace "
        "(--availability_trace)", flag="availability", choices=MODELS)
    probabilities: str = setting(
        "uniform", "bernoulli, markov, cyclic: each client's availability p_i: uniform "
        "(--availability_p) | data (FedAU: max(p_min, C p_mean <label distribution, "
        "Dir(alpha)>)) | more_data | less_data (FLGo's MDF / LDF: n_i^(+-beta) / its max)",
        flag="availability_probs", choices=PROBABILITIES)
    p: float = setting(0.1, "--availability_probs=uniform: every client's p_i",
                       flag="availability_p")
    p_mean: float = setting(0.1, "--availability_probs=data: p_mean", flag="availability_p_mean")
    p_min: float = setting(0.02, "--availability_probs=data: p_min, the smallest p_i",
                           flag="availability_p_min")
    alpha: float = setting(0.1, "--availability_probs=data: alpha of the Dirichlet weights "
                           "over the labels", flag="availability_alpha")
    size_beta: Optional[float] = setting(
        None, "--availability_probs=more_data|less_data: beta; unset: FLGo's (0.0001 for "
        "more_data, 0.5 for less_data)", flag="availability_size_beta", kind="float")
    seed: int = setting(0, "seeds the draws of the model itself (data-correlated weights, "
                        "traces assigned by seed), the same for every --seeds",
                        flag="availability_seed")

    def __post_init__(self):
        for name, value in (("availability_p", self.p), ("availability_p_min", self.p_min)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{_flag(name, value)}: a probability must be in [0, 1]")
        if not 0.0 < self.p_mean <= 1.0:
            raise ConfigError(f"{_flag('availability_p_mean', self.p_mean)}: must be in (0, 1]")
        if not self.alpha > 0.0:
            raise ConfigError(f"{_flag('availability_alpha', self.alpha)}: must be > 0")
        if self.size_beta is not None and not self.size_beta >= 0.0:
            raise ConfigError(f"{_flag('availability_size_beta', self.size_beta)}: must be "
                              f">= 0")


class Availability:
    """Who of the N training clients is online in each round of one seed's run.

    The base class is ``always``: every client, every round."""

    name = "always"

    def __init__(self, num_clients: int):
        self.num_clients = int(num_clients)

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        """Sorted int64 ids in [0, N) of the clients online in round `round_idx` of seed
        `seed`'s run; a pure function of (seed, round) for stateless models. Stateful models
        (markov) are called for one seed in increasing round order from 0, or from the round
        after the one their `restore`d state ends at (any other order is recomputed from
        round 0)."""
        del seed, round_idx
        return np.arange(self.num_clients, dtype=np.int64)

    def rates(self) -> np.ndarray:
        """[N] float64: each client's probability of being online in a round under the
        model's law (a schedule or trace: its empirical rate over the rounds of the run)."""
        return np.ones(self.num_clients, np.float64)

    def state(self, seed: int) -> Dict[str, np.ndarray]:
        """What a resumed run needs to go on bit for bit: {} for a stateless model."""
        del seed
        return {}

    def restore(self, seed: int, state: Dict[str, np.ndarray], next_round: int) -> None:
        """Take up `state` (from :meth:`state`) so that the next round asked is
        `next_round`; a stateless model has nothing to restore."""
        del seed, state, next_round


class Bernoulli(Availability):
    """Client i online with probability p_i in every round, independently."""

    name = "bernoulli"

    def __init__(self, p: np.ndarray):
        p = np.asarray(p, np.float64)
        super().__init__(p.size)
        self.p = p

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        rng = np.random.default_rng([int(seed), int(round_idx), STREAM, _BERNOULLI])
        return np.flatnonzero(rng.random(self.num_clients) < self.p).astype(np.int64)

    def rates(self) -> np.ndarray:
        return self.p.copy()


def check_probabilities(p: np.ndarray, what: str) -> np.ndarray:
    """`p` as float64 [N] in [0, 1], or a ConfigError naming `what` and the first bad one."""
    p = np.asarray(p, np.float64)
    bad = np.flatnonzero(~((p >= 0.0) & (p <= 1.0)))
    if bad.size:
        raise ConfigError(f"{what} gives client {bad[0]} the availability {p[bad[0]]:g}, "
                          f"outside [0, 1]")
    return p


def data_probabilities(settings: AvailabilitySettings,
                       label_counts: Optional[np.ndarray]) -> np.ndarray:
    """FedAU's data-correlated p_i = max(p_min, C p_mean <d_i, w>), w ~ Dir(alpha 1_C)
    (IBM/fedau util/util.py); d_i: client i's label counts over its examples (0 when it has
    none)."""
    if label_counts is None:
        raise ConfigError("--availability_probs=data needs the clients' label counts; this "
                          "dataset has none (not a classification task)")
    counts = np.asarray(label_counts, np.float64)
    if counts.ndim != 2 or np.any(counts < 0):
        raise DataError(f"label counts must be [clients, labels] and >= 0, got shape "
                        f"{counts.shape}")
    totals = counts.sum(axis=1, keepdims=True)
    d = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    num_labels = counts.shape[1]
    rng = np.random.default_rng([int(settings.seed), 0, MODEL_STREAM, _DIRICHLET])
    w = rng.dirichlet(np.full(num_labels, settings.alpha))
    p = np.maximum(settings.p_min, num_labels * settings.p_mean * (d @ w))
    return check_probabilities(p, f"--availability_probs=data with "
                                  f"{_flag('availability_p_mean', settings.p_mean)}")


def size_probabilities(settings: AvailabilitySettings, sizes: np.ndarray) -> np.ndarray:
    """FLGo's MDF (n_i^beta / max) or LDF (n_i^-beta / max) availability."""
    n = np.asarray(sizes, np.float64)
    if n.size == 0 or np.any(n <= 0):
        raise DataError(f"--availability_probs={settings.probabilities} needs every client to "
                        f"hold examples")
    beta = SIZE_BETA[settings.probabilities] if settings.size_beta is None else settings.size_beta
    c = n ** (beta if settings.probabilities == "more_data" else -beta)
    return c / c.max()


def client_probabilities(settings: AvailabilitySettings, num_clients: int, sizes: np.ndarray,
                         label_counts: Optional[np.ndarray]) -> np.ndarray:
    """p_i of every training client under ``--availability_probs``."""
    if settings.probabilities == "uniform":
        return np.full(num_clients, settings.p, np.float64)
    if settings.probabilities == "data":
        p = data_probabilities(settings, label_counts)
    else:
        p = size_probabilities(settings, sizes)
    if p.shape != (num_clients,):
        raise DataError(f"availability: {p.shape[0]} clients' data for {num_clients} clients")
    return p


def _never_online(p: np.ndarray, settings: AvailabilitySettings) -> None:
    if not np.any(p > 0.0):
        raise ConfigError(f"--availability={settings.model} with --availability_probs="
                          f"{settings.probabilities}: every client has availability 0, no "
                          f"client is ever online")


def build_availability(settings: AvailabilitySettings, *, num_clients: int,
                       sizes: np.ndarray, label_counts: Optional[np.ndarray],
                       num_rounds: int) -> Availability:
    """The availability model of a run: sizes [N] the training clients' example counts,
    label_counts [N, C] their label counts (None: no labels), num_rounds the run's rounds.
    Raises ConfigError or DataError (one line) for a model under which it cannot run."""
    del num_rounds
    if settings.model == "always":
        return Availability(num_clients)
    p = client_probabilities(settings, num_clients, sizes, label_counts)
    _never_online(p, settings)
    if settings.model == "bernoulli":
        return Bernoulli(p)
    raise ConfigError(f"--availability={settings.model} is not built yet")
