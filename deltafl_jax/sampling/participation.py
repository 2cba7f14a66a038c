"""The host's record of who takes part: the clients online in each round (from the run's
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

from typing import Dict, List, Optional, Sequence

import numpy as np

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
