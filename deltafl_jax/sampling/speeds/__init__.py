"""How fast each client's device is: the device-speed models, one module each, the table the run
looks them up in (``--client_speed``), and the virtual clock's settings.

A model is a module of this package whose ``MODEL`` is a subclass of
:class:`~deltafl_jax.sampling.speeds.base.DeviceSpeeds` declaring its name, its settings group,
whether it runs a clock and its build (:mod:`~deltafl_jax.sampling.speeds.base`, which also
gives a job's virtual duration, :func:`job_seconds`, and the hashed draws). The package finds
the models itself, so adding one is one file (docs/guides/device-speeds.md, "Adding a speed
model"):

- :data:`TABLE`: name -> model class, every module's ``MODEL``, ordered by its ``position``;
- :class:`TimingSettings`: ``--client_speed`` (the model's name), every model's own group and
  :class:`ClockSettings` (the deadline, over-selection, the clients' online sessions), merged
  into one flat group (the configuration's ``timing``; its flags, defaults and stored names
  are the groups' own);
- :func:`build_speeds`: the chosen model's build (a table lookup).

The shipped models: ``none`` (:mod:`.none`, no clock), ``uniform`` (:mod:`.uniform`),
``lognormal`` (:mod:`.lognormal`) and ``capacity_trace`` (:mod:`.capacity_trace`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

from deltafl_jax.declared import (declared_models, finite_in, given, group_of, merged_group,
                                  setting)
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.speeds.base import (BYTES_PER_KBPS, STREAM, DeviceSpeeds, flag_text,
                                              hashed_normal, hashed_uniform, job_seconds,
                                              stream_keys)
from deltafl_jax.sampling.speeds.capacity_trace import (TRACE_TRAIN_FACTOR, TraceSpeeds,
                                                        load_capacity_trace, trace_assignment)
from deltafl_jax.sampling.speeds.lognormal import LOGNORMAL_FLOOR, LognormalSpeeds

PREFIX = "client_speed_"   # every model setting's flag starts with it

TABLE: Dict[str, type] = {m.name: m for m in declared_models(__name__, __path__, DeviceSpeeds,
                                                              PREFIX)}
MODELS: Tuple[str, ...] = tuple(TABLE)


@dataclasses.dataclass(frozen=True)
class ClockSettings:
    """The virtual clock of the rounds (:mod:`deltafl_jax.sampling.clock`), whatever the
    speeds."""

    round_deadline: Optional[float] = setting(
        None, "seconds of virtual time a synchronous round waits: clients not finished by "
        "then are dropped (or keep their partial work, --partial_work)", kind="float")
    partial_work: bool = setting(
        False, "with --round_deadline: a client past the deadline keeps the local steps it "
        "completed and uploaded by then (dropped if none)")
    over_select: float = setting(
        1.0, "sample ceil(r m) clients and keep the m first to finish (ties by client id)")
    stop_at_virtual_time: Optional[float] = setting(
        None, "end the run at the first round that ends at or after this many virtual "
        "seconds", kind="float")
    mean_online_seconds: Optional[float] = setting(
        None, "clients go offline in the middle of a job: an online client's remaining online "
        "session is exponential with this mean (seconds of virtual time), so a job of d "
        "seconds survives with probability exp(-d / mean); a lost job is not aggregated; "
        "unset: a started job always finishes", kind="float")

    def check(self) -> None:
        for name in ("round_deadline", "stop_at_virtual_time", "mean_online_seconds"):
            value = getattr(self, name)
            if value is not None and not finite_in(value, 0.0, low_open=True):
                raise ConfigError(f"{flag_text(name, float(value))}: must be > 0 seconds")
        if not finite_in(self.over_select, 1.0):
            raise ConfigError(f"{flag_text('over_select', float(self.over_select))}: must be "
                              f">= 1")
        if self.partial_work and self.round_deadline is None:
            raise ConfigError("--partial_work needs --round_deadline (the time at which work "
                              "stops)")

    def off(self) -> Tuple[str, ...]:
        """The flags set away from their defaults (each needs a clock)."""
        return tuple(f.name for f in dataclasses.fields(self)
                     if f.name != "partial_work" and getattr(self, f.name) != f.default)


def settings_class(table: Dict[str, type]) -> type:
    """The merged settings group of the models of `table`: ``client_speed`` (one of the
    table's names), each model's own group in the table's order, then ClockSettings, flat (a
    field that two models share is declared alike and kept once,
    :func:`deltafl_jax.declared.merged_group`). Its ``check()`` checks the chosen model's
    settings, the values of every group given other values than its defaults
    (:func:`deltafl_jax.declared.given`; the chosen model's group always) and that the
    clock's flags have a clock; ``chosen`` is the
    chosen model's class, ``active`` whether it runs a clock."""
    groups = tuple(dict.fromkeys(m.settings for m in table.values())) + (ClockSettings,)
    model = ("client_speed", str, setting(
        "none", "each client's device speed, which puts rounds on a virtual clock: "
        + " | ".join(m.summary for m in table.values()), choices=tuple(table)))
    clocks = "|".join(name for name, m in table.items() if m.clock)

    def check(self) -> None:
        """ConfigError (one line naming the flag) for a setting that cannot run."""
        if self.client_speed not in table:
            raise ConfigError(f"--client_speed must be one of {', '.join(table)}, got "
                              f"{self.client_speed!r}")
        chosen = table[self.client_speed]
        chosen.check(self)
        for group in groups:   # a group left at its defaults (valid) is not entered
            if group is chosen.settings or given(self, group):
                group_of(self, group).check()
        if not self.active:
            for name in group_of(self, ClockSettings).off():
                raise ConfigError(f"--{name} needs a virtual clock: give --client_speed="
                                  f"{clocks}")

    def slots(self, m: int) -> int:
        """M = ceil(over_select x m), the slots sampled for m kept clients."""
        return int(math.ceil(self.over_select * m - 1e-9))

    return merged_group(
        "TimingSettings", __name__, "Device speeds and the virtual clock of the rounds "
        "(module docstring; :mod:`deltafl_jax.sampling.clock`).", (model,) + groups,
        {"check": check, "slots": slots,
         "chosen": property(lambda self: table[self.client_speed],
                            doc="The chosen model's class (its declaration)."),
         "active": property(lambda self: getattr(table.get(self.client_speed), "clock", True),
                            doc="Whether rounds run on a virtual clock (False: "
                                "--client_speed=none).")})


TimingSettings: Any = settings_class(TABLE)


def build_speeds(settings, *, num_clients: int, data_seed: int) -> Optional[DeviceSpeeds]:
    """The run's device speeds (None: a model without a clock, --client_speed=none), after
    ``settings.check()``. A capacity trace is read here (ConfigError naming the file when it
    cannot be used)."""
    settings.check()
    return settings.chosen.build(settings, int(num_clients), data_seed)


__all__ = ["TimingSettings", "ClockSettings", "DeviceSpeeds", "TABLE", "MODELS", "build_speeds",
           "job_seconds", "BYTES_PER_KBPS", "STREAM", "TRACE_TRAIN_FACTOR", "LOGNORMAL_FLOOR",
           "LognormalSpeeds", "TraceSpeeds", "load_capacity_trace", "trace_assignment",
           "hashed_uniform", "hashed_normal", "stream_keys"]
