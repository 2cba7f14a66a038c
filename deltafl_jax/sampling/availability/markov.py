"""``--availability=markov``: a two-state chain per client (IBM/fedau's ``markov-q``,
util/util.py ``WorkerSampler``): off -> on with probability b_i = q
(``--availability_markov_off_on``), on -> off with a_i = q (1/p_i - 1), both divided by a_i
when a_i > 1, so the stationary on-probability is p_i (``--availability_probs``); round 0 is
drawn from the stationary law (on with probability p_i, key ``[seed, 0, SEED_STREAM, 2]``),
round r >= 1 is one step of the chain from round r - 1 (key ``[seed, r, STREAM, 2]``)."""

from __future__ import annotations

import dataclasses
from typing import Dict

import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import CheckpointMismatch, ConfigError
from deltafl_jax.sampling.availability.base import (SEED_STREAM, STREAM, Availability,
                                                    Population, flag_text)
from deltafl_jax.sampling.availability.probabilities import (client_probabilities, reads_labels,
                                                             sometimes_online)


@dataclasses.dataclass(frozen=True)
class MarkovSettings:
    """The chain's off -> on probability."""

    markov_off_on: float = setting(
        0.05, "markov: q, the off -> on probability (on -> off: q (1/p_i - 1); both divided by "
        "it when it exceeds 1), so client i is on a fraction p_i of the rounds",
        flag="availability_markov_off_on")

    def __post_init__(self):
        if not 0.0 < self.markov_off_on <= 1.0:
            raise ConfigError(f"{flag_text('availability_markov_off_on', self.markov_off_on)}:"
                              f" a probability must be in (0, 1]")


class Markov(Availability):
    """A two-state chain per client with stationary on-probability p_i (module docstring);
    stateful: the on/off vector of the last round asked, per seed."""

    name = "markov"
    summary = "markov (an on/off chain per client, stationary p_i)"
    position = 2
    settings = MarkovSettings
    word = 2

    def __init__(self, p: np.ndarray, off_on: float):
        p = np.asarray(p, np.float64)   # [N]
        super().__init__(p.size)
        self.p = p
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = np.where(p > 0, off_on * (1.0 - p) / np.where(p > 0, p, 1.0), np.inf)
        never = np.isinf(raw)
        scale = np.where(never, 1.0, np.maximum(raw, 1.0))   # inf / inf left out
        self.off_on = np.where(never, 0.0, off_on / scale)   # b_i
        self.on_off = np.where(never, 1.0, raw / scale)      # a_i
        self._last: Dict[int, tuple] = {}                    # seed -> (round, on [N])

    @classmethod
    def needs_labels(cls, settings) -> bool:
        return reads_labels(settings)

    @classmethod
    def build(cls, settings, clients: Population) -> "Markov":
        p = sometimes_online(client_probabilities(settings, clients), settings)
        return cls(p, settings.markov_off_on)

    def _start(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng([int(seed), 0, SEED_STREAM, self.word])
        return rng.random(self.num_clients) < self.p

    def _step(self, seed: int, round_idx: int, on: np.ndarray) -> np.ndarray:
        rng = np.random.default_rng([int(seed), int(round_idx), STREAM, self.word])
        u = rng.random(self.num_clients)
        # on -> on when u >= a_i, off -> on when u < b_i: np.where(on, u >= a, u < b) written
        # with bitwise operators (the same booleans; a few times faster on [N] bool arrays)
        return (on & (u >= self.on_off)) | (~on & (u < self.off_on))

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        last = self._last.get(int(seed))
        if last is None or last[0] > round_idx:
            last = (0, self._start(seed))
        r, on = last
        while r < round_idx:
            r += 1
            on = self._step(seed, r, on)
        self._last[int(seed)] = (r, on)
        return np.flatnonzero(on).astype(np.int64)

    def rates(self) -> np.ndarray:
        return self.p.copy()

    def state(self, seed: int) -> Dict[str, np.ndarray]:
        last = self._last.get(int(seed))
        if last is None:
            return {}
        return {"round": np.asarray(last[0], np.int64), "on": last[1].copy()}

    def restore(self, seed: int, state: Dict[str, np.ndarray], next_round: int) -> None:
        if next_round <= 0 or not state:
            self._last.pop(int(seed), None)
            return
        on = np.asarray(state["on"])
        if on.dtype != np.bool_ or on.shape != (self.num_clients,):
            raise CheckpointMismatch(f"markov availability state: 'on' must be bool "
                                     f"[{self.num_clients}], got {on.dtype} {list(on.shape)}")
        if int(state["round"]) != next_round - 1:
            raise CheckpointMismatch(f"markov availability state ends at round "
                                     f"{int(state['round'])}, the run resumes at {next_round}")
        self._last[int(seed)] = (next_round - 1, on.copy())


MODEL = Markov
