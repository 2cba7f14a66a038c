"""Client samplers: who of the online training clients trains in a round.

A :class:`Sampler` gives, for a seed, a round and optionally the ids of the clients online in
that round (:mod:`deltafl_jax.sampling.availability`), a :class:`Cohort`: the sampled clients in
the plan's m slots, a ``present`` mask (False: an empty slot, size 0 in the plan, no examples
and no local step) and each slot's sampling probability. Every draw is a pure function of
(seed, round, online) made with NumPy from ``SeedSequence([seed, round, stream])``, so a run
resumes exactly and the conformity levels trained with one seed see the same clients (common
random numbers). With ``online=None`` (every client online) the draws are the simulator's
original ones, bit for bit.

The samplers (``--client_sampling``, and DRFA's own):

- :class:`FixedSampler` (``fixed``): m distinct clients drawn uniformly (Algorithm 2, line 2).
  Among the online clients: m of them uniformly; if at most m are online, all of them, the
  remaining slots empty.
- :class:`PoissonSampler` (``poisson``): every client joins independently with probability
  q = m / N (drawn as a Binomial(N, q) count and a uniform subset of that size: the law of N
  coin flips in O(cohort) work), in ``cap`` slots (:func:`poisson_cap`), the cohort first in
  increasing id order and the rest empty; a cohort above the cap keeps a uniform ``cap`` of its
  clients. Among the online clients: each online client joins with probability q.
- :class:`CyclicSampler` (``cyclic``, DP-FTRL's participation): the N training clients split
  once per seed into G = N // m fixed groups of m (a seeded permutation; the N - G m left over
  never take part); round t trains group t mod G. Among the online clients: the group's online
  members, the others' slots empty (the schedule does not move to other clients, so a client
  still takes part at most every G rounds).
- :class:`WeightedSampler` (DRFA's sampling by its mixing weights lambda): m draws with
  replacement with probabilities proportional to the given weights [N]. Among the online
  clients: the weights restricted to them and renormalised; no client online, every slot empty.

The ``Sampling`` settings group (``--client_sampling``) names them: :data:`SAMPLERS` maps each
``--client_sampling`` value to its class, and :meth:`Sampling.build` makes the run's sampler
(each class's ``build``).

Adding a sampler: a subclass with ``name``, ``slots`` and ``cohort`` (see
``docs/guides/add-sampler.md``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Dict, NamedTuple, Optional, Type

import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError

SAMPLE_STREAM = 0
POISSON_STREAM = 2
CYCLIC_STREAM = 3


class Cohort(NamedTuple):
    """One round's cohort of one seed, in the plan's m slots.

    clients [m] int32: the sampled clients' ids, the present ones first (sorted), 0 after them;
    present [m] bool: a slot holds a sampled client (False: empty, size 0 in the plan);
    probabilities [m] float64: the chance that the slot's client is in this round's cohort
    (fixed: m / N, or m / (online count) capped at 1; Poisson: q; cyclic: 1 for the group's
    members; by weights: the client's draw probability); 0 on empty slots.
    """

    clients: np.ndarray
    present: np.ndarray
    probabilities: np.ndarray


def _cohort(chosen: np.ndarray, m: int, probability) -> Cohort:
    """A cohort of `chosen` (sorted ids, at most m) in m slots, the rest empty."""
    k = chosen.size
    clients = np.zeros((m,), np.int32)
    clients[:k] = chosen
    present = np.zeros((m,), bool)
    present[:k] = True
    prob = np.zeros((m,), np.float64)
    prob[:k] = probability
    return Cohort(clients, present, prob)


def _online_ids(online, num_clients: int) -> Optional[np.ndarray]:
    """The online ids as int64 (None: everyone); ValueError for ids outside [0, N)."""
    if online is None:
        return None
    ids = np.asarray(online, np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= num_clients)):
        raise ValueError(f"online ids must be a 1-D array of ids in [0, {num_clients})")
    return ids


class Sampler:
    """A client sampler (the interface; fedjax's ``ClientSampler`` draws one round's clients
    the same way, from a seed and the round).

    name: the ``--client_sampling`` value (or the algorithm's own sampler's name). slots: m,
    the plan's slots per round. variable: the cohort may leave slots empty without any
    availability (Poisson); with availability any sampler may.
    """

    name: ClassVar[str] = ""
    variable: ClassVar[bool] = False
    slots: int

    def cohort(self, seed: int, round_idx: int, online=None) -> Cohort:
        """The cohort of round `round_idx` of seed `seed`'s run, drawn among `online` (sorted
        ids of the clients online in the round; None: every client)."""
        raise NotImplementedError

    @classmethod
    def build(cls, num_clients: int, m: int, *, rounds: int, overflow_budget: float):
        """The run's sampler of m of `num_clients` clients a round (`rounds`, and the chance
        `overflow_budget` that a capped sampler may overflow its slots in the run, for those
        that need them)."""
        del rounds, overflow_budget
        return cls(num_clients=num_clients, slots=m)


def sample_clients(seed: int, round_idx: int, num_clients: int, m: int) -> np.ndarray:
    """m distinct clients drawn uniformly (Algorithm 2, line 2); a pure function of
    (seed, round)."""
    if not 0 < m <= num_clients:
        raise ValueError(f"cannot sample {m} of {num_clients} clients")
    rng = np.random.default_rng([int(seed), int(round_idx), SAMPLE_STREAM])
    return np.sort(rng.choice(num_clients, size=m, replace=False)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class FixedSampler(Sampler):
    """``--client_sampling=fixed``: m distinct clients uniformly among the online (module
    docstring)."""

    num_clients: int
    slots: int
    name: ClassVar[str] = "fixed"

    def cohort(self, seed: int, round_idx: int, online=None) -> Cohort:
        ids = _online_ids(online, self.num_clients)
        m = self.slots
        if ids is None:
            return _cohort(sample_clients(seed, round_idx, self.num_clients, m), m,
                           m / self.num_clients)
        if ids.size <= m:
            return _cohort(np.sort(ids).astype(np.int32), m, 1.0)
        rng = np.random.default_rng([int(seed), int(round_idx), SAMPLE_STREAM])
        chosen = np.sort(ids[rng.choice(ids.size, size=m, replace=False)]).astype(np.int32)
        return _cohort(chosen, m, m / ids.size)


def poisson_cohort(seed: int, round_idx: int, num_clients: int, q: float,
                   cap: Optional[int] = None, online=None) -> np.ndarray:
    """The clients of a Poisson round: each of `num_clients` (or of the `online` ids) joins
    independently with probability q; a pure function of (seed, round, online). Drawn as a
    Binomial(count, q) count and a uniform subset of that size; a cohort above `cap` keeps
    `cap` of its clients, uniformly (the subset's first `cap`, in its random order). Sorted
    ids."""
    if not 0.0 < q <= 1.0:
        raise ValueError(f"Poisson sampling needs q in (0, 1], got {q}")
    rng = np.random.default_rng([int(seed), int(round_idx), POISSON_STREAM])
    count = num_clients if online is None else len(online)
    size = int(rng.binomial(count, q))
    chosen = rng.choice(count, size=size, replace=False)
    if online is not None:
        chosen = np.asarray(online, np.int64)[chosen]
    if cap is not None:
        chosen = chosen[:cap]
    return np.sort(chosen).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class PoissonSampler(Sampler):
    """``--client_sampling=poisson``: each client joins a round with probability q; the plan
    has `slots` = the cap (:func:`poisson_cap`)."""

    num_clients: int
    q: float
    slots: int
    name: ClassVar[str] = "poisson"
    variable: ClassVar[bool] = True

    @property
    def cap(self) -> int:
        return self.slots

    @classmethod
    def build(cls, num_clients: int, m: int, *, rounds: int, overflow_budget: float):
        """q = m / N in the smallest cap whose overflow in `rounds` rounds has chance at most
        `overflow_budget` (:func:`poisson_cap`)."""
        q = m / num_clients
        return cls(num_clients=num_clients, q=q,
                   slots=poisson_cap(num_clients, q, rounds, overflow_budget))

    def cohort(self, seed: int, round_idx: int, online=None) -> Cohort:
        ids = _online_ids(online, self.num_clients)
        chosen = poisson_cohort(seed, round_idx, self.num_clients, self.q, self.slots, ids)
        return _cohort(chosen, self.slots, self.q)


def cyclic_cohort(seed: int, round_idx: int, num_clients: int, m: int) -> np.ndarray:
    """Group round_idx mod G of the seed's split of the clients into G = N // m groups of m
    (module docstring); sorted ids."""
    groups = num_clients // m
    if groups < 1:
        raise ValueError(f"cannot form a group of {m} of {num_clients} clients")
    perm = np.random.default_rng([int(seed), CYCLIC_STREAM]).permutation(num_clients)
    g = int(round_idx) % groups
    return np.sort(perm[g * m:(g + 1) * m]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class CyclicSampler(Sampler):
    """``--client_sampling=cyclic``: round t trains group t mod G, its online members (module
    docstring)."""

    num_clients: int
    slots: int
    name: ClassVar[str] = "cyclic"

    def cohort(self, seed: int, round_idx: int, online=None) -> Cohort:
        ids = _online_ids(online, self.num_clients)
        chosen = cyclic_cohort(seed, round_idx, self.num_clients, self.slots)
        if ids is not None:
            chosen = chosen[np.isin(chosen, ids)]
        return _cohort(chosen, self.slots, 1.0)


def sample_by_weights(seed: int, round_idx: int, probabilities, m: int) -> np.ndarray:
    """m clients drawn independently with the given probabilities [N] (with replacement: a
    client may appear several times; DRFA's sampling by its mixing weights lambda), sorted;
    a pure function of (seed, round, probabilities)."""
    p = np.asarray(probabilities, np.float64)
    if p.ndim != 1 or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ValueError(f"cannot sample clients by the weights {p!r}")
    rng = np.random.default_rng([int(seed), int(round_idx), SAMPLE_STREAM])
    return np.sort(rng.choice(p.size, size=m, replace=True, p=p / p.sum())).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class WeightedSampler(Sampler):
    """m draws with replacement with probabilities proportional to `weights` [N] (DRFA's
    lambda), among the online clients (module docstring). Built each round from the
    algorithm's state (:meth:`with_weights`)."""

    num_clients: int
    slots: int
    weights: Optional[np.ndarray] = None
    name: ClassVar[str] = "weights"

    def with_weights(self, weights) -> "WeightedSampler":
        return dataclasses.replace(self, weights=np.asarray(weights, np.float64))

    def cohort(self, seed: int, round_idx: int, online=None) -> Cohort:
        if self.weights is None:
            raise ValueError("a WeightedSampler needs its weights (with_weights)")
        ids = _online_ids(online, self.num_clients)
        p = self.weights
        if ids is not None:
            p = np.zeros_like(p)
            p[ids] = self.weights[ids]
            if not p.sum() > 0:
                return _cohort(np.zeros((0,), np.int32), self.slots, 0.0)
        chosen = sample_by_weights(seed, round_idx, p, self.slots)
        return _cohort(chosen, self.slots, (p / p.sum())[chosen])


def _log_binomial_pmf(n: int, q: float, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(q) + (n - k) * math.log1p(-q))


def overflow_probability(num_clients: int, q: float, cap: int) -> float:
    """P(Binomial(N, q) > cap): the chance that one Poisson round overflows the cap."""
    if cap >= num_clients or q <= 0:
        return 0.0
    if q >= 1:
        return 1.0
    total, k = 0.0, cap + 1
    while k <= num_clients:
        term = math.exp(_log_binomial_pmf(num_clients, q, k))
        total += term
        if k > num_clients * q and term < 1e-300 + total * 1e-17:
            break
        k += 1
    return min(total, 1.0)


def poisson_cap(num_clients: int, q: float, rounds: int, budget: float) -> int:
    """The smallest cap >= ceil(q N) whose overflow probability over `rounds` rounds is at
    most `budget` (union bound: rounds x P(Binomial(N + 1, q) > cap); N + 1 covers the
    neighbouring population with one more client)."""
    n = num_clients + 1
    cap = max(1, math.ceil(q * num_clients))
    while cap < num_clients and rounds * overflow_probability(n, q, cap) > budget:
        cap += 1
    return min(cap, num_clients)


# --------------------------------------------------------------------------------------------
# The Sampling settings group

# --client_sampling's values, in the flag's order: each names one Sampler class.
SAMPLERS: Dict[str, Type[Sampler]] = {c.name: c for c in (FixedSampler, PoissonSampler,
                                                           CyclicSampler)}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the server picks a round's clients among the online ones.

    sampler: fixed | poisson | cyclic (--client_sampling; :data:`SAMPLERS`).
    """

    sampler: str = setting(
        "fixed", "fixed: m distinct clients drawn uniformly each round | poisson: each client "
        "joins a round independently with probability q = m / N (DP's add-or-remove "
        "accounting) | cyclic: G = N // m fixed groups of m, round t trains group t mod G "
        "(DP-FTRL's participation)", flag="client_sampling", choices=tuple(SAMPLERS))

    def check(self) -> None:
        """ConfigError naming the flag at fault."""
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"--client_sampling must be one of {', '.join(SAMPLERS)}, got "
                              f"{self.sampler!r}")

    @property
    def variable(self) -> bool:
        """The sampler's cohorts vary in size (empty slots) with every client online."""
        return SAMPLERS[self.sampler].variable

    def build(self, num_clients: int, m: int, *, rounds: int,
              overflow_budget: float) -> Sampler:
        """The run's sampler of m of `num_clients` clients a round (:meth:`Sampler.build`)."""
        return SAMPLERS[self.sampler].build(num_clients, m, rounds=rounds,
                                            overflow_budget=overflow_budget)
