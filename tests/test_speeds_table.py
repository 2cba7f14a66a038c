"""The device-speed models as a table (deltafl_jax/sampling/speeds/): a model is one module whose
``MODEL`` declares it, TimingSettings is the models' groups and the clock's merged flat, the
builder is a lookup, and a model added as one file is found, gets its flags and is built
(docs/guides/device-speeds.md, "Adding a speed model")."""

import sys

import numpy as np
import pytest

from deltafl_jax.declared import declarations
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling import speeds
from deltafl_jax.sampling.speeds import (TABLE, TimingSettings, build_speeds, job_seconds,
                                         settings_class)

# A model of one file: two kinds of device, client i slow when i is odd; its own flag.
TWO_TIER = '''
import dataclasses
import numpy as np
from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.speeds.base import BYTES_PER_KBPS, DeviceSpeeds, check_ids
from deltafl_jax.sampling.speeds.uniform import example_s, kbps


@dataclasses.dataclass(frozen=True)
class TwoTierSettings:
    client_speed_example_s: float = example_s()     # shared with uniform and lognormal
    client_speed_kbps: float = kbps()
    client_speed_slowdown: float = setting(4.0, "two_tier: odd clients this many times slower")

    def check(self):
        if not self.client_speed_slowdown >= 1.0:
            raise ConfigError(f"--client_speed_slowdown={self.client_speed_slowdown:g}: "
                              f"must be >= 1")


class TwoTier(DeviceSpeeds):
    name = "two_tier"
    summary = "two_tier (odd clients slower)"
    position = 50
    settings = TwoTierSettings

    @classmethod
    def build(cls, settings, num_clients, data_seed):
        out = cls(num_clients, settings.client_speed_example_s,
                  settings.client_speed_kbps * BYTES_PER_KBPS)
        out.slowdown = settings.client_speed_slowdown
        return out

    def per_example_s(self, ids):
        ids = check_ids(ids, self.num_clients)
        return self.example_s * np.where(ids % 2 == 1, self.slowdown, 1.0)


MODEL = TwoTier
'''


def test_the_table_holds_the_shipped_models_in_their_order():
    assert tuple(TABLE) == ("none", "uniform", "lognormal", "capacity_trace")
    assert [name for name, m in TABLE.items() if not m.clock] == ["none"]
    names = {f.name for f in declarations(TimingSettings)}
    assert names == {"client_speed", "client_speed_trace", "client_speed_example_s",
                     "client_speed_mu", "client_speed_sigma", "client_speed_kbps",
                     "client_speed_kbps_sigma", "client_speed_train_factor",
                     "client_speed_assign", "round_deadline", "partial_work", "over_select",
                     "stop_at_virtual_time", "mean_online_seconds"}
    assert TimingSettings(client_speed="lognormal").chosen is TABLE["lognormal"]


def test_a_clock_flag_without_a_clock_names_the_models_with_one():
    with pytest.raises(ConfigError, match=r"--round_deadline needs a virtual clock: give "
                                          r"--client_speed=uniform\|lognormal\|capacity_trace"):
        TimingSettings(round_deadline=5.0).check()


def test_every_groups_defaults_are_valid_so_a_run_checks_only_the_groups_it_was_given():
    for group in tuple(m.settings for m in TABLE.values()) + (speeds.ClockSettings,):
        group().check()
    with pytest.raises(ConfigError, match=r"--client_speed_sigma=-1: must be >= 0"):
        TimingSettings(client_speed="uniform", client_speed_sigma=-1.0).check()


def test_a_speed_model_of_one_file_is_found_gets_its_flag_and_is_built(tmp_path, monkeypatch):
    folder = tmp_path / "more_speeds"
    folder.mkdir()
    (folder / "two_tier.py").write_text(TWO_TIER)
    monkeypatch.setattr(speeds, "__path__", list(speeds.__path__) + [str(folder)])
    try:
        table = {m.name: m for m in speeds.declared_models(
            speeds.__name__, speeds.__path__, speeds.DeviceSpeeds, speeds.PREFIX)}
    finally:
        sys.modules.pop("deltafl_jax.sampling.speeds.two_tier", None)
    assert list(table) == ["none", "uniform", "lognormal", "capacity_trace", "two_tier"]
    settings_type = settings_class(table)
    flags = [f.name for f in declarations(settings_type)]
    assert flags.count("client_speed_example_s") == 1 and "client_speed_slowdown" in flags
    settings = settings_type(client_speed="two_tier", client_speed_example_s=0.01,
                             client_speed_kbps=8.0, client_speed_slowdown=3.0)
    model = build_speeds(settings, num_clients=4, data_seed=0)
    ids = np.arange(4)
    # hand-computed: 10 examples at 0.01 s (x3 for odd ids) + 2 x 1024 bytes at 8 kbit/s
    # (8 x 128 = 1024 bytes a second)
    np.testing.assert_allclose(job_seconds(model, ids, np.full(4, 10), 1024),
                               [0.1 + 2.0, 0.3 + 2.0, 0.1 + 2.0, 0.3 + 2.0])
    with pytest.raises(ConfigError, match="--client_speed_slowdown=0.5: must be >= 1"):
        settings_type(client_speed="two_tier", client_speed_slowdown=0.5).check()
    with pytest.raises(ConfigError, match="--client_speed must be one of none, uniform"):
        TimingSettings(client_speed="two_tier").check()   # the shipped table has no such model
