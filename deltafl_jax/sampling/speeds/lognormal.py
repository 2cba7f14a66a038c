"""``--client_speed=lognormal``: client i computes one example in
example_s x max(1e-4, exp(mu + sigma Z_i)) seconds with Z_i standard normal,
mu = ``--client_speed_mu`` (1) and sigma = ``--client_speed_sigma`` (0.6): FedScale's
``get_completion_time_lognormal`` (SymbioticLab/FedScale commit 7ec441c2) draws its device
factor as ``max(0.0001, lognormal(1, tail_skew = 0.6))`` times 0.005 s a sample, and the
defaults keep that law (median 0.005 e = 13.6 ms an example, mean 0.005 e^1.18 = 16.3 ms). Its
bandwidth is kbps x exp(sigma_b Z'_i), sigma_b = ``--client_speed_kbps_sigma`` (0.6, the same
skew; FedScale takes bandwidth from its trace), Z'_i independent of Z_i: the median is
``--client_speed_kbps``. Z_i and Z'_i are hashed from the data seed and the id
(:mod:`deltafl_jax.sampling.speeds.base`): words (1, 2) and (3, 4) of the stream. The
example's time is already a training time (FedScale's lognormal model applies no factor 3)."""

from __future__ import annotations

import dataclasses

import numpy as np

from deltafl_jax.declared import finite_in, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.speeds.base import (BYTES_PER_KBPS, KEYS, DeviceSpeeds, check_ids,
                                              flag_text, hashed_normal, stream_keys)
from deltafl_jax.sampling.speeds.uniform import check_positive, example_s, kbps

LOGNORMAL_FLOOR = 1e-4          # FedScale's max(0.0001, device factor)

# Words of the keys: two uniforms per normal, one normal for compute, one for bandwidth.
_COMPUTE, _BANDWIDTH = (1, 2), (3, 4)


@dataclasses.dataclass(frozen=True)
class LognormalSettings:
    """The law of the devices' compute factor and bandwidth."""

    client_speed_example_s: float = example_s()
    client_speed_mu: float = setting(
        1.0, "lognormal: mu of the device factor exp(mu + sigma Z) (FedScale's 1)")
    client_speed_sigma: float = setting(
        0.6, "lognormal: sigma of the compute factor (FedScale's tail_skew 0.6)")
    client_speed_kbps: float = kbps()
    client_speed_kbps_sigma: float = setting(
        0.6, "lognormal: sigma of the bandwidth factor exp(sigma_b Z')")

    def check(self) -> None:
        check_positive(self, "client_speed_example_s", "client_speed_kbps")
        for name in ("client_speed_sigma", "client_speed_kbps_sigma"):
            if not finite_in(getattr(self, name), 0.0):
                raise ConfigError(f"{flag_text(name, getattr(self, name))}: must be >= 0")
        if not finite_in(self.client_speed_mu):
            raise ConfigError(f"{flag_text('client_speed_mu', self.client_speed_mu)}: must be "
                              f"a finite number")


class LognormalSpeeds(DeviceSpeeds):
    """example_s x max(1e-4, exp(mu + sigma Z_i)) seconds an example, bandwidth x
    exp(sigma_b Z'_i) bytes a second, Z_i, Z'_i hashed from the data seed and the id."""

    name = "lognormal"
    summary = ("lognormal (FedScale's: example_s x exp(mu + sigma Z) an example, kbps x "
               "exp(sigma_b Z'))")
    position = 2
    settings = LognormalSettings

    def __init__(self, num_clients: int, example_s: float, bandwidth_Bps: float, *,
                 mu: float, sigma: float, bandwidth_sigma: float, data_seed: int):
        super().__init__(num_clients, example_s, bandwidth_Bps)
        self.mu, self.sigma, self.bandwidth_sigma = float(mu), float(sigma), float(bandwidth_sigma)
        self.keys = stream_keys(data_seed, KEYS)

    @classmethod
    def build(cls, settings, num_clients: int, data_seed: int) -> "LognormalSpeeds":
        return cls(num_clients, settings.client_speed_example_s,
                   settings.client_speed_kbps * BYTES_PER_KBPS, mu=settings.client_speed_mu,
                   sigma=settings.client_speed_sigma,
                   bandwidth_sigma=settings.client_speed_kbps_sigma, data_seed=data_seed)

    def per_example_s(self, ids: np.ndarray) -> np.ndarray:
        ids = check_ids(ids, self.num_clients)
        z = hashed_normal(self.keys, _COMPUTE, ids)
        return self.example_s * np.maximum(LOGNORMAL_FLOOR, np.exp(self.mu + self.sigma * z))

    def bandwidth_Bps(self, ids: np.ndarray) -> np.ndarray:
        ids = check_ids(ids, self.num_clients)
        z = hashed_normal(self.keys, _BANDWIDTH, ids)
        return self.bandwidth * np.exp(self.bandwidth_sigma * z)


MODEL = LognormalSpeeds
