"""Who of the N training clients is online in each round: the availability models.

Availability is decided on the host, per client and round, before the server samples its
cohort among the clients online (see :mod:`deltafl_jax.sampling`). Every model is a pure
function of (seed, round) drawn with NumPy from ``SeedSequence`` keys of four words whose
third word is one of this module's stream ids (0xA7A1..0xA7A3) and whose fourth is >= 1. A
SeedSequence key pads with zeros, so no three-word key of the project (:mod:`deltafl_jax.sampling.plan`'s
``[seed, round, 0..4]``, the evaluation sample's, the synthetic clients') equals one here,
and no other four-word key has these third words:

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
from deltafl_jax.sampling.traces import TraceSet, load_schedule, load_traces

STREAM = 0xA7A1        # [seed, round, STREAM, model]: a round's draws
SEED_STREAM = 0xA7A2   # [seed, 0, SEED_STREAM, model]: a seed's draws made once
MODEL_STREAM = 0xA7A3  # [availability_seed, 0, MODEL_STREAM, what]: the model's own draws

MODELS = ("always", "bernoulli", "markov", "cyclic", "schedule", "trace")
PROBABILITIES = ("uniform", "data", "more_data", "less_data")
ASSIGNMENTS = ("modulo", "seed")
TRACE_FORMATS = ("auto", "fedscale", "flash")
CYCLIC_WINDOWS = ("phase", "labels")

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
    markov_off_on: float = setting(
        0.05, "markov: q, the off -> on probability (on -> off: q (1/p_i - 1); both divided by "
        "it when it exceeds 1), so client i is on a fraction p_i of the rounds",
        flag="availability_markov_off_on")
    cyclic: str = setting(
        "phase", "cyclic: phase (FedAU: round(P p_i) rounds on in every period, at a random "
        "phase) | labels (FLGo's YC: online in the part of the period between the client's "
        "smallest and largest label, else with probability 1 - --availability_cyclic_beta)",
        flag="availability_cyclic", choices=CYCLIC_WINDOWS)
    period: Optional[int] = setting(
        None, "cyclic: the period P in rounds; unset: 100 (phase) or 24 (labels, FLGo's)",
        flag="availability_period", kind="integer")
    cyclic_beta: float = setting(
        0.5, "--availability_cyclic=labels: outside its window a client is online with "
        "probability 1 - beta", flag="availability_cyclic_beta")
    schedule: Optional[str] = setting(
        None, "--availability=schedule: an .npz holding 'available', bool [rounds, N] over the "
        "training clients in id order, replayed as it is", flag="availability_schedule",
        kind="string")
    trace: Optional[str] = setting(
        None, "--availability=trace: a device trace file, FedScale's client_behave_trace (a "
        "pickle, read by a restricted unpickler) or FLASH's JSON", flag="availability_trace",
        kind="string")
    trace_format: str = setting(
        "auto", "the format of --availability_trace: fedscale | flash | auto (flash for a "
        ".json file, else fedscale)", flag="availability_trace_format", choices=TRACE_FORMATS)
    round_seconds: float = setting(
        60.0, "--availability=trace: the seconds of trace time per round: round r is read at "
        "t = --availability_trace_start + r x this", flag="availability_round_seconds")
    trace_start: float = setting(
        0.0, "--availability=trace: the trace time (seconds) of round 0",
        flag="availability_trace_start")
    assign: str = setting(
        "modulo", "--availability=trace: client i replays trace i mod K in the file's order "
        "(modulo, as FedScale) or trace perm[i mod K] for a permutation drawn from "
        "--availability_seed (seed)", flag="availability_assign", choices=ASSIGNMENTS)

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
        self._check_more()

    def _check_more(self):
        if not 0.0 < self.markov_off_on <= 1.0:
            raise ConfigError(f"{_flag('availability_markov_off_on', self.markov_off_on)}: a "
                              f"probability must be in (0, 1]")
        if not 0.0 <= self.cyclic_beta <= 1.0:
            raise ConfigError(f"{_flag('availability_cyclic_beta', self.cyclic_beta)}: a "
                              f"probability must be in [0, 1]")
        if self.period is not None and self.period < 1:
            raise ConfigError(f"{_flag('availability_period', self.period)}: must be >= 1")
        if not self.round_seconds > 0.0:
            raise ConfigError(f"{_flag('availability_round_seconds', self.round_seconds)}: "
                              f"must be > 0")
        for model, name, value in (("schedule", "availability_schedule", self.schedule),
                                   ("trace", "availability_trace", self.trace)):
            if self.model == model and not value:
                raise ConfigError(f"--availability={model} needs --{name}=PATH")


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


class Markov(Availability):
    """A two-state chain per client with stationary on-probability p_i (module docstring);
    stateful: the on/off vector of the last round asked, per seed."""

    name = "markov"

    def __init__(self, p: np.ndarray, off_on: float):
        p = np.asarray(p, np.float64)
        super().__init__(p.size)
        self.p = p
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = np.where(p > 0, off_on * (1.0 - p) / np.where(p > 0, p, 1.0), np.inf)
        never = np.isinf(raw)
        scale = np.where(never, 1.0, np.maximum(raw, 1.0))   # inf / inf left out
        self.off_on = np.where(never, 0.0, off_on / scale)   # b_i
        self.on_off = np.where(never, 1.0, raw / scale)      # a_i
        self._last: Dict[int, tuple] = {}                    # seed -> (round, on [N])

    def _start(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng([int(seed), 0, SEED_STREAM, _MARKOV])
        return rng.random(self.num_clients) < self.p

    def _step(self, seed: int, round_idx: int, on: np.ndarray) -> np.ndarray:
        rng = np.random.default_rng([int(seed), int(round_idx), STREAM, _MARKOV])
        u = rng.random(self.num_clients)
        # on -> on when u >= a_i, off -> on when u < b_i: np.where(on, u >= a, u < b) written
        # with bitwise operators (the same booleans; a few times faster on [N] bool arrays)
        return (on & (u >= self.on_off)) | (~on & (u < self.off_on))

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        last = self._last.get(int(seed))
        if last is None or last[0] > round_idx:
            last = (0, self._start(seed))
        r, on = last
        while r < round_idx:
            r += 1
            on = self._step(seed, r, on)
        self._last[int(seed)] = (r, on)
        return np.flatnonzero(on).astype(np.int64)

    def rates(self) -> np.ndarray:
        return self.p.copy()

    def state(self, seed: int) -> Dict[str, np.ndarray]:
        last = self._last.get(int(seed))
        if last is None:
            return {}
        return {"round": np.asarray(last[0], np.int64), "on": last[1].copy()}

    def restore(self, seed: int, state: Dict[str, np.ndarray], next_round: int) -> None:
        if next_round <= 0 or not state:
            self._last.pop(int(seed), None)
            return
        on = np.asarray(state["on"])
        if on.dtype != np.bool_ or on.shape != (self.num_clients,):
            raise CheckpointMismatch(f"markov availability state: 'on' must be bool "
                                     f"[{self.num_clients}], got {on.dtype} {list(on.shape)}")
        if int(state["round"]) != next_round - 1:
            raise CheckpointMismatch(f"markov availability state ends at round "
                                     f"{int(state['round'])}, the run resumes at {next_round}")
        self._last[int(seed)] = (next_round - 1, on.copy())


class Cyclic(Availability):
    """FedAU's cyclic participation: A_i rounds on in every A_i + I_i, at a phase drawn per
    seed (module docstring)."""

    name = "cyclic"

    def __init__(self, p: np.ndarray, period: int):
        p = np.asarray(p, np.float64)
        super().__init__(p.size)
        self.on_rounds = np.maximum(1, np.round(period * p)).astype(np.int64)    # A_i
        self.off_rounds = np.maximum(1, period - self.on_rounds)                 # I_i
        self.cycle = self.on_rounds + self.off_rounds
        self._phases: Dict[int, np.ndarray] = {}

    def phase(self, seed: int) -> np.ndarray:
        """[N] r0_i, uniform in [0, I_i): client i's first on-round is r0_i."""
        if int(seed) not in self._phases:
            rng = np.random.default_rng([int(seed), 0, SEED_STREAM, _CYCLIC])
            self._phases[int(seed)] = rng.integers(0, self.off_rounds)
        return self._phases[int(seed)]

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        r = (int(round_idx) - self.phase(seed)) % self.cycle
        return np.flatnonzero(r < self.on_rounds).astype(np.int64)

    def rates(self) -> np.ndarray:
        return self.on_rounds / self.cycle


class CyclicLabels(Availability):
    """FLGo's YC: in round t, r = (1 + t mod T) / T; client i is online when
    lo_i / M <= r <= hi_i / M (lo_i, hi_i its smallest and largest label, M the largest label
    of all clients), else with probability 1 - beta. Compared in integers:
    lo_i T <= (1 + t mod T) M <= hi_i T."""

    name = "cyclic"

    def __init__(self, label_counts: Optional[np.ndarray], period: int, beta: float):
        if label_counts is None:
            raise ConfigError("--availability_cyclic=labels needs the clients' label counts; "
                              "this dataset has none (not a classification task)")
        present = np.asarray(label_counts) > 0
        super().__init__(present.shape[0])
        labels = np.flatnonzero(present.any(axis=0))
        if labels.size == 0 or labels[-1] == 0:
            raise DataError("--availability_cyclic=labels needs clients holding labels above 0")
        any_label = present.any(axis=1)
        width = present.shape[1]
        self.low = np.where(any_label, np.argmax(present, axis=1), width + 1).astype(np.int64)
        self.high = np.where(any_label, width - 1 - np.argmax(present[:, ::-1], axis=1), -1)
        self.max_label, self.period, self.beta = int(labels[-1]), int(period), float(beta)

    def window(self, round_idx: int) -> np.ndarray:
        """[N] bool: the clients whose window holds round `round_idx`."""
        x = (1 + int(round_idx) % self.period) * self.max_label
        return (self.low * self.period <= x) & (x <= self.high * self.period)

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        rng = np.random.default_rng([int(seed), int(round_idx), STREAM, _CYCLIC])
        on = self.window(round_idx) | (rng.random(self.num_clients) < 1.0 - self.beta)
        return np.flatnonzero(on).astype(np.int64)

    def rates(self) -> np.ndarray:
        inside = sum(self.window(t).astype(np.float64) for t in range(self.period))
        return (inside + (self.period - inside) * (1.0 - self.beta)) / self.period


class Schedule(Availability):
    """An exact replay of ``available`` [rounds, N] (the same for every seed)."""

    name = "schedule"

    def __init__(self, available: np.ndarray, num_rounds: int):
        super().__init__(available.shape[1])
        self.available = available
        self.num_rounds = int(num_rounds)

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        del seed
        if not 0 <= round_idx < self.available.shape[0]:
            raise ConfigError(f"--availability_schedule covers {self.available.shape[0]} "
                              f"rounds, not round {round_idx}")
        return np.flatnonzero(self.available[round_idx]).astype(np.int64)

    def rates(self) -> np.ndarray:
        return self.available[:self.num_rounds].mean(axis=0, dtype=np.float64)


class Trace(Availability):
    """Device traces replayed at t_r = start + r x round_seconds; client i replays trace
    assign[i] (the same for every seed)."""

    name = "trace"

    def __init__(self, traces: TraceSet, assign: np.ndarray, start: float,
                 round_seconds: float, num_rounds: int):
        super().__init__(assign.size)
        self.traces, self.assign = traces, assign
        self.start, self.round_seconds = float(start), float(round_seconds)
        self.num_rounds = int(num_rounds)
        self._rates: Optional[np.ndarray] = None

    def time(self, round_idx: int) -> float:
        """The trace time (seconds) at which round `round_idx` is read."""
        return self.start + int(round_idx) * self.round_seconds

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        del seed
        active = self.traces.active(self.time(round_idx))
        return np.flatnonzero(active[self.assign]).astype(np.int64)

    def any_online(self) -> bool:
        """Whether some client is online in some round of the run (stops at the first)."""
        if self._rates is not None:
            return bool(np.any(self._rates > 0))
        return any(self.traces.active(self.time(r)).any() for r in range(self.num_rounds))

    def trace_rates(self) -> np.ndarray:
        """[K] each kept trace's fraction of the run's rounds in which it is active."""
        if self._rates is None:
            total = np.zeros(len(self.traces))
            for r in range(self.num_rounds):
                total += self.traces.active(self.time(r))
            self._rates = total / max(self.num_rounds, 1)
        return self._rates

    def rates(self) -> np.ndarray:
        return self.trace_rates()[self.assign]


def trace_assignment(settings: AvailabilitySettings, num_clients: int,
                     num_traces: int) -> np.ndarray:
    """[N] the trace (index in the file) each client replays: i mod K (FedScale's), or
    perm[i mod K] for a permutation drawn from --availability_seed."""
    index = np.arange(num_clients, dtype=np.int64) % num_traces
    if settings.assign == "modulo":
        return index
    rng = np.random.default_rng([int(settings.seed), 0, MODEL_STREAM, _ASSIGN])
    return rng.permutation(num_traces)[index]


def build_trace(settings: AvailabilitySettings, num_clients: int, num_rounds: int) -> Trace:
    """The ``trace`` model: only the traces some client replays are kept."""
    raw = load_traces(settings.trace, settings.trace_format)
    assign = trace_assignment(settings, num_clients, len(raw.keys))
    keep, local = np.unique(assign, return_inverse=True)
    model = Trace(TraceSet(raw, keep), local.reshape(-1).astype(np.int64),
                  settings.trace_start, settings.round_seconds, num_rounds)
    if not model.any_online():
        raise DataError(f"--availability_trace={settings.trace}: no client is online in any "
                        f"of the {num_rounds} rounds (times {settings.trace_start:g} s on, "
                        f"every {settings.round_seconds:g} s)")
    return model


def _never_online(p: np.ndarray, settings: AvailabilitySettings) -> None:
    if not np.any(p > 0.0):
        raise ConfigError(f"--availability={settings.model} with --availability_probs="
                          f"{settings.probabilities}: every client has availability 0, no "
                          f"client is ever online")


def build_replay(settings: AvailabilitySettings, num_clients: int,
                 num_rounds: int) -> Availability:
    """The ``schedule`` or ``trace`` model."""
    if settings.model == "trace":
        return build_trace(settings, num_clients, num_rounds)
    available = load_schedule(settings.schedule, num_clients, num_rounds)
    if not available[:num_rounds].any():
        raise DataError(f"--availability_schedule={settings.schedule}: no client is online in "
                        f"any of the run's {num_rounds} rounds")
    return Schedule(available, num_rounds)


def build_availability(settings: AvailabilitySettings, *, num_clients: int,
                       sizes: np.ndarray, label_counts: Optional[np.ndarray],
                       num_rounds: int) -> Availability:
    """The availability model of a run: sizes [N] the training clients' example counts,
    label_counts [N, C] their label counts (None: no labels), num_rounds the run's rounds.
    Raises ConfigError or DataError (one line) for a model under which it cannot run (a bad
    file, a probability outside [0, 1], no client online in any round)."""
    if settings.model == "always":
        return Availability(num_clients)
    if settings.model in ("schedule", "trace"):
        return build_replay(settings, num_clients, num_rounds)
    if settings.model == "cyclic" and settings.cyclic == "labels":
        model = CyclicLabels(label_counts, settings.period or 24, settings.cyclic_beta)
        if model.num_clients != num_clients:
            raise DataError(f"availability: label counts of {model.num_clients} clients for "
                            f"{num_clients} clients")
        return model      # the clients holding label M are in the window at t = T - 1
    p = client_probabilities(settings, num_clients, sizes, label_counts)
    if settings.model == "cyclic":     # on at least one round in every period, whatever p_i
        return Cyclic(p, settings.period or 100)
    _never_online(p, settings)
    if settings.model == "bernoulli":
        return Bernoulli(p)
    return Markov(p, settings.markov_off_on)
