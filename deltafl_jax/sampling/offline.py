"""Clients that go offline in the middle of a job: how long an online client stays online.

A selected client is online when its job starts (the server selects among the online
clients). Its job is lost when the client goes offline before its work reaches the server:
a job that would arrive a seconds after it starts survives iff the client stays online for
at least a seconds, ``online_for >= a``. The two sources of ``online_for`` (seconds from the
job's start):

- ``--mean_online_seconds=T`` (any availability model): the remaining online session of a
  client is exponential with mean T, memoryless, so a job of a seconds survives with
  probability exp(-a / T) and slow devices are lost more often. The session of client c in
  synchronous round r of seed s is E = -T ln U, U in (0, 1] a counter-based hash of c keyed
  by ``SeedSequence([s, r, STREAM, SYNC])`` (:func:`deltafl_jax.sampling.speeds.
  hashed_uniform`); an asynchronous job draws it from ``[s, serial, STREAM, ASYNC]``, the
  job's serial number in the round's place. These four-word keys have a third word that no
  other stream of the project uses (the availability streams are 0xA7A1..0xA7A3, the speeds'
  0x5BD1, the asynchronous scheduler's three-word 0xA5C1, the plans' three-word 0..4), so
  they share no stream with any other draw. U depends on (seed, round, client) only: the same
  client in the same round gets the same session whoever else is selected.
- ``--availability=trace`` on the virtual clock: the trace says exactly how long the device
  stays online. Round r is read at trace time t_r (the trace's usual times,
  :class:`deltafl_jax.sampling.availability.Trace`) and the job occupies [t_r, t_r + a]:
  ``online_for`` is the end of the online stretch that holds t_r minus t_r, where a stretch
  is a maximal union of the trace's overlapping or touching closed intervals (so the whole
  interval is checked, not only its end). Stretches are taken within one period of a
  repeating trace: a job that runs past the period's end is lost unless the stretch reaches
  it (a conservative reading where an interval ends at the period's end and the next period
  begins online).

With both, the job needs both: ``online_for`` is the smaller.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.speeds import hashed_uniform

STREAM = 0x0FF1   # [seed, round or serial, STREAM, SYNC or ASYNC]: online sessions
SYNC, ASYNC = 1, 2


# A run refuses a mean session under which even the fastest job survives with probability
# below this (exp(-d / T) < 1e-9, d > 20.7 T): no job would ever be aggregated (an
# asynchronous run would start jobs without end).
SURVIVAL_FLOOR = 1e-9


def check_sessions(mean_s: Optional[float], fastest_s: float) -> None:
    """ConfigError (one line) when even the fastest job, of `fastest_s` seconds, survives a
    session of mean `mean_s` with probability exp(-fastest_s / mean_s) < SURVIVAL_FLOOR."""
    if mean_s is None:
        return
    if fastest_s / float(mean_s) > -np.log(SURVIVAL_FLOOR):
        raise ConfigError(f"--mean_online_seconds={mean_s:g}: even the fastest job "
                          f"({fastest_s:.4g} s) survives it with probability "
                          f"{np.exp(-fastest_s / float(mean_s)):.3g} (< {SURVIVAL_FLOOR:g}); "
                          f"no job would be aggregated")


def session_key(seed: int, index: int, word: int) -> np.uint64:
    """The hash key of the sessions of round (or job serial) `index` of seed `seed`."""
    return np.random.SeedSequence([int(seed), int(index), STREAM, int(word)]).generate_state(
        1, np.uint64)[0]


def exponential_sessions(mean_s: float, seed: int, index: int, ids, word: int = SYNC
                         ) -> np.ndarray:
    """[k] float64 > 0: each client's remaining online seconds, exponential with mean
    `mean_s`, a pure function of (seed, index, word, client id)."""
    ids = np.asarray(ids, np.int64)
    u = hashed_uniform(session_key(seed, index, word), ids)
    return -float(mean_s) * np.log(u)


class TraceStretches:
    """For a :class:`deltafl_jax.sampling.traces.TraceSet`: how long each trace stays online
    from a time t (module docstring). The set's sorted shifted starts and running maxima of
    the ends are cut into stretches where a start exceeds every end before it."""

    def __init__(self, traces):
        self.traces = traces
        starts, ends = np.asarray(traces.starts), np.asarray(traces.ends)
        if starts.size == 0:
            self.stretch_end = ends
            return
        cut = np.concatenate([starts[1:] > ends[:-1], [True]])       # a stretch's last
        last = np.flatnonzero(cut)
        which = np.concatenate([[0], np.cumsum(cut[:-1])])
        self.stretch_end = ends[last][which]

    def online_for(self, t: float) -> np.ndarray:
        """[K] float64: seconds each trace stays online from time t (its stretch's end minus
        its local time; -inf where it is offline at t)."""
        ts = self.traces
        k = len(ts)
        q = ts.local_time(float(t)) + np.arange(k) * ts.span - ts.low
        idx = np.searchsorted(ts.starts, q, side="right") - 1
        out = np.full(k, -np.inf)
        ok = idx >= 0
        ok[ok] = ts.ends[idx[ok]] >= q[ok]
        ok &= ts.valid
        out[ok] = self.stretch_end[idx[ok]] - q[ok]
        return out


def job_survives(online_for: Optional[np.ndarray], arrival: np.ndarray) -> np.ndarray:
    """[k] bool: the client is still online when its work arrives (online_for None: always)."""
    arrival = np.asarray(arrival, np.float64)
    if online_for is None:
        return np.ones(arrival.shape, bool)
    return np.asarray(online_for, np.float64) >= arrival
