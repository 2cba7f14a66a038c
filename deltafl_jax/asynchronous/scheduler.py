"""Buffered asynchronous aggregation on a virtual clock: who trains from which model version,
and when the server steps (FedBuff, Nguyen et al., AISTATS 2022, Algorithm 1).

Host-side, pure NumPy and deterministic from the seed, so a run is the same on every machine
and device count. :class:`AsyncScheduler` simulates the events; the device then trains each
server step's K jobs in lanes, each from its own base version
(:mod:`deltafl_jax.asynchronous.step`).

The events (virtual seconds; a job's duration is ``seconds([client])``, the job time of
:mod:`deltafl_jax.sampling.speeds` for the client's planned local steps, :func:`job_durations`):

- at time 0, version 0, C = ``concurrency`` jobs start; a job records its client, its *base
  version* (the server's version when it starts), its start and its end;
- completions are processed in virtual-time order, ties broken by client id (no client runs
  two jobs at once, so the order is total);
- a completion's staleness is tau = version - base (the version cannot change between its
  arrival and its aggregation: the server steps the moment its buffer fills); with
  ``max_staleness`` S an update with tau > S is dropped; otherwise it joins the buffer;
- when the buffer holds K = ``buffer_size`` updates the server steps: version += 1, at the
  time of the K-th completion (aggregation takes no virtual time);
- the slot a completion frees starts a new job at once, after the server step when the
  completion filled the buffer (so the new job starts from the new version).

Who starts: a client chosen uniformly among the *idle online* clients, those online at the
current version and not already training, with the draw keyed by the job's serial number,
``SeedSequence([seed, serial, STREAM])`` (a three-word key whose third word no other
stream of the project uses). Availability maps to asynchronous time through the version:
the online set at version v is ``availability.online(seed, v)``, the set of the v-th
"round", asked once per version, in increasing order as the stateful models require. A
slot with no idle online client stays empty and is tried again after every later event and
every server step.

FedScale's events (``refill_before_step``, ``draw_busy``; SymbioticLab/FedScale's
asynchronous aggregator): the slot freed by the completion that fills the buffer starts its
job *before* the server step, so that job's base is the old version; and the client is drawn
among all online clients, those still training included (a client may run two jobs at once;
completions tied in time and client go in order of their serial numbers).

Going offline mid-job (``mean_online_seconds`` T, :mod:`deltafl_jax.sampling.offline`): when
job `serial` of client c starts, its client's remaining online session E is drawn,
exponential with mean T, from ``SeedSequence([seed, serial, offline.STREAM, offline.ASYNC])``
hashed with c. If E < the job's duration the job is *lost* at start + E, the moment the
client goes offline: at that event (ordered with the completions by time, then client id)
its slot frees, the loss is counted (``lost``, reported with the next server step as
``dropped`` is) and a new idle online client starts at once. Without T a job runs to its end.

The versions still needed live in a ring of V device slots (:meth:`AsyncScheduler.ring_size`):
when version v + 1 is written, the versions still read are the bases of the K buffered
updates and of the jobs in flight that can still be accepted (base >= v + 1 - S), all in
[v - S, v] and at most C + K - 1 of them, so V = min(S + 2, C + K) slots always hold them
and the new version. The new version takes the lowest slot that holds none of them.

Everything a resumed run needs (the clock, the jobs in flight with their base versions and,
with T, whether each will be lost, the buffer, the ring's versions, the online set of the
current version, the losses not yet reported, a stateful availability model's state, and each
client's jobs started, updates dropped as stale and jobs lost so far: ``started``, ``stale``,
``lost_by``) is
:meth:`state`, a dict of arrays, and :meth:`restore` takes it back.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, NamedTuple, Optional

import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import CheckpointMismatch, ConfigError, RunError
from deltafl_jax.sampling.clock import examples_done
from deltafl_jax.sampling.offline import ASYNC, check_sessions, exponential_sessions
from deltafl_jax.sampling.speeds import DeviceSpeeds, job_seconds

STREAM = 0xA5C1   # SeedSequence([seed, serial, STREAM]): the client that starts job `serial`

_JOB_FIELDS = ("client", "base", "start", "end", "serial")


def job_durations(speeds: DeviceSpeeds, sizes: np.ndarray, work, model_bytes: int
                  ) -> Callable[[np.ndarray], np.ndarray]:
    """ids -> [k] virtual seconds of a whole job of each client: its planned local steps
    (`work`, a :class:`deltafl_jax.sampling.plan.LocalWork`) over its `sizes` [N] examples, timed as a
    synchronous round times them (:func:`deltafl_jax.sampling.clock.examples_done`,
    :func:`deltafl_jax.sampling.speeds.job_seconds`)."""
    sizes = np.asarray(sizes, np.int64)
    full = work.local_steps is not None

    def seconds(ids):
        ids = np.asarray(ids, np.int64)
        n = sizes[ids]
        examples = examples_done(work.steps_for(n), n, work.batch_size, full_batches=full)
        return job_seconds(speeds, ids, examples, model_bytes)

    return seconds


def ring_size(concurrency: int, buffer_size: int, max_staleness: Optional[int],
              refill_before_step: bool = False) -> int:
    """V = min(S + 2, C + K): the model versions the device keeps (module docstring);
    min(S + 2, C + K + 1) when the freed slot refills before the server step (its job's
    base, the old version, is read beside the C - 1 others and the K buffered)."""
    v = concurrency + buffer_size + int(bool(refill_before_step))
    return v if max_staleness is None else min(int(max_staleness) + 2, v)


def check_async(num_clients: int, concurrency: int, buffer_size: int,
                max_staleness: Optional[int]) -> None:
    """ConfigError naming the flag for settings that cannot run."""
    if concurrency < 1:
        raise ConfigError(f"--concurrency={concurrency}: must be >= 1")
    if concurrency > num_clients:
        raise ConfigError(f"--concurrency={concurrency}: more than the {num_clients} "
                          "training clients")
    if buffer_size < 1:
        raise ConfigError(f"--buffer_size={buffer_size}: must be >= 1")
    if buffer_size > concurrency:
        raise ConfigError(f"--buffer_size={buffer_size}: more than --concurrency="
                          f"{concurrency} (K updates are buffered from C clients in flight)")
    if max_staleness is not None and max_staleness < 0:
        raise ConfigError(f"--max_staleness={max_staleness}: must be >= 0")


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    """Buffered asynchronous aggregation (FedBuff; the module docstring)."""

    concurrency: int = setting(
        20, "asynchronous runs: C, the clients training at once; a finished client's slot "
        "starts a new online client at once", flag="concurrency")
    buffer_size: int = setting(
        10, "asynchronous runs: K, the updates the server buffers before each step (<= "
        "--concurrency)", flag="buffer_size")
    max_staleness: Optional[int] = setting(
        None, "asynchronous runs: drop an update whose base version is more than this many "
        "server steps old; unset: keep every update", flag="max_staleness", kind="integer")

    def check(self, num_clients: Optional[int] = None) -> None:
        """ConfigError naming the flag (`num_clients`: the training clients, when known)."""
        check_async(self.concurrency if num_clients is None else num_clients,
                    self.concurrency, self.buffer_size, self.max_staleness)

    @property
    def ring(self) -> int:
        """The model versions the device keeps per replica (:func:`ring_size`)."""
        return ring_size(self.concurrency, self.buffer_size, self.max_staleness)


def check_ring_fits(ring: int, version_bytes: int, free_bytes: Optional[int]) -> None:
    """ConfigError when the ring of `ring` versions of `version_bytes` bytes each (every
    replica's model) does not fit `free_bytes` (None: unknown, no check)."""
    if free_bytes is None:
        return
    need = int(ring) * int(version_bytes)
    if need > free_bytes:
        raise ConfigError(f"the {ring} model versions that --concurrency, --buffer_size and "
                          f"--max_staleness keep need {need / 2**20:.3g} MiB, more than the "
                          f"{free_bytes / 2**20:.3g} MiB free on a device; lower "
                          "--max_staleness or --concurrency")


class ServerStep(NamedTuple):
    """One server step of the scheduler: the K buffered updates, in order of arrival.

    version: the version the step writes (the old one + 1); time: its virtual time.
    clients, base, staleness, serial: [K] int64 each update's client, base version,
    tau = version - 1 - base, and job serial number (the job's shuffles are keyed by it);
    start, end: [K] float64 the jobs' virtual start and end; slots: [K] int32 the ring slots
    of their bases; current_slot: the slot of version - 1 (the server optimizer's base);
    new_slot: the slot the new version is written to; dropped: the stale updates dropped
    since the previous step; lost: the jobs lost since the previous step (their client went
    offline).
    """

    version: int
    time: float
    clients: np.ndarray
    base: np.ndarray
    staleness: np.ndarray
    serial: np.ndarray
    start: np.ndarray
    end: np.ndarray
    slots: np.ndarray
    current_slot: int
    new_slot: int
    dropped: int
    lost: int = 0


def _empty_jobs(n: int) -> Dict[str, np.ndarray]:
    return {"client": np.full(n, -1, np.int64), "base": np.zeros(n, np.int64),
            "start": np.zeros(n, np.float64), "end": np.zeros(n, np.float64),
            "serial": np.zeros(n, np.int64)}


class AsyncScheduler:
    """The event simulation of one seed's asynchronous run (module docstring).

    num_clients: N; concurrency: C jobs in flight; buffer_size: K updates per server step;
    max_staleness: S (None: every update is kept); seconds: ids [k] -> [k] float64 > 0 the
    virtual duration of a job of each client; seed: the run's seed; availability: an
    :class:`~deltafl_jax.sampling.availability.Availability` (None: every client online);
    mean_online_seconds: T, the mean online session (None: no job is lost);
    refill_before_step: the slot freed by the completion that fills the buffer starts its
    job before the server step, from the old version (FedScale); draw_busy: a job's client
    is drawn among all online clients, those training included (FedScale; a client may then
    run two jobs at once). Both False: FedBuff's events (module docstring).
    """

    def __init__(self, *, num_clients: int, concurrency: int, buffer_size: int,
                 max_staleness: Optional[int], seconds: Callable[[np.ndarray], np.ndarray],
                 seed: int, availability=None, mean_online_seconds: Optional[float] = None,
                 refill_before_step: bool = False, draw_busy: bool = False):
        check_async(num_clients, concurrency, buffer_size, max_staleness)
        self.N, self.C, self.K = int(num_clients), int(concurrency), int(buffer_size)
        self.S = None if max_staleness is None else int(max_staleness)
        self.refill_before_step, self.draw_busy = bool(refill_before_step), bool(draw_busy)
        self.seconds, self.seed, self.availability = seconds, int(seed), availability
        self.mean_online = None if mean_online_seconds is None else float(mean_online_seconds)
        if self.mean_online is not None:
            check_sessions(self.mean_online,
                           float(np.min(seconds(np.arange(self.N, dtype=np.int64)))))
        self.V = ring_size(self.C, self.K, self.S, self.refill_before_step)
        self.clock, self.version, self.serial, self.dropped, self.lost = 0.0, 0, 0, 0, 0
        self.flight_lost = np.zeros(self.C, bool)
        self.flight = _empty_jobs(self.C)
        self.buffer = {**_empty_jobs(self.K), "staleness": np.zeros(self.K, np.int64)}
        self.buffered = 0
        self.ring = np.full(self.V, -1, np.int64)
        self.ring[0] = 0
        self.online_version, self.online = -1, np.zeros(0, np.int64)
        # per client: the jobs it started, its updates dropped as stale and (with T) its jobs
        # lost because it went offline, so far
        self.started, self.stale = np.zeros(self.N, np.int64), np.zeros(self.N, np.int64)
        self.lost_by = np.zeros(self.N, np.int64)
        self.fill()

    # ------------------------------------------------------------------ starting jobs

    def online_now(self) -> np.ndarray:
        """The clients online at the current version (asked of the availability once)."""
        if self.online_version != self.version:
            self.online = (np.arange(self.N, dtype=np.int64) if self.availability is None
                           else np.asarray(self.availability.online(self.seed, self.version),
                                           np.int64))
            self.online_version = self.version
        return self.online

    def start(self, slot: int) -> None:
        """Start a job in `slot` (empty) from the current version, if a client is idle."""
        busy = self.flight["client"][self.flight["client"] >= 0]
        idle = (self.online_now() if self.draw_busy
                else np.setdiff1d(self.online_now(), busy, assume_unique=True))
        if idle.size == 0:
            return
        rng = np.random.default_rng([self.seed, self.serial, STREAM])
        client = int(idle[rng.integers(idle.size)])
        duration = float(np.asarray(self.seconds(np.asarray([client], np.int64)))[0])
        if not duration > 0 or not np.isfinite(duration):
            raise RunError(f"client {client}'s job would take {duration} virtual seconds")
        lost = False
        if self.mean_online is not None:
            stay = float(exponential_sessions(self.mean_online, self.seed, self.serial,
                                              np.asarray([client], np.int64), ASYNC)[0])
            lost = stay < duration
            duration = stay if lost else duration
        job = {"client": client, "base": self.version, "start": self.clock,
               "end": self.clock + duration, "serial": self.serial}
        for k, v in job.items():
            self.flight[k][slot] = v
        self.flight_lost[slot] = lost
        self.serial += 1
        self.started[client] += 1

    def fill(self) -> None:
        """Start a job in every empty slot that an idle online client can take."""
        for slot in np.flatnonzero(self.flight["client"] < 0):
            self.start(int(slot))

    # ------------------------------------------------------------------ events

    def next_completion(self) -> int:
        """The slot of the job in flight that ends first (ties: the lower client id, then,
        for two jobs of one client under ``draw_busy``, the earlier job)."""
        busy = np.flatnonzero(self.flight["client"] >= 0)
        if busy.size == 0:
            raise RunError(f"no client is online to train at version {self.version} "
                           f"(virtual time {self.clock:g} s): the asynchronous run cannot go on")
        order = np.lexsort((self.flight["serial"][busy], self.flight["client"][busy],
                            self.flight["end"][busy]))
        return int(busy[order[0]])

    def complete(self, slot: int) -> bool:
        """Process the event in `slot`: a loss (counted), or a completion, dropped or
        buffered; True when the buffer is full."""
        job = {k: self.flight[k][slot] for k in _JOB_FIELDS}
        self.flight["client"][slot] = -1
        self.clock = float(job["end"])
        if self.flight_lost[slot]:
            self.flight_lost[slot] = False
            self.lost += 1
            self.lost_by[int(job["client"])] += 1
            return False
        tau = self.version - int(job["base"])
        if self.S is not None and tau > self.S:
            self.dropped += 1
            self.stale[int(job["client"])] += 1
            return False
        for k, v in {**job, "staleness": tau}.items():
            self.buffer[k][self.buffered] = v
        self.buffered += 1
        return self.buffered == self.K

    def next_step(self) -> ServerStep:
        """Run the events up to the next server step, and take it."""
        while True:
            full = self.complete(self.next_completion())
            if full and self.refill_before_step:
                self.fill()
            if full:
                step = self.server_step()
                self.fill()
                return step
            self.fill()

    def server_step(self) -> ServerStep:
        """Version += 1 with the buffer's K updates; the new version's ring slot."""
        base = self.buffer["base"].copy()
        live = self.flight["client"] >= 0
        fbase = self.flight["base"][live]
        if self.S is not None:
            fbase = fbase[self.version + 1 - fbase <= self.S]
        read = np.union1d(base, fbase)
        free = np.flatnonzero(~np.isin(self.ring, read))
        slots = np.asarray([np.flatnonzero(self.ring == b)[0] if np.any(self.ring == b)
                            else -1 for b in base], np.int32)
        if free.size == 0 or np.any(slots < 0):
            raise RunError("the ring of model versions lost a version still in use")
        current = int(np.flatnonzero(self.ring == self.version)[0])
        new = int(free[0])
        self.ring[new] = self.version + 1
        self.version += 1
        step = ServerStep(version=self.version, time=self.clock,
                          clients=self.buffer["client"].copy(), base=base,
                          staleness=self.buffer["staleness"].copy(),
                          serial=self.buffer["serial"].copy(), start=self.buffer["start"].copy(),
                          end=self.buffer["end"].copy(), slots=slots, current_slot=current,
                          new_slot=new, dropped=self.dropped, lost=self.lost)
        self.buffered, self.dropped, self.lost = 0, 0, 0
        return step

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> Dict[str, np.ndarray]:
        """Everything :meth:`restore` needs to go on bit for bit, as arrays."""
        online = np.zeros(self.N, bool)
        online[self.online] = True
        out = {"clock": np.float64(self.clock), "version": np.int64(self.version),
               "serial": np.int64(self.serial), "dropped": np.int64(self.dropped),
               "buffered": np.int64(self.buffered), "ring": self.ring.copy(),
               "online": online, "online_version": np.int64(self.online_version),
               "started": self.started.copy(), "stale": self.stale.copy()}
        out.update({f"flight_{k}": v.copy() for k, v in self.flight.items()})
        if self.mean_online is not None:
            out.update(lost=np.int64(self.lost), flight_lost=self.flight_lost.copy(),
                       lost_by=self.lost_by.copy())
        out.update({f"buffer_{k}": v.copy() for k, v in self.buffer.items()})
        if self.availability is not None:
            out.update({f"availability_{k}": v
                        for k, v in self.availability.state(self.seed).items()})
        return {k: np.asarray(v) for k, v in out.items()}

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        """Take up `state` from :meth:`state` of a scheduler with the same settings."""
        mine = self.state()
        if {"started", "stale"} - set(state) and set(state) >= set(mine) - {"started", "stale"}:
            raise CheckpointMismatch("the asynchronous checkpoint was written before the "
                                     "scheduler counted each client's jobs started and stale "
                                     "updates, which cannot be rebuilt: start the run again "
                                     "(--overwrite)")
        if set(state) != set(mine) or any(np.shape(state[k]) != mine[k].shape for k in mine):
            raise CheckpointMismatch("the asynchronous scheduler's checkpoint does not match "
                                     "--concurrency, --buffer_size, --max_staleness, "
                                     "--mean_online_seconds or the number of clients")
        self.clock = float(state["clock"])
        self.version, self.serial = int(state["version"]), int(state["serial"])
        self.dropped, self.buffered = int(state["dropped"]), int(state["buffered"])
        self.ring = np.asarray(state["ring"], np.int64).copy()
        self.online = np.flatnonzero(np.asarray(state["online"])).astype(np.int64)
        self.online_version = int(state["online_version"])
        self.started = np.asarray(state["started"], np.int64).copy()
        self.stale = np.asarray(state["stale"], np.int64).copy()
        for k in self.flight:
            self.flight[k] = np.asarray(state[f"flight_{k}"], self.flight[k].dtype).copy()
        if self.mean_online is not None:
            self.lost = int(state["lost"])
            self.flight_lost = np.asarray(state["flight_lost"], bool).copy()
            self.lost_by = np.asarray(state["lost_by"], np.int64).copy()
        for k in self.buffer:
            self.buffer[k] = np.asarray(state[f"buffer_{k}"], self.buffer[k].dtype).copy()
        if self.availability is not None:
            self.availability.restore(self.seed, {k[len("availability_"):]: v for k, v in
                                                  state.items()
                                                  if k.startswith("availability_")},
                                      self.online_version + 1)
