"""``--client_speed=uniform``: every client computes one example in
``--client_speed_example_s`` seconds (0.005 s, FedScale's ``mean_seconds_per_sample``) and has
``--client_speed_kbps`` (10^4 kbit/s, about 10 Mbit/s; an assumption, FedScale's own rates
come from its trace). The two settings are shared with the lognormal model (:func:`example_s`,
:func:`kbps`: one declaration each)."""

from __future__ import annotations

import dataclasses
from typing import Any

from deltafl_jax.declared import finite_in, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.speeds.base import BYTES_PER_KBPS, DeviceSpeeds, flag_text


def example_s() -> Any:
    """``--client_speed_example_s``, as every generated model declares it."""
    return setting(
        0.005, "uniform, lognormal: seconds of training compute per example (lognormal: "
        "times exp(mu + sigma Z)); FedScale's mean_seconds_per_sample",
        flag="client_speed_example_s")


def kbps() -> Any:
    """``--client_speed_kbps``, as every generated model declares it."""
    return setting(
        10000.0, "uniform, lognormal: the bandwidth in kbit/s (1 kbit = 1024 bits, as "
        "FedScale), the median under lognormal", flag="client_speed_kbps")


def check_positive(settings, *names: str) -> None:
    """ConfigError naming the first of the flags `names` of `settings` that is not > 0."""
    for name in names:
        if not finite_in(getattr(settings, name), 0.0, low_open=True):
            raise ConfigError(f"{flag_text(name, getattr(settings, name))}: must be > 0")


@dataclasses.dataclass(frozen=True)
class UniformSettings:
    """Every device's compute seconds per example and bandwidth."""

    client_speed_example_s: float = example_s()
    client_speed_kbps: float = kbps()

    def check(self) -> None:
        check_positive(self, "client_speed_example_s", "client_speed_kbps")


class UniformSpeeds(DeviceSpeeds):
    """Every client the same device (the base class's speeds)."""

    name = "uniform"
    summary = "uniform (every client --client_speed_example_s and --client_speed_kbps)"
    position = 1
    settings = UniformSettings

    @classmethod
    def build(cls, settings, num_clients: int, data_seed: int) -> "UniformSpeeds":
        del data_seed
        return cls(num_clients, settings.client_speed_example_s,
                   settings.client_speed_kbps * BYTES_PER_KBPS)


MODEL = UniformSpeeds
