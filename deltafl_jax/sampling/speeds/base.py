"""What every device-speed model is: per-client compute seconds per example and network bytes a
second, a job's virtual duration, and the declaration a model's module makes once (its name,
its settings group, its build).

A model is one module of :mod:`deltafl_jax.sampling.speeds` whose ``MODEL`` is a subclass of
:class:`DeviceSpeeds`: the class declares the model (class attributes, the class methods
:meth:`~DeviceSpeeds.check` and :meth:`~DeviceSpeeds.build`) and its build returns an
instance, asked the speeds of any client ids. The package collects the models and merges their
settings groups, with the virtual clock's, into the one flat group
:class:`~deltafl_jax.sampling.speeds.TimingSettings` (``--client_speed`` and its flags;
docs/guides/device-speeds.md, "Adding a speed model").

A device's job in a synchronous round or an asynchronous slot is: download the model, run its
local steps, upload its update. Its virtual duration (:func:`job_seconds`, FedScale's formula,
SymbioticLab/FedScale commit 7ec441c2, fedscale/cloud/internal/client_metadata.py
``ClientMetadata.get_completion_time``) is::

    seconds = per_example_s x examples + (download bytes + upload bytes) / bandwidth_Bps

with the whole model downloaded and uploaded (model_bytes each way): FedScale's upload_size =
download_size = the model's size, hence the 2 model_bytes. FedScale counts the model's size in
kbit as bytes x 8 / 1024 and divides it by a kbit/s, so one kbit/s is 1024 / 8 = 128 bytes a
second here (:data:`BYTES_PER_KBPS`). Everything here is host-side NumPy and deterministic
from the data seed.

Generated speeds need no table: client i's normal draws are a counter-based hash of its id,
keyed by the data seed, so asking any k ids costs O(k) whatever N (10^6 host-kept clients) and
the same id gets the same speed whichever other ids are asked with it. The keys are words of
``SeedSequence([data_seed, 0, STREAM, what])`` (STREAM is this package's, so no key elsewhere
in the project equals them); a draw is SplitMix64's finaliser of key + golden x (id + 1)
(Steele, Lea and Flood 2014), two such 53-bit uniforms give one normal by Box and Muller's
transform.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

STREAM = 0x5BD1   # [data_seed, 0, STREAM, what]: the keys of the generated speeds
KEYS = 5          # words of the stream drawn: (1, 2) compute, (3, 4) bandwidth, 5 assignment

BYTES_PER_KBPS = 1024.0 / 8.0   # FedScale's kbit: 1024 bits

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def flag_text(name: str, value) -> str:
    """``--name=value`` as an error message writes it (a float by ``%g``)."""
    return f"--{name}={value:g}" if isinstance(value, float) else f"--{name}={value}"


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a model that has no flags of its own."""

    def check(self) -> None:
        """Nothing to check."""


def check_ids(ids, num_clients: int) -> np.ndarray:
    """`ids` as int64 [k] in [0, num_clients), or ValueError."""
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= num_clients)):
        raise ValueError(f"client ids must be a 1-D array of ids in [0, {num_clients})")
    return ids


class DeviceSpeeds:
    """Per-client device speed: compute seconds per example and network bytes per second;
    subclassed by each model, whose class attributes declare it.

    name: ``--client_speed``'s value. summary: its line in the flag's help. position: its
    place in listings (the flag's choices and help, the flag reference), low first.
    settings: its own settings group (a frozen dataclass of
    :func:`deltafl_jax.declared.setting` fields whose flags start with ``client_speed_``,
    with a ``check()`` that raises ConfigError naming the flag; :class:`NoSettings` for
    none), merged into TimingSettings; two models may hold one field, declared alike (the
    generated models' ``--client_speed_example_s``). clock: whether the model puts rounds on a
    virtual clock (``none`` does not: its build is None).

    The base class's speeds are the same for every client (``uniform``)."""

    name = ""
    summary = ""
    position = 100
    settings: type = NoSettings
    clock = True

    def __init__(self, num_clients: int, example_s: float, bandwidth_Bps: float):
        self.num_clients = int(num_clients)
        self.example_s = float(example_s)
        self.bandwidth = float(bandwidth_Bps)

    @classmethod
    def check(cls, settings: Any) -> None:
        """ConfigError (one line naming the flag) for settings this model cannot run with,
        checked when it is the chosen model (a file it needs and was not given)."""
        del settings

    @classmethod
    def build(cls, settings: Any, num_clients: int, data_seed: int) -> Optional["DeviceSpeeds"]:
        """The speeds of `num_clients` clients under `settings` (the run's TimingSettings),
        drawn from `data_seed`; ConfigError naming the file when a file cannot be used."""
        raise NotImplementedError(f"speed model {cls.name!r} has no build")

    def per_example_s(self, ids: np.ndarray) -> np.ndarray:
        """[k] float64 > 0: seconds of training compute per example of clients `ids`."""
        return np.full(check_ids(ids, self.num_clients).shape, self.example_s)

    def bandwidth_Bps(self, ids: np.ndarray) -> np.ndarray:
        """[k] float64 > 0: bytes a second, download and upload, of clients `ids`."""
        return np.full(check_ids(ids, self.num_clients).shape, self.bandwidth)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (uint64 arithmetic wraps modulo 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def stream_keys(data_seed: int, count: int) -> np.ndarray:
    """[count + 1] uint64 keys: word w of SeedSequence([data_seed, 0, STREAM, 0])."""
    return np.random.SeedSequence([int(data_seed), 0, STREAM, 0]).generate_state(
        count + 1, np.uint64)


def hashed_uniform(key: np.uint64, ids: np.ndarray) -> np.ndarray:
    """[k] float64 in (0, 1]: a uniform per id, a pure function of (key, id)."""
    x = _mix64(np.uint64(key) + _GOLDEN * (ids.astype(np.uint64) + np.uint64(1)))
    return ((x >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53


def hashed_normal(keys: np.ndarray, words, ids: np.ndarray) -> np.ndarray:
    """[k] standard normal draws per id (Box-Muller of two hashed uniforms)."""
    u1 = hashed_uniform(keys[words[0]], ids)
    u2 = hashed_uniform(keys[words[1]], ids)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def job_seconds(speeds: DeviceSpeeds, ids: np.ndarray, examples: np.ndarray,
                model_bytes: int) -> np.ndarray:
    """[k] virtual seconds of clients `ids`' jobs of `examples` [k] examples each:
    per_example_s x examples + 2 model_bytes / bandwidth_Bps.

    FedScale's formula (``get_completion_time``): compute per example times the examples
    processed, plus the model's download and its upload, each the whole model, over the
    device's bandwidth. Of FedScale's constant factors, the factor 3 from inference to
    training time is kept in a capacity trace's per_example_s (the trace measures inference;
    --client_speed_train_factor), and its kbit of 1024 bits in the bytes a second of a kbit/s
    (so a trace device's times are FedScale's); no other factor is applied here."""
    ids = np.asarray(ids, np.int64)
    examples = np.asarray(examples, np.float64)
    transfer = 2.0 * float(model_bytes) / speeds.bandwidth_Bps(ids)
    return speeds.per_example_s(ids) * examples + transfer
