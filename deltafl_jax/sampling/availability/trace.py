"""``--availability=trace``: device traces (FedScale's ``client_behave_trace`` pickle or FLASH's
JSON; :mod:`deltafl_jax.sampling.traces`) read at the times t_r = start + r x round seconds.
Client i replays trace i mod K in the file's order (``modulo``, as FedScale) or perm[i mod K]
for a permutation drawn from ``[availability_seed, 0, MODEL_STREAM, 2]`` (``seed``): the same
online sets for every seed."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError, DataError
from deltafl_jax.sampling.availability.base import (MODEL_STREAM, Availability, Population,
                                                    flag_text)
from deltafl_jax.sampling.traces import TraceSet, load_traces

ASSIGNMENTS = ("modulo", "seed")
TRACE_FORMATS = ("auto", "fedscale", "flash")

_ASSIGN = 2   # the word of the assignment's MODEL_STREAM key


@dataclasses.dataclass(frozen=True)
class TraceSettings:
    """The trace's file, its format, its times and the clients' traces."""

    trace: Optional[str] = setting(
        None, "--availability=trace: a device trace file, FedScale's client_behave_trace (a "
        "pickle, read by a restricted unpickler) or FLASH's JSON", flag="availability_trace",
        kind="string")
    trace_format: str = setting(
        "auto", "the format of --availability_trace: fedscale | flash | auto (flash for a "
        ".json file, else fedscale)", flag="availability_trace_format", choices=TRACE_FORMATS)
    round_seconds: float = setting(
        60.0, "--availability=trace: the seconds of trace time per round: round r is read at "
        "t = --availability_trace_start + r x this", flag="availability_round_seconds")
    trace_start: float = setting(
        0.0, "--availability=trace: the trace time (seconds) of round 0",
        flag="availability_trace_start")
    assign: str = setting(
        "modulo", "--availability=trace: client i replays trace i mod K in the file's order "
        "(modulo, as FedScale) or trace perm[i mod K] for a permutation drawn from "
        "--availability_seed (seed)", flag="availability_assign", choices=ASSIGNMENTS)

    def __post_init__(self):
        if not self.round_seconds > 0.0:
            raise ConfigError(f"{flag_text('availability_round_seconds', self.round_seconds)}:"
                              f" must be > 0")


class Trace(Availability):
    """Device traces replayed at t_r = start + r x round_seconds; client i replays trace
    assign[i] (the same for every seed)."""

    name = "trace"
    summary = "trace (--availability_trace)"
    position = 5
    settings = TraceSettings
    replays = True

    def __init__(self, traces: TraceSet, assign: np.ndarray, start: float,
                 round_seconds: float, num_rounds: int):
        super().__init__(assign.size)
        self.traces, self.assign = traces, assign   # assign: [N] index into traces
        self.start, self.round_seconds = float(start), float(round_seconds)
        self.num_rounds = int(num_rounds)
        self._rates: Optional[np.ndarray] = None

    @classmethod
    def check(cls, settings) -> None:
        if not settings.trace:
            raise ConfigError("--availability=trace needs --availability_trace=PATH")

    @classmethod
    def build(cls, settings, clients: Population) -> "Trace":
        """Only the traces some client replays are kept."""
        raw = load_traces(settings.trace, settings.trace_format)
        assign = trace_assignment(settings, clients.num_clients, len(raw.keys))
        keep, local = np.unique(assign, return_inverse=True)
        model = cls(TraceSet(raw, keep), local.reshape(-1).astype(np.int64),
                    settings.trace_start, settings.round_seconds, clients.num_rounds)
        if not model.any_online():
            raise DataError(f"--availability_trace={settings.trace}: no client is online in "
                            f"any of the {clients.num_rounds} rounds (times "
                            f"{settings.trace_start:g} s on, every {settings.round_seconds:g} s)")
        return model

    def time(self, round_idx: int) -> float:
        """The trace time (seconds) at which round `round_idx` is read."""
        return self.start + int(round_idx) * self.round_seconds

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        del seed
        active = self.traces.active(self.time(round_idx))
        return np.flatnonzero(active[self.assign]).astype(np.int64)

    def any_online(self) -> bool:
        """Whether some client is online in some round of the run (stops at the first)."""
        if self._rates is not None:
            return bool(np.any(self._rates > 0))
        return any(self.traces.active(self.time(r)).any() for r in range(self.num_rounds))

    def trace_rates(self) -> np.ndarray:
        """[K] each kept trace's fraction of the run's rounds in which it is active."""
        if self._rates is None:
            total = np.zeros(len(self.traces))
            for r in range(self.num_rounds):
                total += self.traces.active(self.time(r))
            self._rates = total / max(self.num_rounds, 1)
        return self._rates

    def rates(self) -> np.ndarray:
        return self.trace_rates()[self.assign]


def trace_assignment(settings, num_clients: int, num_traces: int) -> np.ndarray:
    """[N] the trace (index in the file) each client replays: i mod K (FedScale's), or
    perm[i mod K] for a permutation drawn from --availability_seed."""
    index = np.arange(num_clients, dtype=np.int64) % num_traces
    if settings.assign == "modulo":
        return index
    rng = np.random.default_rng([int(settings.seed), 0, MODEL_STREAM, _ASSIGN])
    return rng.permutation(num_traces)[index]


MODEL = Trace
