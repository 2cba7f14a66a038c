"""The availability models as a table (deltafl_jax/sampling/availability/): a model is one module
whose ``MODEL`` declares it, the settings are the models' groups merged flat, the builder is a
lookup, and a model added as one file is found, gets its flag and is built, with no other file
changed (docs/guides/availability.md, "Adding an availability model")."""

import dataclasses
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from deltafl_jax.declared import declarations, group_of
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling import availability
from deltafl_jax.sampling.availability import (TABLE, AvailabilitySettings, build_availability,
                                               discover, settings_class)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model of one file, as a contributor writes it: client i online in round r iff
# (i + r) mod k == 0, k = --availability_every.
EVERY_K = '''
import dataclasses
import numpy as np
from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.availability.base import Availability


@dataclasses.dataclass(frozen=True)
class EverySettings:
    every: int = setting(3, "every_k: online one round in k", flag="availability_every")

    def __post_init__(self):
        if self.every < 1:
            raise ConfigError(f"--availability_every={self.every}: must be >= 1")


class EveryK(Availability):
    name = "every_k"
    summary = "every_k (client i in the rounds r with (i + r) mod k = 0)"
    position = 50
    settings = EverySettings
    word = 9

    def __init__(self, num_clients, k):
        super().__init__(num_clients)
        self.k = k

    @classmethod
    def build(cls, settings, clients):
        return cls(clients.num_clients, settings.every)

    def online(self, seed, round_idx):
        ids = np.arange(self.num_clients, dtype=np.int64)
        return ids[(ids + round_idx) % self.k == 0]

    def rates(self):
        return np.full(self.num_clients, 1.0 / self.k)


MODEL = EveryK
'''


def test_the_table_holds_the_shipped_models_in_their_order_with_their_declarations():
    assert tuple(TABLE) == ("always", "bernoulli", "markov", "cyclic", "schedule", "trace")
    # what the run reads instead of names: hand-listed from the models' laws
    assert [m.name for m in TABLE.values() if m.everyone] == ["always"]
    assert [m.name for m in TABLE.values() if m.replays] == ["schedule", "trace"]
    assert [m.name for m in TABLE.values() if not m.covers_test] == ["always", "schedule"]
    files = dict(schedule="s.npz", trace="t.json")   # named, never read
    labels = {name: tuple(TABLE[name].needs_labels(AvailabilitySettings(
        model=name, probabilities=p, **{k: v for k, v in files.items() if k == name}))
        for p in ("uniform", "data")) for name in TABLE}
    assert labels == {"always": (False, False), "bernoulli": (False, True),
                      "markov": (False, True), "cyclic": (False, True),
                      "schedule": (False, False), "trace": (False, False)}
    assert TABLE["cyclic"].needs_labels(AvailabilitySettings(model="cyclic", cyclic="labels"))


def test_the_settings_are_each_models_group_merged_flat():
    flags = [f.name for f in declarations(AvailabilitySettings)]
    for model in TABLE.values():
        own = [f.name for f in declarations(model.settings)]
        assert own == [f for f in flags if f in own]          # in the group's order
    settings = AvailabilitySettings(model="markov", markov_off_on=0.2)
    assert settings.chosen is TABLE["markov"]
    assert group_of(settings, TABLE["markov"].settings).markov_off_on == 0.2
    with pytest.raises(ConfigError, match="--availability must be one of always, bernoulli"):
        AvailabilitySettings(model="sometimes")


def test_every_groups_defaults_are_valid_so_a_run_checks_only_the_groups_it_was_given():
    """AvailabilitySettings checks a group only when its values differ from the defaults (or
    it is the chosen model's): sound because every group's defaults pass its own checks; a
    value given to a model not chosen is still refused."""
    from deltafl_jax.sampling.availability.probabilities import ProbabilitySettings
    for group in (ProbabilitySettings,) + tuple(m.settings for m in TABLE.values()):
        group()                                    # its __post_init__ checks pass
    with pytest.raises(ConfigError, match="--availability_period=0: must be >= 1"):
        AvailabilitySettings(model="always", period=0)


def one_file_model(tmp_path, monkeypatch):
    """The package's table with the one-file model EVERY_K dropped into its folder (a folder
    on its path, so that the real one is left alone)."""
    folder = tmp_path / "more_models"
    folder.mkdir()
    (folder / "every_k.py").write_text(EVERY_K)
    monkeypatch.setattr(availability, "__path__", list(availability.__path__) + [str(folder)])
    monkeypatch.delitem(sys.modules, "deltafl_jax.sampling.availability.every_k", raising=False)
    table = {m.name: m for m in discover(availability.__name__, availability.__path__)}
    sys.modules.pop("deltafl_jax.sampling.availability.every_k", None)
    return table


def test_a_model_of_one_file_is_found_gets_its_flag_and_is_built(tmp_path, monkeypatch):
    table = one_file_model(tmp_path, monkeypatch)
    assert list(table) == ["always", "bernoulli", "markov", "cyclic", "schedule", "trace",
                           "every_k"]                      # by position: 50 after 5
    settings_type = settings_class(table)
    flags = [f.name for f in declarations(settings_type)]
    assert "availability_every" in flags and flags[0] == "availability"
    assert "every_k (client i in the rounds r" in declarations(settings_type)[0].help
    settings = settings_type(model="every_k", every=4)
    model = build_availability(settings, num_clients=10, sizes=np.ones(10), label_counts=None,
                               num_rounds=8)
    for r in range(8):   # hand-written: i + r divisible by 4
        np.testing.assert_array_equal(model.online(1, r),
                                      [i for i in range(10) if (i + r) % 4 == 0])
    with pytest.raises(ConfigError, match="--availability_every=0: must be >= 1"):
        settings_type(model="every_k", every=0)
    # the shipped models' settings are unchanged by it
    assert dataclasses.asdict(settings_type(model="markov")) == dict(
        dataclasses.asdict(AvailabilitySettings(model="markov")), every=3)


@pytest.mark.parametrize("bad,match", [
    ("name = 'markov'", "share the name 'markov'"),
    ("word = 2", "share the stream word 2"),
    ("name = ''", "MODEL must be a named subclass of Availability"),
])
def test_the_table_refuses_a_declaration_it_cannot_hold(tmp_path, monkeypatch, bad, match):
    folder = tmp_path / "bad_models"
    folder.mkdir()
    (folder / "clash.py").write_text(EVERY_K.replace(
        'name = "every_k"' if bad.startswith("name") else "word = 9", bad))
    monkeypatch.setattr(availability, "__path__", list(availability.__path__) + [str(folder)])
    try:
        with pytest.raises(TypeError, match=match):
            discover(availability.__name__, availability.__path__)
    finally:
        sys.modules.pop("deltafl_jax.sampling.availability.clash", None)


@pytest.mark.slow   # a copy of the package and one run of tests/tiny.flags in a subprocess
def test_a_run_takes_a_model_added_as_one_file(tmp_path):
    """The model file copied into a copy of the package, and nothing else: the command line
    has its flag and a run under it trains the clients online (counts from its law)."""
    for part in ("deltafl_jax", "experiments"):
        shutil.copytree(os.path.join(ROOT, part), tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "deltafl_jax" / "sampling" / "availability" / "every_k.py").write_text(EVERY_K)
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", f"--flagfile={ROOT}/tests/tiny.flags",
         "--availability=every_k", "--availability_every=5", "--num_rounds=4",
         "--thetas=1.0", "--seeds=1", f"--output_dir={out}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    import json
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["availability"] == "every_k"
    assert summary["config"]["availability_every"] == 5
    counts = np.load(out / "clients.npz")
    n = counts["train_sizes"].size
    # hand-written law: client i online in rounds r = 0..3 with (i + r) mod 5 == 0; at most
    # 2 online a round (n = 10), under clients_per_round = 4, so every online client trains
    online = np.array([sum((i + r) % 5 == 0 for r in range(4)) for i in range(n)])
    np.testing.assert_array_equal(counts["train_rounds_online"][0], online)
    np.testing.assert_array_equal(counts["train_rounds_sampled"][0], online)
