"""Each round's plan on the host: who trains, with how many steps, and what was counted.

:class:`RoundPlanner` draws a round's cohorts from the run's sampler
(:mod:`deltafl_jax.sampling`) among the clients online (the participation record,
:class:`Participation`), or by the algorithm's weights for
an algorithm that samples from its state; with the virtual clock
(:class:`deltafl_jax.sampling.timeline.VirtualClock`) the server selects and keeps the first
to finish by the deadline. It turns the cohorts into the round's plan and data on the
devices (:func:`deltafl_jax.sampling.plan.make_round_plan`, the program's client store), counts each
round trained (online clients, virtual time, drops), and keeps the host state a checkpoint
saves. An asynchronous run's plans are its clock's
(:class:`deltafl_jax.run.buffered.AsyncClock`).

The planner holds the host state that changes as the run goes (the clock, the participation
record); the :class:`~deltafl_jax.run.program.Program` whose shapes the plans take is passed
to the calls that build a plan. It may import the sampling package, the plan, the mesh's host
transfers and, in :mod:`deltafl_jax.run`, the resolve step and the program; never the
evaluation or the experiment.

**The participation record** (:class:`Participation`), the host's record of who takes part: the clients online in each round (from the run's
availability model) and each client's realised participation, per plan group (one per seed,
or one per replica for an algorithm that samples from its state).

:class:`Participation` asks the availability model (:mod:`deltafl_jax.sampling.availability`;
None: every client online, ``--availability=always``) for each round's online clients once per
seed, before the sampler draws among them, and keeps each group's counts: the rounds each
client was online and the rounds it was sampled (present in the cohort; a client drawn twice
in one round, as DRFA's draws with replacement may, counts once). A round is counted when it
is trained (:meth:`Participation.count`), so the counts after r rounds cover rounds 0..r-1 even
though the run plans the next round ahead. :meth:`Participation.state` is what a checkpoint
keeps after r rounds (the counts and a stateful model's state after drawing round r - 1) and
:meth:`Participation.restore` continues from it, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np

from deltafl_jax import rounds
from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.run.program import Program, model_bytes
from deltafl_jax.run.resolve import ResolvedRun
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.sampling.timeline import VirtualClock

ONLINE = "online_rounds"
SAMPLED = "sampled_rounds"
COUNTED = "counted_rounds"
MODEL = "availability"


class Participation:
    """Online sets and participation counts of the plan groups of a run.

    seeds: each plan group's seed (repeats allowed: groups of one seed share its online sets).
    num_clients: N. availability: the run's model (``online``, ``state``, ``restore``), or
    None when every client is always online.
    """

    def __init__(self, seeds: Sequence[int], num_clients: int, availability=None):
        self.seeds = tuple(int(s) for s in seeds)
        self.unique = tuple(sorted(set(self.seeds)))
        self.num_clients = int(num_clients)
        self.availability = availability
        G = len(self.seeds)
        self._online_counts = np.zeros((G, self.num_clients if availability else 0), np.int64)
        self.sampled_rounds = np.zeros((G, self.num_clients), np.int64)
        self.counted = 0
        self._online: Dict[int, List[np.ndarray]] = {}
        self._after: Dict[int, Dict[int, dict]] = {}   # round -> seed -> model state after it
        self._cohorts: Dict[int, list] = {}

    @property
    def online_rounds(self) -> np.ndarray:
        """[G, N] int64: the rounds each client was online (every counted round when every
        client always is: no per-round work of O(N))."""
        if self.availability is None:
            return np.full(self.sampled_rounds.shape, self.counted, np.int64)
        return self._online_counts

    def online(self, round_idx: int) -> Optional[List[np.ndarray]]:
        """Each group's online ids in round `round_idx` (sorted), or None when every client is
        online; drawn once per seed and kept until the round is counted."""
        if self.availability is None:
            return None
        t = int(round_idx)
        if t not in self._online:
            by_seed = {s: np.asarray(self.availability.online(s, t), np.int64)
                       for s in self.unique}
            self._online[t] = [by_seed[s] for s in self.seeds]
            self._after[t] = {s: {k: np.array(v, copy=True)
                                  for k, v in self.availability.state(s).items()}
                              for s in self.unique}
        return self._online[t]

    def drawn(self, round_idx: int, cohorts: Sequence) -> None:
        """Keep the cohorts (one per group) drawn for round `round_idx` until it is counted."""
        self._cohorts[int(round_idx)] = list(cohorts)

    def count(self, round_idx: int) -> np.ndarray:
        """Count round `round_idx` as trained: its online clients and its cohorts' present
        clients, in each group (round 0 starts the counts afresh); returns each group's online
        count [G]."""
        t = int(round_idx)
        if t == 0:   # a run from its start (an experiment may run more than once)
            self._online_counts[:] = 0
            self.sampled_rounds[:] = 0
        online = self.online(t)
        cohorts = self._cohorts.pop(t)
        if online is None:
            counts = np.full((len(self.seeds),), self.num_clients, np.int64)
        else:
            counts = np.array([ids.size for ids in online], np.int64)
            for g, ids in enumerate(online):
                self._online_counts[g, ids] += 1
        for g, cohort in enumerate(cohorts):
            ids = np.unique(np.asarray(cohort.clients)[np.asarray(cohort.present, bool)])
            self.sampled_rounds[g, ids] += 1
        self.counted = t + 1
        for old in [r for r in self._online if r <= t - 1]:
            self._online.pop(old)
        for old in [r for r in self._after if r <= t - 1]:
            self._after.pop(old)
        return counts

    def state(self) -> Dict[str, object]:
        """What a checkpoint after `counted` rounds keeps: the counts, and a stateful model's
        state after drawing round counted - 1, per seed ({seed: {name: array}})."""
        out: Dict[str, object] = {ONLINE: self.online_rounds.copy(),
                                  SAMPLED: self.sampled_rounds.copy(),
                                  COUNTED: np.asarray(self.counted, np.int64)}
        after = self._after.get(self.counted - 1)
        if after is not None and any(after.values()):
            out[MODEL] = {str(s): {k: np.asarray(v) for k, v in st.items()}
                          for s, st in after.items()}
        return out

    def restore(self, state: Dict[str, object]) -> None:
        """Continue from a :meth:`state` (the counts, and the model's state: its next round is
        the first not counted)."""
        self.sampled_rounds = np.asarray(state[SAMPLED], np.int64).copy()
        self.counted = int(np.asarray(state[COUNTED]))
        if self.availability is not None:
            self._online_counts = np.asarray(state[ONLINE], np.int64).copy()
        self._online, self._after, self._cohorts = {}, {}, {}
        model = state.get(MODEL)
        if model and self.availability is not None:
            self._after[self.counted - 1] = {s: dict(model[str(s)]) for s in self.unique}
            for s in self.unique:
                self.availability.restore(s, dict(model[str(s)]), self.counted)


CLOCK = "clock"   # the virtual clock's part of the checkpointed host state


@dataclasses.dataclass(frozen=True, eq=False)
class RoundPlanner:
    """The host's side of each round of `run`. clock: the virtual clock (``--client_speed``;
    an asynchronous run's :class:`~deltafl_jax.run.buffered.AsyncClock`; None: none).
    participation: the online sets and the participation counts (None for an asynchronous
    run, whose schedulers ask the availability model who is online)."""

    run: ResolvedRun
    clock: Optional[Any] = None
    participation: Optional[Participation] = None
    asynchronous: bool = False

    def round_plan(self, program: Program, round_idx: int, state=None) -> plan_lib.RoundPlan:
        """The plan as the devices read it (indices into the split, or into the round's
        buffer when the host keeps the split). An algorithm that samples from its state
        (``sampling``) needs the round's state (the previous round's result)."""
        cohorts, steps = self.kept_cohorts(round_idx, state)
        return plan_lib.make_round_plan(self.run.seeds, round_idx, self.run.data.train.offsets,
                                        program.slots, self.run.work, program.caps,
                                        packed=program.store.host, cohorts=cohorts,
                                        steps=steps)

    def round_data(self, program: Program, round_idx: int, state=None) -> rounds.RoundData:
        """The round's plan and examples on the device(s) (`state`: as :meth:`round_plan`),
        with the probe sample of an algorithm that has one. An asynchronous run's: server
        step `round_idx`'s data and its inputs (:class:`deltafl_jax.run.buffered.AsyncClock`)."""
        if self.asynchronous:
            plan, inputs = self.clock.plan(round_idx)
            return program.store.round_data(plan), inputs
        data = program.store.round_data(self.round_plan(program, round_idx, state))
        if self.run.algorithm.probe is None:
            return data
        probe = plan_lib.make_probe_plan(self.run.seeds, round_idx,
                                         self.run.data.train.offsets, program.slots,
                                         program.caps)
        return data._replace(probe=program.store.put(probe))

    def kept_cohorts(self, round_idx: int, state=None, online=None):
        """(cohorts, steps): each plan group's cohort of the round and the local steps [G, m]
        that cap its slots' (None: the work's), drawn among `online` (one id array per group;
        None: the participation record's online sets, or every client). With the virtual clock
        the server selects (M slots under ``--over_select``) and keeps the m first to finish
        by the deadline (:mod:`deltafl_jax.sampling.timeline`)."""
        run = self.run
        sampler = run.sampler
        if self.clock is not None and self.clock.over_selects and \
                run.algorithm.sampling is None:
            sampler = self.clock.selection_sampler()
        if online is None and self.participation is not None:
            online = self.participation.online(round_idx)
        if run.algorithm.sampling is None:
            cohorts = plan_lib.draw_cohorts(sampler, run.seeds, round_idx, online)
        else:
            if state is None:
                raise ValueError(f"{run.algorithm.name} samples its clients from its state: "
                                 "give round_plan / round_data the round's state")
            weights = mesh_lib.to_host(self._sampling_fn(state.algo_state))
            cohorts = [sampler.with_weights(weights[g]).cohort(
                           seed, round_idx, None if online is None else online[g])
                       for g, seed in enumerate(run.seeds)]
        steps = None
        if self.clock is not None:
            cohorts, steps = self.clock.select(round_idx, cohorts, online)
        if self.participation is not None:
            self.participation.drawn(round_idx, cohorts)
        return cohorts, steps

    @functools.cached_property
    def _sampling_fn(self):
        return jax.jit(jax.vmap(self.run.algorithm.sampling))

    def count_round(self, round_idx: int) -> Dict[str, np.ndarray]:
        """Count round `round_idx` as trained in the participation record and on the virtual
        clock (once per round, in order, after its plan was drawn); its per-round metrics [R]:
        ``num_online``, the clients online in each replica's plan group, and with the clock
        ``virtual_time``, ``round_seconds``, ``num_dropped`` and ``num_late``
        (:meth:`deltafl_jax.sampling.timeline.VirtualClock.count`)."""
        out = {}
        group = np.asarray(self.run.replicas.group)
        if self.participation is not None:
            out["num_online"] = self.participation.count(round_idx)[group]
        if self.clock is not None:
            out.update({k: v[group] for k, v in self.clock.count(round_idx).items()})
        return out

    def virtual_time(self) -> Optional[np.ndarray]:
        """[R] each replica's virtual time (seconds) at the end of the rounds counted so far,
        or None without the virtual clock."""
        if self.clock is None:
            return None
        return self.clock.now[np.asarray(self.run.replicas.group)].copy()

    def host_state(self) -> Dict[str, object]:
        """The host's state that a checkpoint keeps: the participation record, and the
        virtual clock's under ``clock``."""
        out = dict(self.participation.state()) if self.participation is not None else {}
        if self.clock is not None:
            out[CLOCK] = self.clock.state()
        return out

    def restore_host(self, host: Dict[str, object]) -> None:
        """Continue from a :meth:`host_state`."""
        if self.participation is not None:
            self.participation.restore(host)
        if self.clock is not None:
            self.clock.restore(host[CLOCK])

    def participation_arrays(self, clients=None) -> Dict[str, np.ndarray]:
        """Each replica's realised participation so far, [R, N] (or [R, K] at the training
        clients `clients`): ``train_rounds_online`` and ``train_rounds_sampled``, the rounds its
        plan group's clients were online and sampled; with a clock, its counts
        (``client_counts``)."""
        group = np.asarray(self.run.replicas.group)
        out = {}
        counts = [] if self.participation is None else [
            ("train_rounds_online", self.participation.online_rounds),
            ("train_rounds_sampled", self.participation.sampled_rounds)]
        if self.clock is not None:
            counts += self.clock.client_counts()
        for name, per_group in counts:
            per = per_group[group]
            out[name] = per if clients is None else per[:, np.asarray(clients, np.int64)]
        return out


def virtual_clock(run: ResolvedRun) -> Optional[VirtualClock]:
    """The synchronous rounds' virtual clock (``--client_speed``; None without it), checked
    (ConfigError for a deadline no client can meet); None for an asynchronous run, whose clock
    is its step's."""
    if run.speeds is None or run.spec.asynchronous is not None:
        return None
    clock = VirtualClock(run.config.timing, run.speeds, run.seeds, run.data.train.sizes,
                         run.num_sampled, run.work, model_bytes(run.model),
                         availability=run.availability)
    clock.check()
    return clock


def build_planner(run: ResolvedRun, program: Program,
                  clock: Optional[VirtualClock] = None) -> RoundPlanner:
    """The planner of `run`'s rounds on `program`: with `clock` (:func:`virtual_clock`) and a
    participation record; an asynchronous run's plans from its step's clock."""
    if program.buffered is not None:
        return RoundPlanner(run, clock=program.buffered.clock, asynchronous=True)
    return RoundPlanner(run, clock=clock, participation=Participation(
        run.seeds, run.data.train.num_clients, run.availability))
