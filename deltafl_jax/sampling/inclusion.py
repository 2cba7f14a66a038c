"""The exact probability that a client is kept in a round of the virtual clock under
``--over_select`` (with or without ``--round_deadline`` and ``--partial_work``).

The round (:mod:`deltafl_jax.sampling.timeline`): among the n clients online, the server
draws M' = min(M, n) distinct ones uniformly (M = ceil(r m)), and keeps the m first to arrive
(ties by the smaller client id), never one that cannot arrive by the deadline. A client's
arrival time a_i is the same in every round, since its speeds and its planned local work are
(:func:`deltafl_jax.sampling.clock.finish`: its full job, or with ``--partial_work`` the end
of its partial job when the full one is late; a_i = inf where it cannot arrive by the
deadline, and it is then never kept). A drawn client is taken to finish the job it starts.

Sort the N clients once by (a_i, id): client j *precedes* i when it comes first in that
order and a_j is finite. With F_i the online clients that precede i, client i (online, a_i
finite) is kept iff it is drawn and fewer than m of the other M' - 1 drawn precede it. Given
that i is drawn, the others are a uniform draw of M' - 1 of the other n - 1 online clients,
so the count X of those drawn that precede i is hypergeometric:

    p_i = (M' / n) * P(X <= m - 1),   X ~ Hypergeom(n - 1 items, F_i marked, M' - 1 draws)

and p_i = 0 when a_i is infinite (or i is offline). With M' = m (no over-selection) the tail
is 1: p_i = m / n for every client that can arrive, the selection sampler's probability.

:func:`hypergeom_cdf` evaluates the tail in NumPy, vectorised: the pmf at the boundary term
from log-factorials (:func:`log_factorial`, Stirling's series past a table), then the
neighbouring terms by the ratio recurrence of the pmf, summed from the boundary away from the
mode so that the sum is never a difference of nearly equal numbers (the lower tail directly
below the mode; one minus the upper tail at or above it).

Per round (:func:`kept_probability`) only the kept clients' p_i are needed: F_i is read off
the order, one sort of the n online clients' ranks, O(n log n) (O(1) per client when every
client is online), then m tails. Over a run (:func:`mean_kept_probability`,
:func:`expected_kept_probability`): each training client's mean over rounds, the p_i a
known-probability method divides by; every online client's p_i at once takes one sort of
the n online and the tail for every F, O(n) (:func:`hypergeom_cdf_by_marked`).
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Optional

import numpy as np

from deltafl_jax.sampling.clock import SlotJobs, finish

_TABLE = 64
_LOG_FACTORIAL = np.array([math.lgamma(k + 1.0) for k in range(_TABLE)], np.float64)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_NEGLIGIBLE = 1e-20


def log_factorial(k) -> np.ndarray:
    """log(k!) of integers k >= 0 (any shape), float64: a table below 64, else Stirling's
    series of log Gamma(z), z = k + 1, to the z^-7 term (truncation under 1e-19)."""
    k = np.asarray(k, np.int64)
    small = k < _TABLE
    z = np.where(small, _TABLE, k).astype(np.float64) + 1.0
    inv, inv2 = 1.0 / z, 1.0 / (z * z)
    series = inv * (1.0 / 12 - inv2 * (1.0 / 360 - inv2 * (1.0 / 1260 - inv2 / 1680)))
    big = (z - 0.5) * np.log(z) - z + _HALF_LOG_2PI + series
    return np.where(small, _LOG_FACTORIAL[np.minimum(k, _TABLE - 1)], big)


def _log_pmf(x, N, K, k):
    """log P(X = x), X ~ Hypergeom(N, K, k): log C(K, x) C(N - K, k - x) / C(N, k), its nine
    log-factorials in one call."""
    t = log_factorial(np.stack([K, x, K - x, N - K, k - x, N - K - k + x, k, N - k, N]))
    return (t[0] - t[1] - t[2]) + (t[3] - t[4] - t[5]) + (t[6] + t[7] - t[8])


def _tail_sum(first, x, stop, step, ratio, *, relative: bool):
    """sum of the pmf from term `x` (value `first`) to `stop` (inclusive) in direction
    `step` (+1 or -1), each next term the last times ratio(idx, j) (j the last term's index,
    idx the elements still summing), until every element's terms are negligible: against
    its sum (`relative`) or against 1 (the sum is then subtracted from 1)."""
    total = first.copy()
    idx = np.flatnonzero((x != stop) & (first > (0.0 if relative else _NEGLIGIBLE)))
    term, j = first[idx], x[idx]
    while idx.size:
        term = term * ratio(idx, j)
        j = j + step
        total[idx] += term
        scale = total[idx] if relative else 1.0
        go = (j != stop[idx]) & (term > _NEGLIGIBLE * scale)
        idx, term, j = idx[go], term[go], j[go]
    return total


def hypergeom_cdf(x, total, marked, draws) -> np.ndarray:
    """P(X <= x) for X ~ Hypergeom(`total` items, `marked` of them marked, `draws` drawn
    without replacement): the number of marked items drawn. Integer arrays, broadcast;
    float64 (module docstring: summed away from the mode)."""
    x, N, K, k = np.broadcast_arrays(*(np.asarray(v, np.int64) for v in
                                       (x, total, marked, draws)))
    lo, hi = np.maximum(0, k - (N - K)), np.minimum(k, K)
    out = np.where(x >= hi, 1.0, 0.0)
    inside = (x >= lo) & (x < hi)
    if not np.any(inside):
        return out
    x, N, K, k, lo, hi = (v[inside] for v in (x, N, K, k, lo, hi))
    mode = ((k + 1) * (K + 1)) // (N + 2)
    below = x < mode
    edge = np.where(below, x, x + 1)   # the lower tail's last term, or the upper tail's first
    first = np.exp(_log_pmf(edge, N, K, k))
    rest = N - K - k

    def down(i, j):   # pmf(j - 1) / pmf(j)
        return j * (rest[i] + j) / ((K[i] - j + 1) * (k[i] - j + 1))

    def up(i, j):     # pmf(j + 1) / pmf(j)
        return (K[i] - j) * (k[i] - j) / ((j + 1) * (rest[i] + j + 1))

    lower = _tail_sum(np.where(below, first, 0.0), edge, lo, -1, down, relative=True)
    upper = _tail_sum(np.where(below, 0.0, first), edge, hi, 1, up, relative=False)
    out[inside] = np.where(below, lower, np.maximum(1.0 - upper, 0.0))
    return out


def hypergeom_cdf_by_marked(x: int, total: int, draws: int) -> np.ndarray:
    """[total + 1] P(X_F <= x) for F = 0..total marked, X_F ~ Hypergeom(total, F, draws), in
    O(total): marking one more item lowers the cdf by the chance that X_F = x and the new
    item is drawn, pmf_F(x) (draws - x) / (total - F), so P(X_F <= x) is the sum of those
    terms from F up (positive terms, no cancellation), each pmf from a table of
    log-factorials."""
    x, total, draws = int(x), int(total), int(draws)
    if x >= draws:
        return np.ones(total + 1, np.float64)
    out = np.zeros(total + 1, np.float64)
    if x < 0:
        return out
    out[:x] = 1.0
    j = np.arange(x, total - (draws - x) + 1, dtype=np.int64)   # where pmf_j(x) > 0
    lf = log_factorial(np.arange(total + 1, dtype=np.int64))
    norm = lf[draws] + lf[total - draws] - lf[total] - lf[x] - lf[draws - x]
    log_pmf = (lf[j] - lf[j - x]) + (lf[total - j] - lf[total - j - draws + x]) + norm
    step = np.exp(log_pmf) * (draws - x) / (total - j)
    out[j] = np.cumsum(step[::-1])[::-1]
    return out


def arrivals(speeds, sizes, planned_steps, batch_size: int, model_bytes: int, *,
             deadline: Optional[float], partial_work: bool,
             full_batches: bool = False) -> np.ndarray:
    """[N] float64: each client's arrival time in any round it is drawn (its kept work's
    end, :func:`~deltafl_jax.sampling.clock.finish` with every client present and none
    beyond m), inf where it cannot arrive by the deadline. sizes, planned_steps [N] by id."""
    sizes = np.asarray(sizes, np.int64)
    ids = np.arange(sizes.size, dtype=np.int64)
    fin = finish(speeds, SlotJobs(ids, np.ones(sizes.size, bool), planned_steps, sizes),
                 batch_size, model_bytes, m=sizes.size, deadline=deadline,
                 partial_work=partial_work, full_batches=full_batches)
    return np.asarray(fin.arrival, np.float64)


class KeepOrder(NamedTuple):
    """The run's order of arrival: rank [N] int64, each client's position in the (arrival,
    id) order; reachable [N] bool, its arrival is finite (it can ever be kept)."""

    rank: np.ndarray
    reachable: np.ndarray


def keep_order(arrival) -> KeepOrder:
    """The :class:`KeepOrder` of arrival times [N] (inf: never kept)."""
    arrival = np.asarray(arrival, np.float64)
    order = np.lexsort((np.arange(arrival.size), arrival))
    rank = np.empty(arrival.size, np.int64)
    rank[order] = np.arange(arrival.size)
    return KeepOrder(rank=rank, reachable=np.isfinite(arrival))


def _kept(order: KeepOrder, preceding, n: int, M: int, m: int, clients) -> np.ndarray:
    """p_i of `clients` (online, F_i = `preceding`) among n online (module docstring)."""
    drawn = min(int(M), int(n))
    if drawn <= 0:
        return np.zeros(np.shape(clients), np.float64)
    tail = hypergeom_cdf(int(m) - 1, n - 1, preceding, drawn - 1)
    return np.where(order.reachable[clients], drawn / n * tail, 0.0)


def kept_probability(order: KeepOrder, clients, M: int, m: int, online=None) -> np.ndarray:
    """[k] the probability that each of `clients` (online this round) is kept in a round
    that draws M of the `online` clients (sorted ids; None: all N) and keeps the m first to
    arrive (module docstring)."""
    clients = np.asarray(clients, np.int64)
    if online is None:
        n = order.rank.size   # the reachable come first in the order
        preceding = np.minimum(order.rank[clients], int(order.reachable.sum()))
    else:
        online = np.asarray(online, np.int64)
        n = online.size
        # F_i: the online ranked before i (every reachable client ranks before the others)
        preceding = np.searchsorted(np.sort(order.rank[online]), order.rank[clients])
    return _kept(order, preceding, n, M, m, clients)


def _every_online(order: KeepOrder, online, M: int, m: int) -> np.ndarray:
    """[n] p_i of every client of `online` (ids; None: all N, F_i its rank) in a round with
    those online: O(n log n), F_i each one's place among the online in the order (the
    reachable come first; :func:`hypergeom_cdf_by_marked`)."""
    if online is None:
        preceding, reachable = order.rank, order.reachable
    else:
        online = np.asarray(online, np.int64)
        preceding = np.empty(online.size, np.int64)
        preceding[np.argsort(order.rank[online])] = np.arange(online.size)
        reachable = order.reachable[online]
    n = preceding.size
    drawn = min(int(M), n)
    if drawn <= 0:
        return np.zeros(n, np.float64)
    tail = hypergeom_cdf_by_marked(int(m) - 1, n - 1, drawn - 1)
    return np.where(reachable, drawn / n * tail[preceding], 0.0)


def mean_kept_probability(order: KeepOrder, M: int, m: int,
                          online_sets: Optional[Iterable] = None) -> np.ndarray:
    """[N] each client's probability of being kept averaged over rounds with the given online
    sets (ids, one per round; None: every client online, the same every round)."""
    N = order.rank.size
    if online_sets is None:
        return _every_online(order, None, M, m)
    total, rounds = np.zeros(N, np.float64), 0
    for online in online_sets:
        online = np.asarray(online, np.int64)
        total[online] += _every_online(order, online, M, m)
        rounds += 1
    return total / max(rounds, 1)


def expected_kept_probability(order: KeepOrder, rates, M: int, m: int) -> np.ndarray:
    """[N] an approximation of each client's probability of being kept when client j is online
    with probability rates[j] each round: r_i times the kept probability of a round with
    sum_j r_j clients online, F_i the expected online clients that precede i (both rounded),
    the selection's share M / sum_j r_j capped at 1."""
    r = np.asarray(rates, np.float64)
    mean_online = float(r.sum())
    n = max(int(round(mean_online)), 1)
    by_rank = np.zeros(r.size, np.float64)
    by_rank[order.rank] = np.where(order.reachable, r, 0.0)
    before = np.cumsum(by_rank) - by_rank                # reachable rate mass ahead of each
    preceding = np.minimum(np.rint(before[order.rank]).astype(np.int64), n - 1)
    drawn = min(int(M), n)
    tail = hypergeom_cdf_by_marked(int(m) - 1, n - 1, drawn - 1)[preceding]
    share = min(1.0, M / max(mean_online, 1e-300))
    return np.where(order.reachable, r * share * tail, 0.0)
