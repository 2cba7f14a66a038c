"""An asynchronous run (a spec with ``asynchronous``: FedBuff, FedAsync, ...) in the run loop.

A "round" of the loop is one server step: ``--num_rounds`` server steps, evaluated every
``--eval_every`` of them through the usual evaluation, with the usual outputs and
checkpoints. :class:`AsyncRound` is what :class:`deltafl_jax.run.experiment.Experiment` reads
of such a run: the jitted step, the initial :class:`~deltafl_jax.asynchronous.step.BufferedState`,
the model it serves, and :class:`AsyncClock`, which plays the part the synchronous
:class:`~deltafl_jax.sampling.timeline.VirtualClock` plays in a round's plan, its counts, its
virtual time and the checkpoint's host state.

The loop plans step t + 1 while the device runs step t, and the schedulers are stateful
(:class:`~deltafl_jax.asynchronous.scheduler.AsyncScheduler`): the clock keeps each
scheduler's state as it was before the newest plan, so that a checkpoint after step t holds
the schedulers after step t (the plan of step t + 1 is drawn again on resume, identically).
Without ``--client_speed`` every client's device is the uniform one (the speed settings'
defaults): a job then lasts in proportion to its examples.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from deltafl_jax.asynchronous.run import BufferedRun
from deltafl_jax.asynchronous.step import current_params, init_buffered_state
from deltafl_jax.sampling.speeds import BYTES_PER_KBPS, DeviceSpeeds, build_speeds
from deltafl_jax.sampling.timeline import TIME

SCHEDULER = "scheduler"   # the host state of seed g's scheduler: f"{SCHEDULER}{g}"
AGGREGATED = "aggregated_updates"
STARTED = "started_jobs"
STALE = "stale_updates"
LOST = "lost_jobs_by_client"
COUNTED = "counted_rounds"
# The per-client counts [G, N] an asynchronous run records (clients.npz, each evaluation) and
# sums per availability quintile of the training clients (``train_avail_q{j}_...``).
CLIENT_COUNTS = ("train_jobs_started", "train_updates_aggregated", "train_updates_stale")
LOST_COUNTS = "train_jobs_lost"   # [G, N] with --mean_online_seconds: jobs lost mid-job
RATE = "train_availability_rate"   # [G, N] each client's availability rate (clients.npz)


def async_speeds(timing, num_clients: int, data_seed: int) -> DeviceSpeeds:
    """The run's device speeds: ``--client_speed``'s, or with none every client the uniform
    device of ``--client_speed_example_s`` and ``--client_speed_kbps``."""
    speeds = build_speeds(timing, num_clients=num_clients, data_seed=data_seed)
    if speeds is not None:
        return speeds
    return DeviceSpeeds(num_clients, timing.client_speed_example_s,
                        timing.client_speed_kbps * BYTES_PER_KBPS)


class AsyncClock:
    """The virtual clock of an asynchronous run, per seed (plan group): the time of the
    server steps counted so far (``now``) and, per training client [G, N], the jobs it
    started (``started``: by the time the step was taken and the freed slots refilled), its
    updates aggregated (``aggregated``), its updates dropped as stale (``stale``) and, when
    clients may go offline mid-job, its jobs lost (``lost``), with the schedulers of `run` (a
    :class:`BufferedRun`)."""

    over_selects = False

    def __init__(self, run: BufferedRun, num_clients: int, rates=None):
        self.run = run
        self.rates = None if rates is None else np.asarray(rates, np.float64)
        G = len(run.schedulers)
        self.now = np.zeros((G,), np.float64)
        self.aggregated = np.zeros((G, int(num_clients)), np.int64)
        self.started = np.zeros_like(self.aggregated)
        self.stale = np.zeros_like(self.aggregated)
        self.lost = np.zeros_like(self.aggregated)
        self.counted = 0
        self._initial = self.schedulers_state()
        self._steps: Dict[int, tuple] = {}

    def schedulers_state(self) -> Dict[str, Dict[str, np.ndarray]]:
        return {f"{SCHEDULER}{g}": s.state() for g, s in enumerate(self.run.schedulers)}

    def restore_schedulers(self, state) -> None:
        for g, s in enumerate(self.run.schedulers):
            s.restore(dict(state[f"{SCHEDULER}{g}"]))

    def plan(self, step: int):
        """(the plan, the step's inputs) of server step `step` (0-based; step 0 starts the
        schedulers afresh), drawn from the schedulers; kept until :meth:`count`."""
        if step == 0:
            self.restore_schedulers(self._initial)
        before = self.schedulers_state()
        plan, inputs, steps = self.run.next_step(step)
        after = [(s.started.copy(), s.stale.copy(), s.lost_by.copy())
                 for s in self.run.schedulers]
        self._steps[int(step)] = (steps, before, after)
        return plan, inputs

    def count(self, step: int) -> Dict[str, np.ndarray]:
        """Count server step `step` as taken; its per-group metrics [G]: ``virtual_time``
        (the step's time), ``num_selected`` (K, the updates aggregated) and
        ``dropped_updates`` (the stale updates dropped since the previous step) and, when
        clients may go offline mid-job, ``lost_jobs`` (the jobs lost since then)."""
        t = int(step)
        if t == 0:
            self.now[:] = 0.0
            self.aggregated[:] = 0
        steps, _, after = self._steps[t]
        for old in [k for k in self._steps if k < t]:
            self._steps.pop(old)
        self.now = np.asarray([s.time for s in steps], np.float64)
        for g, s in enumerate(steps):
            np.add.at(self.aggregated[g], s.clients, 1)
            self.started[g], self.stale[g], self.lost[g] = after[g]
        self.counted = t + 1
        out = {TIME: self.now.copy(),
               "num_selected": np.asarray([s.clients.size for s in steps], np.int64),
               "dropped_updates": np.asarray([s.dropped for s in steps], np.int64)}
        if self.goes_offline:
            out["lost_jobs"] = np.asarray([s.lost for s in steps], np.int64)
        return out

    @property
    def goes_offline(self) -> bool:
        """Whether jobs may be lost mid-job (``--mean_online_seconds``)."""
        return self.run.schedulers[0].mean_online is not None

    def reached(self, stop_at: Optional[float]) -> bool:
        """Every seed's clock is at or past `stop_at` (None: never)."""
        return stop_at is not None and self.counted > 0 and bool(np.all(self.now >= stop_at))

    def client_counts(self):
        """(name, [G, N]) of the per-client counts the evaluations record
        (:data:`CLIENT_COUNTS`), and with an availability model each client's rate
        (``train_availability_rate``, the same in every group)."""
        out = list(zip(CLIENT_COUNTS, (self.started, self.aggregated, self.stale)))
        if self.goes_offline:
            out.append((LOST_COUNTS, self.lost))
        if self.rates is not None:
            out.append((RATE, np.broadcast_to(self.rates, self.started.shape)))
        return out

    def state(self) -> Dict[str, object]:
        """What a checkpoint after `counted` steps keeps: the clock, the counts, and the
        schedulers as they were after step `counted` (before the next step's plan)."""
        planned = self._steps.get(self.counted)
        schedulers = planned[1] if planned is not None else self.schedulers_state()
        return {TIME: self.now.copy(), AGGREGATED: self.aggregated.copy(),
                STARTED: self.started.copy(), STALE: self.stale.copy(), LOST: self.lost.copy(),
                COUNTED: np.asarray(self.counted, np.int64), **schedulers}

    def restore(self, state) -> None:
        """Continue from a :meth:`state`."""
        self.restore_schedulers(state)   # CheckpointMismatch for another scheduler's state
        self.now = np.asarray(state[TIME], np.float64).copy()
        self.aggregated = np.asarray(state[AGGREGATED], np.int64).copy()
        self.started = np.asarray(state[STARTED], np.int64).copy()
        self.stale = np.asarray(state[STALE], np.int64).copy()
        self.lost = (np.asarray(state[LOST], np.int64).copy() if LOST in state
                     else np.zeros_like(self.stale))   # not saved before jobs could be lost
        self.counted = int(np.asarray(state[COUNTED]))
        self._steps = {}


class AsyncRound:
    """What the run loop reads of an asynchronous run: the jitted step of `run` (a
    :class:`~deltafl_jax.asynchronous.run.BufferedRun`) as a round
    ``round_fn(state, (data, inputs), keys)``, the initial state, the served model and the
    clock (`num_clients` training clients; `availability`'s rates, None: no model)."""

    def __init__(self, run: BufferedRun, num_clients: int, availability=None):
        self.run = run
        self.clock = AsyncClock(run, num_clients,
                                None if availability is None else availability.rates())
        self.buffer_size = run.K

    def round_fn(self, state, data, keys):
        round_data, inputs = data
        return self.run.step_fn(state, round_data, inputs, keys)

    def lower(self, state, data, keys) -> "LoweredStep":
        """The jitted step lowered for :meth:`round_fn`'s arguments (``--estimate`` times
        its compiled program as a round's)."""
        round_data, inputs = data
        return LoweredStep(self.run.step_fn.lower(state, round_data, inputs, keys))

    def initial_state(self, params, server_tx, server_lr):
        """w_0 (`params`, leaves [R, ...]) in a ring of the run's size, with the server
        optimizer's state."""
        return init_buffered_state(params, self.run.schedulers[0].V, server_tx, server_lr)

    @staticmethod
    def served_params(state):
        return current_params(state)


class LoweredStep:
    """A lowered server step with a round's interface: ``as_text()``, and ``compile()`` ->
    :class:`CompiledStep`."""

    def __init__(self, lowered):
        self.lowered = lowered

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self) -> "CompiledStep":
        return CompiledStep(self.lowered.compile())


class CompiledStep:
    """A compiled server step called as a round, ``(state, (data, inputs), keys)``, with the
    compiled program's ``memory_analysis()`` and ``cost_analysis()``."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, state, data, keys):
        round_data, inputs = data
        return self.compiled(state, round_data, inputs, keys)

    def memory_analysis(self):
        return self.compiled.memory_analysis()

    def cost_analysis(self):
        return self.compiled.cost_analysis()
