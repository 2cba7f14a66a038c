"""The virtual clock of synchronous rounds: who of a round's selected clients is aggregated,
and when each plan group's round ends in virtual time.

With ``--client_speed`` every sampled client's job has a virtual duration
(:mod:`deltafl_jax.sampling.speeds`: compute per example x examples + the model's download and
upload over the client's bandwidth). Each round of each plan group (one per seed):

1. the server selects M clients among the online ones: the run's sampler, or with
   ``--over_select=r`` M = ceil(r m) distinct clients drawn uniformly (FedScale's
   over-commitment);
2. :func:`deltafl_jax.sampling.clock.finish` keeps the m first to finish by
   ``--round_deadline`` (ties by client id; with ``--partial_work`` a late client keeps the
   local steps it completed by the deadline), and gives the round's virtual duration;
3. :func:`deltafl_jax.sampling.clock.keep_cohort` puts the kept clients in the plan's m slots
   with their steps, which cap the plan's (:func:`deltafl_jax.sampling.plan.make_round_plan`); under
   over-selection each carries its exact probability of being kept this round
   (:mod:`deltafl_jax.sampling.inclusion`).

Clients may go offline in the middle of their job (:mod:`deltafl_jax.sampling.offline`):
with ``--mean_online_seconds`` (an exponential online session per client and round, keyed by
the group's seed, the round and the client) or ``--availability=trace`` (the trace's online
stretch from the round's trace time), each slot's seconds online from its job's start go to
:func:`~deltafl_jax.sampling.clock.finish`, which drops the jobs that arrive after their
client went offline.

The round starts when the previous one ended: its virtual end is the sum of the durations of
rounds 0..t. :class:`VirtualClock` keeps, per plan group, that sum after the rounds counted so
far and each training client's rounds selected and dropped (selected but not aggregated: past
the deadline, offline before its work arrived, or beyond the m first), with the first two
causes also counted apart; the run plans a round ahead, so a round is counted when
it is trained (:meth:`VirtualClock.count`), and :meth:`VirtualClock.state` /
:meth:`VirtualClock.restore` carry the counted clock through a checkpoint bit for bit.
Everything here is host NumPy, deterministic from the seeds.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.sampling.availability import Trace
from deltafl_jax.sampling.clock import SlotJobs, check_deadline, fastest_job, finish, keep_cohort
from deltafl_jax.sampling.inclusion import KeepOrder, arrivals, keep_order, kept_probability
from deltafl_jax.sampling.offline import TraceStretches, check_sessions, exponential_sessions
from deltafl_jax.sampling.samplers import Cohort, FixedSampler, Sampler

TIME = "virtual_time"
SELECTED = "selected_rounds"
DROPPED = "dropped_rounds"
LATE = "late_rounds"
OFFLINE = "offline_rounds"
COUNTED = "counted_rounds"


class VirtualClock:
    """The clock and the deadline's drops of the plan groups of a run.

    settings: the run's :class:`~deltafl_jax.sampling.speeds.TimingSettings`; speeds: its
    :class:`~deltafl_jax.sampling.speeds.DeviceSpeeds`; seeds: each plan group's seed;
    sizes: the training clients' example counts n_k; m: the plan's slots; work: the clients'
    local work (:class:`deltafl_jax.sampling.plan.LocalWork`); model_bytes: the model's size, sent
    down and up once per job; availability: the run's model (a ``trace`` says when a client
    goes offline during its job; None or another model: only ``--mean_online_seconds`` does).
    """

    def __init__(self, settings, speeds, seeds: Sequence[int], sizes: np.ndarray, m: int,
                 work, model_bytes: int, availability=None):
        self.settings = settings
        self.speeds = speeds
        self.seeds = tuple(int(s) for s in seeds)
        self.sizes = np.asarray(sizes, np.int64)
        self.m = int(m)
        self.work = work
        self.model_bytes = int(model_bytes)
        self.slots = max(self.m, settings.slots(self.m))
        G, N = len(self.seeds), self.sizes.size
        self.now = np.zeros((G,), np.float64)
        self.selected_rounds = np.zeros((G, N), np.int64)
        self.dropped_rounds = np.zeros((G, N), np.int64)
        self.late_rounds = np.zeros((G, N), np.int64)
        self.offline_rounds = np.zeros((G, N), np.int64)
        self.counted = 0
        self._rounds: Dict[int, dict] = {}
        self.trace = availability if isinstance(availability, Trace) else None
        self.stretches = None if self.trace is None else TraceStretches(self.trace.traces)
        self._order: Optional[KeepOrder] = None

    @property
    def over_selects(self) -> bool:
        return self.slots > self.m

    def selection_sampler(self) -> Sampler:
        """The sampler of the M slots under over-selection (M distinct clients, uniformly)."""
        return FixedSampler(num_clients=self.sizes.size, slots=self.slots)

    def keep_order(self) -> KeepOrder:
        """The training clients' order of arrival in any round
        (:func:`deltafl_jax.sampling.inclusion.keep_order`), built once: speeds and planned
        work are fixed per client."""
        if self._order is None:
            t, sizes = self.settings, self.sizes
            self._order = keep_order(arrivals(
                self.speeds, sizes, self.work.steps_for(np.maximum(sizes, 1)),
                self.work.batch_size, self.model_bytes, deadline=t.round_deadline,
                partial_work=t.partial_work, full_batches=self.work.local_steps is not None))
        return self._order

    def kept_probabilities(self, online=None):
        """clients -> the probability that each is kept this round under over-selection,
        given the round's `online` ids (None: every client;
        :func:`deltafl_jax.sampling.inclusion.kept_probability`)."""
        order = self.keep_order()
        return lambda clients: kept_probability(order, clients, self.slots, self.m, online)

    @property
    def goes_offline(self) -> bool:
        """Whether a client may go offline during its job (module docstring)."""
        return self.settings.mean_online_seconds is not None or self.trace is not None

    def online_for(self, seed: int, round_idx: int, clients: np.ndarray
                   ) -> Optional[np.ndarray]:
        """[M] the seconds each client of round `round_idx` stays online from its job's start
        (:mod:`deltafl_jax.sampling.offline`; None: no client goes offline)."""
        clients = np.clip(np.asarray(clients, np.int64), 0, self.sizes.size - 1)  # empty: any
        out = None
        mean = self.settings.mean_online_seconds
        if mean is not None:
            out = exponential_sessions(mean, seed, round_idx, clients)
        if self.trace is not None:
            stay = self.stretches.online_for(self.trace.time(round_idx))
            stay = stay[self.trace.assign[clients]]
            out = stay if out is None else np.minimum(out, stay)
        return out

    def finish_of(self, cohort: Cohort, online_for: Optional[np.ndarray] = None):
        """:func:`~deltafl_jax.sampling.clock.finish` of one group's selected cohort
        (online_for [M]: each slot's seconds online, None: nobody goes offline)."""
        clients = np.asarray(cohort.clients, np.int64)
        present = np.asarray(cohort.present, bool)
        n = np.where(present, self.sizes[clients], 0)
        planned = np.where(present, self.work.steps_for(np.maximum(n, 1)), 0).astype(np.int32)
        t = self.settings
        return finish(self.speeds, SlotJobs(clients, present, planned, n, online_for),
                      self.work.batch_size, self.model_bytes, m=self.m, deadline=t.round_deadline,
                      partial_work=t.partial_work, full_batches=self.work.local_steps is not None)

    def select(self, round_idx: int, cohorts: Sequence[Cohort], online=None
               ) -> Tuple[List[Cohort], np.ndarray]:
        """The kept cohorts of round `round_idx` (m slots each) and their steps [G, m], from
        each group's selected cohort (drawn among `online`, one id array per group; None:
        every client); the round's durations and drops are kept until it is counted. Under
        over-selection each kept client carries its probability of being kept this round
        (:mod:`deltafl_jax.sampling.inclusion`), else the selection sampler's."""
        kept, steps, seconds, late, sel, drop = [], [], [], [], [], []
        late_ids, lost_ids = [], []
        deadline = self.settings.round_deadline
        for g, cohort in enumerate(cohorts):
            present = np.asarray(cohort.present, bool)
            ids = np.asarray(cohort.clients, np.int64)
            stay = (self.online_for(self.seeds[g], round_idx, ids) if self.goes_offline
                    else None)
            fin = self.finish_of(cohort, stay)
            exact = None if not self.over_selects else self.kept_probabilities(
                None if online is None else online[g])
            k, s = keep_cohort(cohort, fin, self.m, exact)
            kept.append(k)
            steps.append(np.asarray(s, np.int32))
            seconds.append(float(fin.round_seconds))
            late.append(int(np.sum(present & (np.asarray(fin.seconds) > deadline)))
                        if deadline is not None else 0)
            sel.append(ids[present])
            drop.append(ids[present & ~np.asarray(fin.keep, bool)])
            late_ids.append(ids[present & fin.late])
            lost_ids.append(ids[present & fin.offline])
        self._rounds[int(round_idx)] = {"seconds": np.asarray(seconds, np.float64),
                                        "late": np.asarray(late, np.int64),
                                        "selected": sel, "dropped": drop,
                                        "late_ids": late_ids, "lost_ids": lost_ids}
        return kept, np.stack(steps) if steps else np.zeros((0, self.m), np.int32)

    def count(self, round_idx: int) -> Dict[str, np.ndarray]:
        """Count round `round_idx` as trained (round 0 starts afresh); its per-group metrics
        [G]: ``virtual_time`` (the round's virtual end), ``round_seconds``, ``num_dropped``
        (selected, not aggregated), ``num_late`` (past the deadline) and, when clients may
        go offline, ``num_offline`` (lost by going offline before their work arrived)."""
        t = int(round_idx)
        if t == 0:   # a run from its start (an experiment may run more than once)
            self.now[:] = 0.0
            for counts in (self.selected_rounds, self.dropped_rounds, self.late_rounds,
                           self.offline_rounds):
                counts[:] = 0
        r = self._rounds.pop(t)
        self.now = self.now + r["seconds"]
        for g in range(len(self.seeds)):
            for counts, key in ((self.selected_rounds, "selected"),
                                (self.dropped_rounds, "dropped"),
                                (self.late_rounds, "late_ids"),
                                (self.offline_rounds, "lost_ids")):
                counts[g, np.unique(r[key][g])] += 1
        self.counted = t + 1
        for old in [k for k in self._rounds if k <= t]:
            self._rounds.pop(old)
        out = {TIME: self.now.copy(), "round_seconds": r["seconds"].copy(),
               "num_dropped": np.array([d.size for d in r["dropped"]], np.int64),
               "num_late": r["late"].copy()}
        if self.goes_offline:
            out["num_offline"] = np.array([d.size for d in r["lost_ids"]], np.int64)
        return out

    def client_counts(self):
        """(name, [G, N]) of the per-client counts the evaluations record: the rounds each
        client was selected and dropped, and of those dropped, the rounds it was past the
        deadline (``train_rounds_late``, with a deadline) and went offline before its work
        arrived (``train_rounds_offline``, when clients may go offline)."""
        out = [("train_rounds_selected", self.selected_rounds),
               ("train_rounds_dropped", self.dropped_rounds)]
        if self.settings.round_deadline is not None:
            out.append(("train_rounds_late", self.late_rounds))
        if self.goes_offline:
            out.append(("train_rounds_offline", self.offline_rounds))
        return out

    def reached(self, stop_at: Optional[float]) -> bool:
        """Every group's clock is at or past `stop_at` (None: never)."""
        return stop_at is not None and self.counted > 0 and bool(np.all(self.now >= stop_at))

    def check(self) -> None:
        """ConfigError (one line) when no training client could meet ``--round_deadline``
        in any round (:func:`deltafl_jax.sampling.clock.check_deadline`: speeds are fixed per
        client, so the fastest job decides for the whole run), or when even the fastest job
        would almost never outlast ``--mean_online_seconds``
        (:func:`deltafl_jax.sampling.offline.check_sessions`)."""
        t = self.settings
        planned = self.work.steps_for(np.maximum(self.sizes, 1))
        full = self.work.local_steps is not None
        check_deadline(t.round_deadline, self.speeds, self.sizes, planned,
                       self.work.batch_size, self.model_bytes, partial_work=t.partial_work,
                       full_batches=full)
        if t.mean_online_seconds is not None:
            check_sessions(t.mean_online_seconds, fastest_job(
                self.speeds, self.sizes, planned, self.work.batch_size, self.model_bytes,
                partial_work=t.partial_work, full_batches=full))

    def state(self) -> Dict[str, np.ndarray]:
        """What a checkpoint after `counted` rounds keeps."""
        out = {TIME: self.now.copy(), SELECTED: self.selected_rounds.copy(),
               DROPPED: self.dropped_rounds.copy(),
               COUNTED: np.asarray(self.counted, np.int64)}
        if self.settings.round_deadline is not None:
            out[LATE] = self.late_rounds.copy()
        if self.goes_offline:
            out[OFFLINE] = self.offline_rounds.copy()
        return out

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        """Continue from a :meth:`state` (a checkpoint without the counts by cause, written
        before they were kept, restores them as 0)."""
        self.now = np.asarray(state[TIME], np.float64).copy()
        self.selected_rounds = np.asarray(state[SELECTED], np.int64).copy()
        self.dropped_rounds = np.asarray(state[DROPPED], np.int64).copy()
        zeros = np.zeros_like(self.dropped_rounds)
        self.late_rounds = np.asarray(state.get(LATE, zeros), np.int64).copy()
        self.offline_rounds = np.asarray(state.get(OFFLINE, zeros), np.int64).copy()
        self.counted = int(np.asarray(state[COUNTED]))
        self._rounds = {}
