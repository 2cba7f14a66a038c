"""``--availability=schedule``: an ``.npz`` holding ``available``, bool [rounds, N] over the
training clients in id order (:func:`deltafl_jax.sampling.traces.load_schedule`), replayed as it
is: the same online sets for every seed."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError, DataError
from deltafl_jax.sampling.availability.base import Availability, Population
from deltafl_jax.sampling.traces import load_schedule


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """The schedule's file."""

    schedule: Optional[str] = setting(
        None, "--availability=schedule: an .npz holding 'available', bool [rounds, N] over the "
        "training clients in id order, replayed as it is", flag="availability_schedule",
        kind="string")


class Schedule(Availability):
    """An exact replay of ``available`` [rounds, N] (the same for every seed)."""

    name = "schedule"
    summary = "schedule (--availability_schedule)"
    position = 4
    settings = ScheduleSettings
    replays = True
    covers_test = False   # it names the training clients only

    def __init__(self, available: np.ndarray, num_rounds: int):
        super().__init__(available.shape[1])
        self.available = available   # [R, N] bool
        self.num_rounds = int(num_rounds)

    @classmethod
    def check(cls, settings) -> None:
        if not settings.schedule:
            raise ConfigError("--availability=schedule needs --availability_schedule=PATH")

    @classmethod
    def build(cls, settings, clients: Population) -> "Schedule":
        available = load_schedule(settings.schedule, clients.num_clients, clients.num_rounds)
        if not available[:clients.num_rounds].any():
            raise DataError(f"--availability_schedule={settings.schedule}: no client is online "
                            f"in any of the run's {clients.num_rounds} rounds")
        return cls(available, clients.num_rounds)

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        del seed
        if not 0 <= round_idx < self.available.shape[0]:
            raise ConfigError(f"--availability_schedule covers {self.available.shape[0]} "
                              f"rounds, not round {round_idx}")
        return np.flatnonzero(self.available[round_idx]).astype(np.int64)

    def rates(self) -> np.ndarray:
        return self.available[:self.num_rounds].mean(axis=0, dtype=np.float64)


MODEL = Schedule
