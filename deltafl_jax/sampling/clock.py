"""Who of a round's sampled clients finishes, and when, on the virtual clock.

A synchronous round starts at virtual time 0 (relative to its start) for every sampled slot.
The timing model of a slot whose client c plans S local steps, with per-example compute
seconds x_c and bandwidth w_c (:class:`deltafl_jax.sampling.speeds.DeviceSpeeds`) and a model
of D bytes:

- it downloads the model in D / w_c seconds, then runs its steps one after another: step s
  (counted from 1) ends at D / w_c + x_c E(s), E(s) the examples its first s steps process;
- it uploads its update in D / w_c seconds after its last step, so the full job lasts
  T_c = 2 D / w_c + x_c E(S) (:func:`deltafl_jax.sampling.speeds.job_seconds`);
- E(s): under ``--local_steps`` every step reads B = batch_size examples (batches run across the
  client's back-to-back permutations), E(s) = s B; under ``--local_epochs`` each epoch of its n
  examples is cut into b = ceil(n / B) batches, the last holding what is left, so
  E(s) = (s div b) n + min(n, (s mod b) B) (the plan's batches, :mod:`deltafl_jax.sampling.plan`).

Who is kept (:func:`finish`):

- no deadline: every present slot arrives at T_c;
- ``--round_deadline=d``: a slot arrives only if T_c <= d; with ``--partial_work`` a slot with
  T_c > d instead stops after s* steps, the most with 2 D / w_c + x_c E(s*) <= d (it must
  still upload by the deadline), and arrives then with s* steps (FedProx's partial
  solutions); s* = 0 drops it;
- going offline (``online_for``, :mod:`deltafl_jax.sampling.offline`): a slot whose client
  stays online o_c seconds from the job's start, with o_c < its arrival a_c (full or
  partial), is lost: its upload never completes, partial work included. A slot already
  dropped by the deadline counts as late, not lost (it could not have arrived in time);
- over-selection (M slots sampled for m): the m first to arrive are kept among the slots
  neither late nor lost, ties broken by the smaller client id (FedScale's simulator keeps the
  m shortest jobs the same way).

The round lasts until the m-th kept arrival; when fewer than m arrive it lasts until the
deadline (the server waits for it), or, with no deadline, until the server has heard from
every present slot: the later of the last arrival and the last loss (a lost client is
noticed when it goes offline, at o_c), 0 with nobody present.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np

from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.samplers import Cohort
from deltafl_jax.sampling.speeds import DeviceSpeeds


class Finish(NamedTuple):
    """One round's outcome for M sampled slots.

    keep [M] bool: the slot's client is aggregated this round;
    steps [M] int32: the local steps it completes (planned, or fewer with partial work; 0 if
    not kept);
    seconds [M] float64: each present slot's full virtual duration T_c (inf on empty slots);
    round_seconds: the round's virtual duration;
    arrival [M] float64: when the slot's kept work reaches the server (T_c, or the partial
    job's end), inf where not kept;
    late [M] bool: dropped by the deadline; offline [M] bool: lost by going offline before
    its work (in time for the deadline) arrived.
    """

    keep: np.ndarray
    steps: np.ndarray
    seconds: np.ndarray
    round_seconds: float
    arrival: np.ndarray
    late: Optional[np.ndarray] = None
    offline: Optional[np.ndarray] = None


def examples_done(steps: np.ndarray, sizes: np.ndarray, batch_size: int, *,
                  full_batches: bool) -> np.ndarray:
    """[k] int64 E(s): the examples the first `steps` local steps of clients of `sizes`
    examples process (module docstring); full_batches: --local_steps (every step B)."""
    steps = np.asarray(steps, np.int64)
    if full_batches:
        return steps * int(batch_size)
    n = np.maximum(np.asarray(sizes, np.int64), 1)
    per_epoch = -(-n // int(batch_size))
    return (steps // per_epoch) * n + np.minimum(n, (steps % per_epoch) * int(batch_size))


def steps_within(budget: np.ndarray, sizes: np.ndarray, batch_size: int, *,
                 full_batches: bool) -> np.ndarray:
    """[k] int64: the most steps s with E(s) <= budget (budget >= 0 examples of compute)."""
    budget = np.maximum(np.asarray(budget, np.float64), 0.0)
    if full_batches:
        return np.floor(budget / int(batch_size)).astype(np.int64)
    n = np.maximum(np.asarray(sizes, np.int64), 1)
    per_epoch = -(-n // int(batch_size))
    epochs = np.floor(budget / n)
    rest = budget - epochs * n
    return (epochs.astype(np.int64) * per_epoch
            + np.floor(rest / int(batch_size)).astype(np.int64))


def partial_steps(compute_s: np.ndarray, transfer_s: np.ndarray, planned: np.ndarray,
                  sizes: np.ndarray, batch_size: int, deadline: float, *,
                  full_batches: bool) -> np.ndarray:
    """[k] the most steps s <= planned with 2 transfer_s + compute_s E(s) <= deadline, the
    inequality evaluated as written (the closed form's rounding corrected by one step)."""
    planned = np.asarray(planned, np.int64)

    def fits(s):
        done = examples_done(s, sizes, batch_size, full_batches=full_batches)
        return 2.0 * transfer_s + compute_s * done <= deadline

    budget = (deadline - 2.0 * transfer_s) / compute_s
    s = np.clip(steps_within(budget, sizes, batch_size, full_batches=full_batches), 0, planned)
    up = np.minimum(s + 1, planned)
    s = np.where((up > s) & fits(up), up, s)
    down = np.maximum(s - 1, 0)
    return np.where(fits(s) | (s == 0), s, down)


class SlotJobs(NamedTuple):
    """The jobs of M sampled slots, as the clock times them."""

    clients: np.ndarray         # [M] the slots' clients
    present: np.ndarray         # [M] bool: the slot holds a client
    planned_steps: np.ndarray   # [M] its planned local steps
    sizes: np.ndarray           # [M] its client's example count
    online_for: Optional[np.ndarray] = None   # [M] seconds its client stays online from the
    #                                           job's start; None: it never goes offline


def finish(speeds: DeviceSpeeds, slots: SlotJobs, batch_size: int, model_bytes: int, *,
           m: int, deadline: Optional[float], partial_work: bool,
           full_batches: bool = False) -> Finish:
    """Who of M sampled slots finishes: the m first to finish (ties by client id) among those
    done by the deadline and still online when their work arrives; with partial_work a client
    past the deadline keeps the local steps it completed by then (dropped if none);
    full_batches: the run uses --local_steps (module docstring)."""
    present = np.asarray(slots.present, bool)
    ids = np.asarray(slots.clients, np.int64)[present]
    planned = np.asarray(slots.planned_steps, np.int64)[present]
    n = np.asarray(slots.sizes, np.int64)[present]
    online_for = slots.online_for
    compute_s = speeds.per_example_s(ids)
    transfer_s = float(model_bytes) / speeds.bandwidth_Bps(ids)
    full = 2.0 * transfer_s + compute_s * examples_done(planned, n, batch_size,
                                                       full_batches=full_batches)
    done, arrive = planned.copy(), full.copy()
    if deadline is not None:
        if partial_work:
            done = partial_steps(compute_s, transfer_s, planned, n, batch_size, deadline,
                                 full_batches=full_batches)
            arrive = 2.0 * transfer_s + compute_s * examples_done(
                done, n, batch_size, full_batches=full_batches)
            arrive = np.where(done == planned, full, arrive)
            late = ((done == 0) & (planned > 0)) | (arrive > deadline)
        else:
            late = full > deadline
        arrive = np.where(late, np.inf, arrive)
    else:
        late = np.zeros(ids.shape, bool)
    lost, gone = np.zeros(ids.shape, bool), None
    if online_for is not None:
        stay = np.asarray(online_for, np.float64)[present]
        lost = np.isfinite(arrive) & (stay < arrive)
        arrive = np.where(lost, np.inf, arrive)
        gone = np.maximum(stay[lost], 0.0)
    fin = _first_m(present, ids, done, full, arrive, m, deadline, gone)
    return fin._replace(late=_on_slots(present, late), offline=_on_slots(present, lost))


def _on_slots(present: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.zeros(present.size, bool)
    out[np.flatnonzero(present)] = values
    return out


def _first_m(present, ids, done, full, arrive, m: int, deadline, gone=None) -> Finish:
    """Keep the m first arrivals (ties by client id) of the present slots; `gone`: the times
    at which lost slots went offline (the server waits for them without a deadline)."""
    slot = np.flatnonzero(present)
    order = np.lexsort((ids, arrive))
    order = order[np.isfinite(arrive[order])][:m]
    size = present.size
    keep = np.zeros(size, bool)
    keep[slot[order]] = True
    steps = np.zeros(size, np.int32)
    steps[slot[order]] = done[order]
    seconds = np.full(size, np.inf)
    seconds[slot] = full
    arrival = np.full(size, np.inf)
    arrival[slot[order]] = arrive[order]
    if order.size >= m and order.size:
        round_seconds = float(arrive[order[-1]])
    elif deadline is not None:
        round_seconds = float(deadline)
    else:
        round_seconds = float(arrive[order].max()) if order.size else 0.0
        if gone is not None and gone.size:
            round_seconds = max(round_seconds, float(gone.max()))
    return Finish(keep=keep, steps=steps, seconds=seconds, round_seconds=round_seconds,
                  arrival=arrival)


def keep_cohort(cohort: Cohort, fin: Finish, m: int,
                kept_probability: Optional[Callable[[np.ndarray], np.ndarray]] = None
                ) -> Tuple[Cohort, np.ndarray]:
    """The kept clients in m slots (present first, sorted by id as a Cohort is), and their
    steps [m] int32 (0 on empty slots). Each kept client carries its slot's probability from
    `cohort`, or kept_probability(ids) when given: the probability that each of those clients
    is kept this round (:func:`deltafl_jax.sampling.inclusion.kept_probability` under
    over-selection)."""
    kept = np.flatnonzero(fin.keep)
    kept = kept[np.argsort(np.asarray(cohort.clients)[kept], kind="stable")]
    if kept.size > m:
        raise ValueError(f"{kept.size} kept clients do not fit {m} slots")
    clients = np.zeros((m,), np.int32)
    present = np.zeros((m,), bool)
    probabilities = np.zeros((m,), np.float64)
    steps = np.zeros((m,), np.int32)
    k = kept.size
    clients[:k] = np.asarray(cohort.clients)[kept]
    present[:k] = True
    if kept_probability is None:
        probabilities[:k] = np.asarray(cohort.probabilities)[kept]
    elif k:
        probabilities[:k] = kept_probability(clients[:k].astype(np.int64))
    steps[:k] = fin.steps[kept]
    return Cohort(clients, present, probabilities), steps


def fastest_job(speeds: DeviceSpeeds, sizes: np.ndarray, planned_steps: np.ndarray,
                batch_size: int, model_bytes: int, *, partial_work: bool,
                full_batches: bool = False) -> float:
    """The shortest job any of the N clients can send (sizes, planned_steps [N] by client id):
    its full job, or with partial work its first step's; O(N), in blocks of 2^16 clients."""
    sizes = np.asarray(sizes, np.int64)
    steps = np.asarray(planned_steps, np.int64)
    best = np.inf
    for lo in range(0, sizes.size, 1 << 16):
        ids = np.arange(lo, min(lo + (1 << 16), sizes.size), dtype=np.int64)
        work = np.minimum(steps[ids], 1) if partial_work else steps[ids]
        done = examples_done(work, sizes[ids], batch_size, full_batches=full_batches)
        seconds = (2.0 * float(model_bytes) / speeds.bandwidth_Bps(ids)
                   + speeds.per_example_s(ids) * done)
        best = min(best, float(seconds.min()))
    return best


def check_deadline(deadline: Optional[float], speeds: DeviceSpeeds, sizes: np.ndarray,
                   planned_steps: np.ndarray, batch_size: int, model_bytes: int, *,
                   partial_work: bool, full_batches: bool = False) -> None:
    """ConfigError (one line) when no client can meet `deadline` in any round of the run."""
    if deadline is None:
        return
    best = fastest_job(speeds, sizes, planned_steps, batch_size, model_bytes,
                       partial_work=partial_work, full_batches=full_batches)
    if best > deadline:
        what = "one local step and its transfers" if partial_work else "its local work"
        raise ConfigError(f"--round_deadline={deadline:g}: no client can meet it in any round "
                          f"(the fastest needs {best:.4g} s for {what})")
