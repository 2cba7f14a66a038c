"""``--availability=cyclic``: a window of every period P (``--availability_period``).

- ``--availability_cyclic=phase`` (IBM/fedau's ``cyclic-P``): client i online
  A_i = max(1, round(P p_i)) rounds in every A_i + I_i, with I_i = max(1, P - A_i) and p_i
  from ``--availability_probs``; its phase r0_i is uniform in [0, I_i) per seed (key
  ``[seed, 0, SEED_STREAM, 3]``): online in round r iff (r - r0_i) mod (A_i + I_i) < A_i
  (offline in rounds 0 .. r0_i - 1, as there). P defaults to 100.
- ``--availability_cyclic=labels`` (FLGo's YC, WwZzz/easyFL commit 19de9fb4): online in the
  part of the period between the client's smallest and largest label, else with probability
  1 - ``--availability_cyclic_beta`` (key ``[seed, round, STREAM, 3]``). P defaults to 24.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError, DataError
from deltafl_jax.sampling.availability.base import (SEED_STREAM, STREAM, Availability,
                                                    Population, flag_text)
from deltafl_jax.sampling.availability.probabilities import client_probabilities, reads_labels

CYCLIC_WINDOWS = ("phase", "labels")


@dataclasses.dataclass(frozen=True)
class CyclicSettings:
    """The window and its period."""

    cyclic: str = setting(
        "phase", "cyclic: phase (FedAU: round(P p_i) rounds on in every period, at a random "
        "phase) | labels (FLGo's YC: online in the part of the period between the client's "
        "smallest and largest label, else with probability 1 - --availability_cyclic_beta)",
        flag="availability_cyclic", choices=CYCLIC_WINDOWS)
    period: Optional[int] = setting(
        None, "cyclic: the period P in rounds; unset: 100 (phase) or 24 (labels, FLGo's)",
        flag="availability_period", kind="integer")
    cyclic_beta: float = setting(
        0.5, "--availability_cyclic=labels: outside its window a client is online with "
        "probability 1 - beta", flag="availability_cyclic_beta")

    def __post_init__(self):
        if not 0.0 <= self.cyclic_beta <= 1.0:
            raise ConfigError(f"{flag_text('availability_cyclic_beta', self.cyclic_beta)}: a "
                              f"probability must be in [0, 1]")
        if self.period is not None and self.period < 1:
            raise ConfigError(f"{flag_text('availability_period', self.period)}: must be >= 1")


class Cyclic(Availability):
    """FedAU's cyclic participation: A_i rounds on in every A_i + I_i, at a phase drawn per
    seed (module docstring)."""

    name = "cyclic"
    summary = "cyclic (a window of every period)"
    position = 3
    settings = CyclicSettings
    word = 3

    def __init__(self, p: np.ndarray, period: int):
        p = np.asarray(p, np.float64)   # [N]
        super().__init__(p.size)
        self.on_rounds = np.maximum(1, np.round(period * p)).astype(np.int64)    # A_i
        self.off_rounds = np.maximum(1, period - self.on_rounds)                 # I_i
        self.cycle = self.on_rounds + self.off_rounds
        self._phases: Dict[int, np.ndarray] = {}

    @classmethod
    def needs_labels(cls, settings) -> bool:
        return reads_labels(settings) or settings.cyclic == "labels"

    @classmethod
    def build(cls, settings, clients: Population) -> Availability:
        if settings.cyclic == "labels":
            model = CyclicLabels(clients.label_counts, settings.period or 24,
                                 settings.cyclic_beta)
            if model.num_clients != clients.num_clients:
                raise DataError(f"availability: label counts of {model.num_clients} clients "
                                f"for {clients.num_clients} clients")
            return model   # the clients holding label M are in the window at t = T - 1
        # on at least one round in every period, whatever p_i
        return cls(client_probabilities(settings, clients), settings.period or 100)

    def phase(self, seed: int) -> np.ndarray:
        """[N] r0_i, uniform in [0, I_i): client i's first on-round is r0_i."""
        if int(seed) not in self._phases:
            rng = np.random.default_rng([int(seed), 0, SEED_STREAM, self.word])
            self._phases[int(seed)] = rng.integers(0, self.off_rounds)
        return self._phases[int(seed)]

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        r = (int(round_idx) - self.phase(seed)) % self.cycle
        return np.flatnonzero(r < self.on_rounds).astype(np.int64)

    def rates(self) -> np.ndarray:
        return self.on_rounds / self.cycle


class CyclicLabels(Availability):
    """FLGo's YC: in round t, r = (1 + t mod T) / T; client i is online when
    lo_i / M <= r <= hi_i / M (lo_i, hi_i its smallest and largest label, M the largest label
    of all clients), else with probability 1 - beta. Compared in integers:
    lo_i T <= (1 + t mod T) M <= hi_i T."""

    name = Cyclic.name
    word = Cyclic.word

    def __init__(self, label_counts: Optional[np.ndarray], period: int, beta: float):
        if label_counts is None:
            raise ConfigError("--availability_cyclic=labels needs the clients' label counts; "
                              "this dataset has none (not a classification task)")
        present = np.asarray(label_counts) > 0   # [N, C]
        super().__init__(present.shape[0])
        labels = np.flatnonzero(present.any(axis=0))
        if labels.size == 0 or labels[-1] == 0:
            raise DataError("--availability_cyclic=labels needs clients holding labels above 0")
        any_label = present.any(axis=1)
        width = present.shape[1]
        self.low = np.where(any_label, np.argmax(present, axis=1), width + 1).astype(np.int64)
        self.high = np.where(any_label, width - 1 - np.argmax(present[:, ::-1], axis=1), -1)
        self.max_label, self.period, self.beta = int(labels[-1]), int(period), float(beta)

    def window(self, round_idx: int) -> np.ndarray:
        """[N] bool: the clients whose window holds round `round_idx`."""
        x = (1 + int(round_idx) % self.period) * self.max_label
        return (self.low * self.period <= x) & (x <= self.high * self.period)

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        rng = np.random.default_rng([int(seed), int(round_idx), STREAM, self.word])
        on = self.window(round_idx) | (rng.random(self.num_clients) < 1.0 - self.beta)
        return np.flatnonzero(on).astype(np.int64)

    def rates(self) -> np.ndarray:
        inside = sum(self.window(t).astype(np.float64) for t in range(self.period))
        return (inside + (self.period - inside) * (1.0 - self.beta)) / self.period


MODEL = Cyclic
