"""Online estimates of how often each training client takes part, for the methods built for
unknown or skewed participation (FedAU, and Delta-FL's ``--deltafl_participation``).

**FedAU's estimate** (Wang & Ji, *A Lightweight Method for Tackling Unknown Participation
Statistics in Federated Averaging*, ICLR 2024, Algorithm 1 lines 8-13). Each client counts the
rounds since it last took part; when it takes part, the interval (that count + 1) is recorded,
and its aggregation weight omega_i is the mean of the intervals recorded *before* this round
(1 while none is). An absence longer than the cut-off K is cut into pieces: each time the count
reaches K, K is recorded and the count restarts at 0. The counter starts at 0 before round 0,
so a client first taking part in round t (counted from 0) records t + 1 (t mod K + 1 with the
cut-off, after t // K pieces of K). omega_i estimates 1 / p_i, the client's mean participation
interval, whatever its participation law (Theorem 1 of the paper; the cut-off bounds the bias
under K).

These facts were read from the authors' code, IBM/fedau at commit
6e9cce9b2e568666b5c3e0fab8f092a539884d7b (``main.py``, ``-weighting adaptive`` and
``-k-adaptive``), and the estimate below gives the same omega_i in every round.

**O(m) per round.** The authors update every client's counter every round. Here each client
keeps only the round of its last participation (-1 before the first), and the sum and count of
the intervals recorded up to it (:class:`Estimator`, arrays [N]); the pieces of K that an
absence of L = t - last - 1 rounds recorded are added when the client next takes part: L // K
pieces of K before the round's weight is taken, then (L mod K) + 1 after it. That is the
authors' sequence of recordings exactly, since the pieces of an absence are read only at the
client's next participation; the one difference is an absence still open when the run ends,
whose pieces the authors have recorded and this state has not (:func:`omega_all` adds them when
every client's estimate is wanted). K = 0 means no cut-off (the authors' default K = 100000 is
the same for any shorter run).

**The running participation rate** (``inverse``): p_hat_i = (c_i + 1) / (t + 1) in round t for a
client that takes part in it, with c_i its participations before round t: the fraction of the
rounds so far (this one included) in which it took part. 1 / p_hat_i is then the correction.

"Taking part" is what the caller passes as ``took_part`` (FedAU: the client trained this round;
Delta-FL: it was sampled, whether or not the filter kept it). Slots of a variable cohort that
hold no client (size 0) never take part.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.options import Option
from deltafl_jax.declared import Bounds

FEDAU_CAP = Option(
    default=0, help="K: FedAU's cut-off of the participation interval; an absence is recorded "
    "as pieces of K (0: no cut-off)", bounds=Bounds(0, integer=True))


class Estimator(NamedTuple):
    """The participation estimate of every training client (one replica).

    round: [] int32 rounds completed.
    last: [N] int32 the round of each client's last participation (-1: none yet).
    total: [N] int32 the sum of its recorded intervals (FedAU) up to that participation.
    count: [N] int32 how many intervals it recorded (FedAU), or how many rounds it took part
      in (the rate).
    """

    round: jax.Array
    last: jax.Array
    total: jax.Array
    count: jax.Array   # type: ignore[assignment]  # a field's name, not tuple.count


def init_estimator(num_clients: int) -> Estimator:
    """Before round 0: no participation, no recorded interval."""
    zeros = jnp.zeros((num_clients,), jnp.int32)
    return Estimator(round=jnp.int32(0), last=jnp.full((num_clients,), -1, jnp.int32),
                     total=zeros, count=zeros)


def _pieces(state: Estimator, clients, cap: int):
    """(pieces of K, remainder) of the open absence of each of `clients` at this round."""
    absent = state.round - state.last[clients] - 1             # L: rounds missed since
    if cap <= 0:
        return jnp.zeros_like(absent), absent
    return absent // cap, absent % cap


def _mean_or_one(total, count):
    count_f = count.astype(jnp.float32)
    return jnp.where(count > 0, total.astype(jnp.float32) / jnp.maximum(count_f, 1.0), 1.0)


def fedau_omega(state: Estimator, clients, cap: int):
    """[m] omega of `clients` in this round, as if each takes part in it: the mean of the
    intervals recorded before it (the pieces of K of its open absence included), 1 while none
    is."""
    pieces, _ = _pieces(state, clients, cap)
    return _mean_or_one(state.total[clients] + cap * pieces, state.count[clients] + pieces)


def omega_all(state: Estimator, cap: int):
    """[N] omega of every client at this round, the pieces of K of every open absence recorded
    (the authors' per-round state)."""
    return fedau_omega(state, jnp.arange(state.last.shape[0]), cap)


def _scatter(a, ids, values, took_part):
    """a with a[ids] = values where took_part (other slots dropped: padded ids may repeat)."""
    return a.at[jnp.where(took_part, ids, a.shape[0])].set(values, mode="drop")


def fedau_record(state: Estimator, clients, took_part, cap: int) -> Estimator:
    """The state after this round: each client that took part records the pieces of K of its
    absence and then its interval (remainder + 1); the round advances."""
    pieces, rest = _pieces(state, clients, cap)
    total = state.total[clients] + cap * pieces + rest + 1
    count = state.count[clients] + pieces + 1
    t = state.round
    return Estimator(round=t + 1,
                     last=_scatter(state.last, clients, jnp.full_like(clients, t), took_part),
                     total=_scatter(state.total, clients, total, took_part),
                     count=_scatter(state.count, clients, count, took_part))


def inverse_rate(state: Estimator, clients):
    """[m] 1 / p_hat of `clients` in this round, as if each takes part in it:
    (t + 1) / (c + 1)."""
    return ((state.round + 1).astype(jnp.float32)
            / (state.count[clients] + 1).astype(jnp.float32))


def rate_record(state: Estimator, clients, took_part) -> Estimator:
    """The state after this round: each client that took part counts one more round."""
    t = state.round
    return state._replace(
        round=t + 1,
        last=_scatter(state.last, clients, jnp.full_like(clients, t), took_part),
        count=_scatter(state.count, clients, state.count[clients] + 1, took_part))


@dataclasses.dataclass(frozen=True)
class Correction:
    """A participation correction: weights(state, clients) -> [m] and record(state, clients,
    took_part) -> state, over an :class:`Estimator`."""

    weights: Callable[[Estimator, jax.Array], jax.Array]
    record: Callable[[Estimator, jax.Array, jax.Array], Estimator]


def correction(kind: str, cap: int) -> Correction:
    """FedAU's omega (``fedau``, cut-off `cap`) or the inverse running rate (``inverse``)."""
    if kind == "fedau":
        return Correction(weights=lambda s, c: fedau_omega(s, c, cap),
                          record=lambda s, c, took: fedau_record(s, c, took, cap))
    if kind == "inverse":
        return Correction(weights=inverse_rate, record=rate_record)
    raise ValueError(f"no participation correction {kind!r}")
