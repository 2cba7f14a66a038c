"""``--availability=bernoulli``: client i online in a round with probability p_i
(``--availability_probs``, :mod:`deltafl_jax.sampling.availability.probabilities`),
independently across clients and rounds; a round's draws are keyed
``[seed, round, STREAM, 1]``."""

from __future__ import annotations

import numpy as np

from deltafl_jax.sampling.availability.base import STREAM, Availability, Population
from deltafl_jax.sampling.availability.probabilities import (client_probabilities, reads_labels,
                                                             sometimes_online)


class Bernoulli(Availability):
    """Client i online with probability p_i in every round, independently."""

    name = "bernoulli"
    summary = "bernoulli (client i with probability p_i)"
    position = 1
    word = 1

    def __init__(self, p: np.ndarray):
        p = np.asarray(p, np.float64)   # [N]
        super().__init__(p.size)
        self.p = p

    @classmethod
    def needs_labels(cls, settings) -> bool:
        return reads_labels(settings)

    @classmethod
    def build(cls, settings, clients: Population) -> "Bernoulli":
        return cls(sometimes_online(client_probabilities(settings, clients), settings))

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        rng = np.random.default_rng([int(seed), int(round_idx), STREAM, self.word])
        return np.flatnonzero(rng.random(self.num_clients) < self.p).astype(np.int64)

    def rates(self) -> np.ndarray:
        return self.p.copy()


MODEL = Bernoulli
