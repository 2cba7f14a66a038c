"""``--client_speed=none``: no device speeds, so no virtual clock (the default; rounds are
counted, not timed)."""

from __future__ import annotations

from deltafl_jax.sampling.speeds.base import DeviceSpeeds


class NoClock(DeviceSpeeds):
    """No speeds: the run has no virtual clock."""

    name = "none"
    summary = "none (no clock)"
    position = 0
    clock = False

    @classmethod
    def build(cls, settings, num_clients: int, data_seed: int) -> None:
        del settings, num_clients, data_seed
        return None


MODEL = NoClock
