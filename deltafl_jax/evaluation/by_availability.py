"""The test error split by availability quintile: is the tail the clients that are rarely online?

A client's **availability** is any per-client measure of how often it can take part: its
probability of being online in a round under the availability model, or its empirical rate over
a replayed schedule or trace. The clients of a population (the training clients, or the test
devices) are ranked by it and cut into five quintiles of (nearly) equal counts, q1 the least
available, q5 the most.

**Ranks and ties.** The clients are ordered by rate, clients of equal rate by their index in
the population (the lower index first), and the client of rank r (0-based) of N is in quintile
floor(5 r / N) (0-based; named q1..q5): quintile j holds the ranks [ceil(j N / 5),
ceil((j + 1) N / 5)), floor(N / 5) or ceil(N / 5) clients. The split is deterministic and its
groups are as equal as N allows, whatever the ties: when every client has the same rate (an
availability that is the same for all) the quintiles are a split by client index, and their
equal mean rates (``_rate_mean``) say so. With N < 5 some quintiles are empty (N = 3: q1, q2
and q4 hold one client each); q1 always holds the least available client. An empty quintile's
statistics are NaN and its client count 0.

**Statistics** of the clients evaluated in each quintile, with the package's own definitions
(:mod:`deltafl_jax.evaluation.metrics`, reused here): the (weighted) mean error; the 90th percentile
(:func:`deltafl_jax.evaluation.metrics.percentiles`: the lower weighted quantile by default, NumPy's
linear one with ``method="linear"``); the worst-10% mean, the superquantile (CVaR) at 0.9
(:func:`deltafl_jax.evaluation.metrics.superquantile_rows`; with equal weights it is
``test_error_worst10`` and :func:`deltafl_jax.evaluation.metrics.worst_mean` of the quintile's clients).
A quintile with a NaN error (a diverged client) has NaN statistics for that replica. Test
errors are unweighted, as everywhere in the package (weights None).

**Populations.** The quintile edges are those of the whole population's rates, also when the
evaluation holds a sample of it (``--eval_clients``: each sampled client is placed by its rank
in the population); the statistics are then the sample's (no intervals). The participation
counts (rounds a training client was online, rounds it was sampled, ...) are summed over every
client of the quintile in the population, the evaluated ones or not.

:func:`quintile_split` and :func:`population_split` are the pure functions;
:class:`AvailabilitySplit` applies them to an evaluation's per-client arrays (the seen training
clients of ``--client_holdout`` by the training clients' rates, the test devices by their own
rates) and names its results ``{family}_avail_q{j}_{statistic}``.

**Training clients' counts** (:func:`count_split`, an asynchronous run's jobs started, updates
aggregated and updates dropped as stale): summed over the training clients of each quintile of
the training clients' rates, whatever the evaluation's families, as
``train_avail_q{j}_{name}`` (the count's name without its ``train_`` prefix), with the
quintile's mean rate ``train_avail_q{j}_rate_mean`` and its clients
``train_avail_q{j}_clients``. On a sampled evaluation (``--eval_clients``) the per-client
arrays hold the sampled training clients only, and the sums are theirs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from deltafl_jax.evaluation.metrics import WORST_LEVEL, percentiles, superquantile_rows

QUINTILES = 5
STATISTICS = ("mean", "p90", "worst10")      # of the error, per quintile
# The per-client error arrays of an evaluation that are split, and their population:
# "test" (the test devices), "seen[_ftK]" (training clients), "unseen[_ftK]" (test devices).
_FAMILY = re.compile(r"^(test|seen|unseen)(_ft\d+)?_error$")


def availability_quintiles(rates, groups: int = QUINTILES) -> np.ndarray:
    """[N] int64 quintile (0 .. groups - 1) of each client of `rates` [N]: the client of rank
    r (by rate, ties by index, module docstring) is in quintile floor(groups r / N)."""
    rates = _rates(rates, "rates")
    n = rates.size
    order = np.argsort(rates, kind="stable")        # equal rates keep the index order
    out = np.empty(n, np.int64)
    out[order] = (np.arange(n, dtype=np.int64) * groups) // max(n, 1)
    return out


def _rates(rates, what: str) -> np.ndarray:
    """`rates` as [N] float64; ValueError unless one-dimensional and finite."""
    r = np.asarray(rates, np.float64)
    if r.ndim != 1 or not np.all(np.isfinite(r)):
        raise ValueError(f"{what} must be one finite availability per client, got shape "
                         f"{r.shape}")
    return r


def group_errors(errors, groups, weights=None, method: str = "lower",
                 num_groups: int = QUINTILES) -> Dict[str, np.ndarray]:
    """The error statistics of each group of clients: ``q{j}_error_{mean,p90,worst10}`` [R]
    and ``q{j}_clients`` [R] (j = 1 .. num_groups), from `errors` [R, K] (or [K]), `groups`
    [K] in [0, num_groups) and `weights` [K] (None: equal)."""
    err = np.atleast_2d(np.asarray(errors, np.float64))
    groups = np.asarray(groups, np.int64)
    rows, k = err.shape
    if groups.shape != (k,):
        raise ValueError(f"groups must name the group of each of the {k} clients")
    w = np.ones(k) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (k,) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be {k} finite values >= 0")
    out: Dict[str, np.ndarray] = {}
    for j in range(num_groups):
        member = groups == j
        stats = _statistics(err, w, member, weights is not None, method)
        for name, value in zip(STATISTICS, stats):
            out[f"q{j + 1}_error_{name}"] = value
        out[f"q{j + 1}_clients"] = np.full(rows, float(member.sum()))
    return out


def _statistics(err: np.ndarray, w: np.ndarray, member: np.ndarray, weighted: bool,
                method: str):
    """(mean, p90, worst10) [R] each of the columns `member` of `err`; NaN when none has
    positive weight, or in a row where one of them is NaN."""
    rows = err.shape[0]
    if not np.any(w[member] > 0):
        return tuple(np.full(rows, np.nan) for _ in STATISTICS)
    sub, ws = err[:, member], w[member]
    mean = sub @ ws / ws.sum() if weighted else sub.mean(axis=1)
    if method == "linear":
        p90 = percentiles(sub, None if not weighted else ws, [90], method)[:, 0]
    else:
        p90 = percentiles(*_padded(sub, ws), [90], method)[:, 0]
    worst = superquantile_rows(sub, WORST_LEVEL, ws)
    bad = np.isnan(sub).any(axis=1)
    return tuple(np.where(bad, np.nan, v) for v in (mean, p90, worst))


def _padded(values: np.ndarray, weights: np.ndarray):
    """(values [R, P], weights [P]): the group's clients padded with clients of weight 0 (and
    value 0; NaN read as 0, its rows are NaN anyway) to the next power of two P, so that the
    lower quantile, which never stops at a weight of 0, is the group's own and is compiled
    for a few sizes only."""
    k = values.shape[1]
    size = 1 << max(0, (k - 1).bit_length())
    out = np.zeros((values.shape[0], size))
    out[:, :k] = np.where(np.isnan(values), 0.0, values)
    return out, np.concatenate([weights, np.zeros(size - k)])


def group_sums(counts, groups, num_groups: int = QUINTILES) -> np.ndarray:
    """[R, num_groups]: the sum of `counts` [R, N] (or [N]: R = 1) over each group's clients
    (`groups` [N])."""
    c = np.atleast_2d(np.asarray(counts, np.float64))
    groups = np.asarray(groups, np.int64)
    if c.shape[1:] != groups.shape:
        raise ValueError(f"the participation counts must be one per client ({groups.size}), "
                         f"got shape {np.shape(counts)}")
    return np.stack([np.bincount(groups, weights=row, minlength=num_groups)[:num_groups]
                     for row in c])


def population_split(errors, rates, clients=None, weights=None,
                     participation: Optional[Mapping[str, np.ndarray]] = None,
                     method: str = "lower") -> Dict[str, np.ndarray]:
    """The split of an evaluation of a population (module docstring): `errors` [R, K] of the
    evaluated clients `clients` [K] (indices into the population; None: all N, K = N),
    `rates` [N] the population's availability, `weights` [K] (None: equal), `participation`
    {name: [R, N] or [N]} counts of the population's clients. Returns name -> [R]: per
    quintile j = 1..5, ``q{j}_error_{mean,p90,worst10}``, ``q{j}_clients`` (evaluated
    clients in it), ``q{j}_rate_mean`` (the mean rate of its clients in the population) and
    ``q{j}_{name}`` (the sum of each count over its clients in the population)."""
    rates = _rates(rates, "rates")
    err = np.atleast_2d(np.asarray(errors, np.float64))
    pop = availability_quintiles(rates)
    idx = np.arange(rates.size) if clients is None else np.asarray(clients, np.int64)
    if idx.shape != (err.shape[1],) or (idx.size and not 0 <= idx.min() <= idx.max()
                                        < rates.size):
        raise ValueError(f"the {err.shape[1]} evaluated clients must be indices into the "
                         f"{rates.size} clients' rates")
    out = group_errors(err, pop[idx], weights, method)
    rows = err.shape[0]
    for j in range(QUINTILES):
        inside = rates[pop == j]
        out[f"q{j + 1}_rate_mean"] = np.full(rows, inside.mean() if inside.size else np.nan)
    for name, counts in (participation or {}).items():
        sums = group_sums(counts, pop)
        for j in range(QUINTILES):
            out[f"q{j + 1}_{name}"] = np.broadcast_to(sums[:, j], (rows,)).copy()
    return out


def count_split(counts: Mapping[str, np.ndarray], rates, clients=None
                ) -> Dict[str, np.ndarray]:
    """The training clients' counts by availability quintile (module docstring): `counts`
    {name: [R, K] or [K]} of the clients `clients` [K] (indices into the population of
    `rates` [N]; None: all N). Returns, per quintile j = 1..5, ``q{j}_{name}`` [R] (the sum
    over its clients among the K), ``q{j}_rate_mean`` and ``q{j}_clients`` (its clients among
    the K)."""
    rates = _rates(rates, "rates")
    pop = availability_quintiles(rates)
    idx = np.arange(rates.size) if clients is None else np.asarray(clients, np.int64)
    groups = pop[idx]
    out: Dict[str, np.ndarray] = {}
    rows = None
    for name, c in counts.items():
        sums = group_sums(c, groups)
        rows = sums.shape[0]
        for j in range(QUINTILES):
            out[f"q{j + 1}_{name}"] = sums[:, j]
    rows = 1 if rows is None else rows
    for j in range(QUINTILES):
        inside = rates[pop == j]
        out[f"q{j + 1}_rate_mean"] = np.full(rows, inside.mean() if inside.size else np.nan)
        out[f"q{j + 1}_clients"] = np.full(rows, float(np.sum(groups == j)))
    return out


def quintile_split(errors, rates, weights=None, participation=None,
                   method: str = "lower") -> Dict[str, np.ndarray]:
    """The split of K clients by the quintiles of their own `rates` [K]: `errors` [R, K] (or
    [K]), `weights` [K] (None: equal), `participation` [R, K] or [K] (None: none) counts.
    Returns :func:`population_split`'s keys, the counts' sums as ``q{j}_participation``."""
    counts = None if participation is None else {"participation": participation}
    return population_split(errors, rates, None, weights, counts, method)


@dataclasses.dataclass(frozen=True, eq=False)
class AvailabilitySplit:
    """The availability an evaluation is split by (module docstring).

    train_rates: [N_train] the training clients' availability; splits the seen clients'
      held-out errors (``--client_holdout``: ``seen``, ``seen_ft{k}``), or None.
    test_rates: [N_test] the test devices' availability; splits the test errors and the unseen
      devices' held-out errors (``test``, ``unseen``, ``unseen_ft{k}``), or None.
    participation: names of per-client count arrays of the evaluation (``per_client[name]``,
      [R, N_train] or [N_train]: rounds online, rounds sampled, ...) summed per quintile of
      the training clients, next to the seen clients' split.
    train_counts: names of per-client count arrays of the training clients (``train_...``)
      summed per quintile of `train_rates` in every evaluation, as ``train_avail_q{j}_...``
      (:func:`count_split`; an asynchronous run's jobs started, updates aggregated and
      updates dropped as stale).
    """

    train_rates: Optional[np.ndarray] = None
    test_rates: Optional[np.ndarray] = None
    participation: Tuple[str, ...] = ()
    train_counts: Tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("train_rates", "test_rates"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _rates(getattr(self, name), name))
        object.__setattr__(self, "participation", tuple(self.participation))
        object.__setattr__(self, "train_counts", tuple(self.train_counts))

    def summaries(self, per_client: Mapping[str, np.ndarray],
                  method: str = "lower") -> Dict[str, np.ndarray]:
        """``{family}_avail_q{j}_{statistic}`` [R] for every family of `per_client` whose
        population has rates (the family's sampled clients, ``{test,seen,unseen}_clients``,
        placed by their rank in the population), and with ``train_counts`` their sums by
        quintile of the training clients (``train_avail_q{j}_...``); {} when none has."""
        out: Dict[str, np.ndarray] = {}
        for key in per_client:
            found = _FAMILY.match(key)
            if found is None:
                continue
            population = found.group(1)
            rates = self.train_rates if population == "seen" else self.test_rates
            if rates is None:
                continue
            counts = self._counts(per_client) if population == "seen" else None
            split = population_split(per_client[key], rates,
                                     per_client.get(f"{population}_clients"), None, counts,
                                     method)
            family = key[:-len("_error")]
            out.update({f"{family}_avail_{k}": v for k, v in split.items()})
        if self.train_counts and self.train_rates is not None:
            counts = {name[len("train_"):] if name.startswith("train_") else name:
                      per_client[name] for name in self.train_counts}
            split = count_split(counts, self.train_rates, per_client.get("train_clients"))
            out.update({f"train_avail_{k}": v for k, v in split.items()})
        return out

    def _counts(self, per_client: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        missing = [name for name in self.participation if name not in per_client]
        if missing:
            raise ValueError(f"the evaluation has no participation counts {missing[0]!r}")
        return {name: per_client[name] for name in self.participation}
